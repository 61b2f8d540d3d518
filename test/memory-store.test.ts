// The contract of LeaseStore, run against the in-memory fake
// (test/support/memory-store.ts) and against the PostgreSQL store
// (db/lease-store.ts) alike: the same scenarios, the same assertions. The
// fake is what the fast unit tests of the streaming side stand on; this file
// is what keeps it honest when the SQL changes.

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import type { AcquireResult, LeaseStore, SessionKey } from "../src/lease/types.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey, lockLeaseRow } from "./support/leases.js";
import { createMemoryStore, manualClock } from "./support/memory-store.js";

const { db } = useTestDatabase();

interface Subject {
  store: LeaseStore;
  /** Returns once the store's clock has passed `us` (by a millisecond). */
  pass(us: bigint): Promise<void>;
  /** Another transaction takes the key's row lock; the returned function ends it. */
  lock(key: SessionKey): Promise<() => Promise<void>>;
}

const subjects: { name: string; make: () => Subject }[] = [
  {
    name: "the in-memory fake",
    make: () => {
      const clock = manualClock();
      const store = createMemoryStore({ clock });
      return {
        store,
        pass: async (us) => clock.advanceTo(us + 1_000n),
        lock: async (key) => {
          const unlock = store.lockRow(key);
          return async () => unlock();
        },
      };
    },
  },
  {
    name: "PostgreSQL",
    make: () => ({
      store: createLeaseStore(db.sql),
      pass: async (us) => {
        await db.sql`
          SELECT pg_sleep_until(to_timestamp(${us.toString()}::numeric / 1000000)
                                + interval '1 millisecond')`;
      },
      lock: async (key) => {
        const lock = await lockLeaseRow(db, key);
        return () => lock.end();
      },
    }),
  },
];

function granted(result: AcquireResult) {
  if (!result.acquired) throw new Error(`not granted: held by ${result.current?.runId}`);
  return result;
}

describe.each(subjects)("LeaseStore contract: $name", ({ make }) => {
  let s: Subject;
  let store: LeaseStore;
  beforeAll(() => {
    s = make();
    store = s.store;
  });

  const acquire = (
    key: SessionKey,
    runId: string = randomUUID(),
    ttlMs = 60_000,
    holder = "desktop",
  ) => store.acquire({ ...key, runId, ttlMs, holder });

  it("S2, S3: a free key is granted; another run is refused and told the valid lease", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key));
    expect(a).toMatchObject({ retried: false, expired: undefined });
    expect(a.eventId).toBeGreaterThan(0n);
    expect(a.lease).toMatchObject({ ...key, holder: "desktop", ttlMs: 60_000n });
    expect(a.lease.expiresAtUs - a.lease.acquiredAtUs).toBe(60_000_000n);
    expect(a.lease.remainingUs).toBeGreaterThan(59_000_000n);
    expect(a.lease.remainingUs).toBeLessThanOrEqual(60_000_000n);

    const b = await acquire(key, randomUUID(), 60_000, "browser");
    expect(b.acquired).toBe(false);
    expect(!b.acquired && b.current).toMatchObject({
      runId: a.lease.runId,
      fencingToken: a.lease.fencingToken,
      holder: "desktop",
    });
    expect(await store.get(key)).toMatchObject({ runId: a.lease.runId });
  });

  it("S6: the same run's retry keeps its token and grant time, moves the deadline, and is no new grant", async () => {
    const key = freshKey("contract");
    const runId = randomUUID();
    const a = granted(await acquire(key, runId));
    await s.pass(a.lease.acquiredAtUs);
    const again = granted(await acquire(key, runId));
    expect(again).toMatchObject({ retried: true, eventId: 0n, expired: undefined });
    expect(again.lease.fencingToken).toBe(a.lease.fencingToken);
    expect(again.lease.acquiredAtUs).toBe(a.lease.acquiredAtUs);
    expect(again.lease.expiresAtUs).toBeGreaterThan(a.lease.expiresAtUs);
  });

  it("S6: tokens strictly increase over release, re-acquire and takeover after expiry; the takeover names the expired lease", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key, randomUUID(), 100));
    const released = await store.release(key, a.lease.runId);
    expect(released).toMatchObject({ runId: a.lease.runId, fencingToken: a.lease.fencingToken });
    expect(released?.eventId).toBeGreaterThan(a.eventId);

    const b = granted(await acquire(key, randomUUID(), 100, "browser"));
    expect(b.lease.fencingToken).toBeGreaterThan(a.lease.fencingToken);
    expect(b.expired).toBeUndefined();

    await s.pass(b.lease.expiresAtUs);
    const c = granted(await acquire(key));
    expect(c.lease.fencingToken).toBeGreaterThan(b.lease.fencingToken);
    expect(c.expired).toMatchObject({
      runId: b.lease.runId,
      fencingToken: b.lease.fencingToken,
      holder: "browser",
      expiresAtUs: b.lease.expiresAtUs,
    });
    expect(c.expired?.eventId).toBeGreaterThan(b.eventId);
    expect(c.eventId).toBeGreaterThan(c.expired?.eventId ?? 0n);
  });

  it("S4: a run whose lease expired, was released or was revoked is refused its session again (LEASE_NOT_HELD with the cause); a new run is granted", async () => {
    const key = freshKey("contract");
    const runId = randomUUID();
    const a = granted(await acquire(key, runId, 100));
    await s.pass(a.lease.expiresAtUs);
    await expect(acquire(key, runId)).rejects.toMatchObject({
      name: "LeaseNotHeldError",
      reason: "expired",
    });
    const released = granted(await acquire(freshKey("contract")));
    await store.release(released.lease, released.lease.runId);
    await expect(acquire(released.lease, released.lease.runId)).rejects.toMatchObject({
      reason: "released",
    });
    const revoked = granted(await acquire(freshKey("contract")));
    await store.revoke(revoked.lease, "test");
    await expect(acquire(revoked.lease, revoked.lease.runId)).rejects.toMatchObject({
      reason: "revoked",
    });
    expect(await store.get(key)).toBeUndefined();
    const next = granted(await acquire(key));
    expect(next.lease.fencingToken).toBeGreaterThan(a.lease.fencingToken);
    expect(next.expired).toMatchObject({ runId, fencingToken: a.lease.fencingToken });
  });

  it("S4: renewals keep the token and may set a new TTL; a late renewal of an expired run fails, with nobody holding the key", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key, randomUUID(), 100));
    const renewed = await store.renew(key, a.lease.runId, 60_000);
    expect(renewed.held && renewed.lease).toMatchObject({
      fencingToken: a.lease.fencingToken,
      ttlMs: 60_000n,
    });
    const kept = await store.renew(key, a.lease.runId, undefined);
    expect(kept.held && kept.lease.ttlMs).toBe(60_000n);

    const late = freshKey("contract");
    const b = granted(await acquire(late, randomUUID(), 100));
    await s.pass(b.lease.expiresAtUs);
    expect(await store.renew(late, b.lease.runId, 60_000)).toEqual({
      held: false,
      cause: "expired",
    });
    expect(await store.get(late)).toBeUndefined();
  });

  it("S4, S5: a renewal that fails names why: released, revoked, taken_over, not_found", async () => {
    const released = freshKey("contract");
    const r = granted(await acquire(released));
    await store.release(released, r.lease.runId);
    expect(await store.renew(released, r.lease.runId, undefined)).toEqual({
      held: false,
      cause: "released",
    });

    const revoked = freshKey("contract");
    const v = granted(await acquire(revoked));
    const ended = await store.revoke(revoked, "maintenance");
    expect(ended).toMatchObject({ runId: v.lease.runId, fencingToken: v.lease.fencingToken });
    expect(await store.renew(revoked, v.lease.runId, undefined)).toEqual({
      held: false,
      cause: "revoked",
    });

    const taken = freshKey("contract");
    const t = granted(await acquire(taken, randomUUID(), 100));
    await s.pass(t.lease.expiresAtUs);
    granted(await acquire(taken));
    expect(await store.renew(taken, t.lease.runId, undefined)).toEqual({
      held: false,
      cause: "taken_over",
    });

    expect(await store.renew(freshKey("contract"), randomUUID(), undefined)).toEqual({
      held: false,
      cause: "not_found",
    });
  });

  it("S4: Renew by a run that never held the session says never_held; by one that held it before the holder, taken_over", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key, randomUUID(), 100));
    expect(await store.renew(key, randomUUID(), undefined)).toEqual({
      held: false,
      cause: "never_held",
    });
    await s.pass(a.lease.expiresAtUs);
    granted(await acquire(key));
    expect(await store.renew(key, a.lease.runId, undefined)).toEqual({
      held: false,
      cause: "taken_over",
    });
    expect(await store.renew(key, randomUUID(), undefined)).toEqual({
      held: false,
      cause: "never_held",
    });
  });

  it("S5: a release of one grant as answered (token and deadline) ends nothing once the same run re-acquired it, alone or in a batch", async () => {
    const leases = [];
    for (let i = 0; i < 3; i++) {
      const key = freshKey("contract");
      const first = granted(await acquire(key));
      await s.pass(first.lease.acquiredAtUs);
      const again = granted(await acquire(key, first.lease.runId));
      expect(again.lease.expiresAtUs).toBeGreaterThan(first.lease.expiresAtUs);
      leases.push({ key, first: first.lease, again: again.lease });
    }
    const asAnswered = (l: { fencingToken: bigint; expiresAtUs: bigint }) => ({
      fencingToken: l.fencingToken,
      expiresAtUs: l.expiresAtUs,
    });
    // Concurrent releases: one statement alone, the others group-committed.
    const stale = await Promise.all(
      leases.map((l) => store.release(l.key, l.first.runId, asAnswered(l.first))),
    );
    expect(stale).toEqual([undefined, undefined, undefined]);
    for (const l of leases) expect((await store.get(l.key))?.runId).toBe(l.first.runId);
    const current = await Promise.all(
      leases.map((l) => store.release(l.key, l.first.runId, asAnswered(l.again))),
    );
    expect(current.map((e) => e?.runId)).toEqual(leases.map((l) => l.first.runId));
    for (const l of leases) expect(await store.get(l.key)).toBeUndefined();
  });

  it("S5: release is owner-checked and idempotent; revoke ends any run's valid lease, nothing on a free key", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key));
    expect(await store.release(key, randomUUID())).toBeUndefined();
    expect((await store.get(key))?.runId).toBe(a.lease.runId);
    expect(await store.release(key, a.lease.runId)).toBeDefined();
    expect(await store.release(key, a.lease.runId)).toBeUndefined();
    expect(await store.get(key)).toBeUndefined();
    expect(await store.revoke(key, "nothing to end")).toBeUndefined();
  });

  it("S4, S8: renewMany answers in input order with renew's guard and causes; a locked row is busy without waiting, renewed with it", async () => {
    const kept = freshKey("contract");
    const expired = freshKey("contract");
    const released = freshKey("contract");
    const locked = freshKey("contract");
    const k = granted(await acquire(kept));
    const e = granted(await acquire(expired, randomUUID(), 100));
    const r = granted(await acquire(released));
    const l = granted(await acquire(locked));
    await store.release(released, r.lease.runId);
    await s.pass(e.lease.expiresAtUs);
    const item = (key: SessionKey, runId: string) => ({
      ...key,
      runId,
      ttlMs: 30_000,
      lookupHandoff: false,
    });
    const unlock = await s.lock(locked);
    let results: Awaited<ReturnType<LeaseStore["renewMany"]>>;
    try {
      results = await store.renewMany(
        [
          item(kept, k.lease.runId),
          item(expired, e.lease.runId),
          item(released, r.lease.runId),
          item(freshKey("contract"), randomUUID()),
          item(locked, l.lease.runId),
        ],
        { wait: false },
      );
    } finally {
      await unlock();
    }
    expect(results.map((x) => (x.outcome === "lost" ? x.cause : x.outcome))).toEqual([
      "renewed",
      "expired",
      "released",
      "not_found",
      "busy",
    ]);
    const [first] = results;
    expect(first?.outcome === "renewed" && first.lease).toMatchObject({
      fencingToken: k.lease.fencingToken,
      ttlMs: 30_000n,
    });
    expect(await store.get(expired)).toBeUndefined();

    const [again] = await store.renewMany([item(locked, l.lease.runId)], { wait: true });
    expect(again?.outcome).toBe("renewed");
  });

  it("S3: a handoff request leaves the lease as it was; renewMany returns the newest one for the renewed grant, only when asked", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key));
    const first = await store.requestHandoff(key, "browser", "first");
    const second = await store.requestHandoff(key, "phone", "continue here");
    expect(second.lease).toMatchObject({ runId: a.lease.runId, expiresAtUs: a.lease.expiresAtUs });
    expect(second.eventId).toBeGreaterThan(first.eventId);
    expect(second.atUs).toBeGreaterThanOrEqual(a.lease.acquiredAtUs);
    expect(await store.get(key)).toMatchObject({
      runId: a.lease.runId,
      expiresAtUs: a.lease.expiresAtUs,
    });

    const renew = (lookupHandoff: boolean) =>
      store.renewMany([{ ...key, runId: a.lease.runId, ttlMs: undefined, lookupHandoff }], {
        wait: false,
      });
    const [asked] = await renew(true);
    expect(asked?.outcome === "renewed" && asked.handoff).toEqual({
      requesterHolder: "phone",
      reason: "continue here",
      atUs: second.atUs,
      eventId: second.eventId,
    });
    const [notAsked] = await renew(false);
    expect(notAsked?.outcome === "renewed" && notAsked.handoff).toBeUndefined();

    expect(await store.requestHandoff(freshKey("contract"), "browser", "anyone?")).toEqual({
      lease: undefined,
      eventId: 0n,
      atUs: 0n,
    });
  });

  it("a handoff asked of an earlier grant is not delivered to the next one", async () => {
    const key = freshKey("contract");
    const a = granted(await acquire(key, randomUUID(), 100));
    await store.requestHandoff(key, "browser", "for the old run");
    await s.pass(a.lease.expiresAtUs);
    const b = granted(await acquire(key));
    const [renewed] = await store.renewMany(
      [{ ...key, runId: b.lease.runId, ttlMs: undefined, lookupHandoff: true }],
      { wait: false },
    );
    expect(renewed?.outcome === "renewed" && renewed.handoff).toBeUndefined();
  });

  it("readScopes reads keys and whole accounts: valid rows and tombstones with their end event, in key order", async () => {
    const accountId = `contract-${randomUUID()}`;
    const key = (sessionId: string) => ({ accountId, sessionId });
    const a = granted(await acquire(key("a")));
    const b = granted(await acquire(key("b")));
    const revoked = await store.revoke(key("b"), "maintenance");
    const c = granted(await acquire(key("c")));
    const released = await store.release(key("c"), c.lease.runId);
    const d = granted(await acquire(key("d"), randomUUID(), 100));
    await s.pass(d.lease.expiresAtUs);

    const some = await store.readScopes([
      key("a"),
      key("b"),
      { accountId: `nobody-${randomUUID()}`, sessionId: "" },
    ]);
    expect(some.observedAtUs).toBeGreaterThan(d.lease.expiresAtUs);
    expect(some.rows.map((r) => r.sessionId)).toEqual(["a", "b"]);
    expect(some.rows[0]).toMatchObject({
      runId: a.lease.runId,
      valid: true,
      ended: null,
      endEventId: null,
      endReason: null,
    });
    expect(some.rows[1]).toMatchObject({
      runId: b.lease.runId,
      valid: false,
      ended: "revoked",
      endEventId: revoked?.eventId,
      endReason: "maintenance",
      remainingUs: 0n,
    });

    const whole = await store.readScopes([{ accountId, sessionId: "" }]);
    expect(whole.rows.map((r) => [r.sessionId, r.valid, r.ended])).toEqual([
      ["a", true, null],
      ["b", false, "revoked"],
      ["c", false, "released"],
      ["d", false, null],
    ]);
    expect(whole.rows[2]).toMatchObject({ endEventId: released?.eventId, endReason: null });
    expect(whole.rows[3]).toMatchObject({ endEventId: null, endReason: null });

    const none = await store.readScopes([]);
    expect(none.rows).toEqual([]);
    expect(none.observedAtUs).toBeGreaterThan(0n);
  });

  it("list pages through an account's valid leases by session", async () => {
    const accountId = `contract-${randomUUID()}`;
    const key = (sessionId: string) => ({ accountId, sessionId });
    for (const id of ["s1", "s2", "s4", "s6"]) granted(await acquire(key(id)));
    const s3 = granted(await acquire(key("s3")));
    await store.release(key("s3"), s3.lease.runId);
    const s5 = granted(await acquire(key("s5"), randomUUID(), 100));
    await s.pass(s5.lease.expiresAtUs);

    const first = await store.list(accountId, 2, undefined);
    expect(first.leases.map((l) => l.sessionId)).toEqual(["s1", "s2"]);
    expect(first.nextAfter).toBe("s2");
    const second = await store.list(accountId, 2, first.nextAfter);
    expect(second.leases.map((l) => l.sessionId)).toEqual(["s4", "s6"]);
    expect(second.nextAfter).toBeUndefined();
    expect((await store.list(accountId, 10, "s6")).leases).toEqual([]);
  });

  it("S7 live: checkFence confirms only the valid lease's token; the highest is the newest grant's", async () => {
    const key = freshKey("contract");
    expect(await store.checkFence(key, 1n)).toEqual({ current: false, highestToken: 0n });
    const a = granted(await acquire(key));
    const token = a.lease.fencingToken;
    expect(await store.checkFence(key, token)).toEqual({ current: true, highestToken: token });
    expect(await store.checkFence(key, token - 1n)).toEqual({
      current: false,
      highestToken: token,
    });
    await store.release(key, a.lease.runId);
    expect(await store.checkFence(key, token)).toEqual({ current: false, highestToken: token });
    const b = granted(await acquire(key));
    expect(await store.checkFence(key, b.lease.fencingToken)).toEqual({
      current: true,
      highestToken: b.lease.fencingToken,
    });
    expect((await store.checkFence(key, token)).current).toBe(false);
  });
});
