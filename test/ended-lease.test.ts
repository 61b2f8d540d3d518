// S4, S5 and Revoke: a run whose lease ended (released, revoked, expired)
// never holds that session again. The races are made deterministic: another
// transaction holds the row lock while the statement under test reads its
// clock and waits; that transaction then ends the lease with the real end
// statement (its clock reading is later) and commits, so the waiting
// statement finds an ended row whose end time is after its own clock reading.

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import { LeaseNotHeldError } from "../src/lease/errors.js";
import type { LeaseRecord, LeaseStore, SessionKey } from "../src/lease/types.js";
import type { Sql } from "../src/postgres/pool.js";
import { acquireMany, acquireOne } from "../src/server/db/acquire-statement.js";
import { endOne } from "../src/server/db/end-statement.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { renewMany, renewOne } from "../src/server/db/renew-statement.js";
import { createRenewalBatcher } from "../src/server/streams/renewal-batcher.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey, untilExpired } from "./support/leases.js";
import { waitFor } from "./support/wait.js";

const { db } = useTestDatabase();
let store: LeaseStore;

beforeAll(() => {
  store = createLeaseStore(db.sql);
});

type Ending = "released" | "revoked";

async function grant(prefix: string, ttlMs = 30_000): Promise<LeaseRecord> {
  const key = freshKey(prefix);
  const granted = await store.acquire({ ...key, runId: randomUUID(), ttlMs, holder: "test" });
  if (!granted.acquired) throw new Error("not granted");
  return granted.lease;
}

async function row(key: SessionKey) {
  const [found] = await db.sql<
    { runId: string; fencingToken: bigint; ended: string | null; valid: boolean }[]
  >`SELECT run_id, fencing_token, ended, expires_at > clock_timestamp() AS valid
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  return found;
}

async function endEvents(key: SessionKey): Promise<string[]> {
  const rows = await db.sql<{ type: string }[]>`
    SELECT type FROM lease_events
    WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
      AND type IN ('released', 'revoked')
    ORDER BY id`;
  return rows.map((r) => r.type);
}

/**
 * Holds the row of `lease` in another transaction, starts `decide` (which
 * reads its clock, then waits on the row lock), and once it waits ends the
 * lease in that transaction with the real end statement and commits: the
 * end's clock reading is later than `decide`'s.
 */
async function endedWhileWaiting<T>(
  lease: LeaseRecord,
  how: Ending,
  decide: () => Promise<T>,
): Promise<T> {
  const conn = db.connect(1);
  let locked!: () => void;
  const isLocked = new Promise<void>((resolve) => {
    locked = resolve;
  });
  let proceed!: () => void;
  const go = new Promise<void>((resolve) => {
    proceed = resolve;
  });
  const tx = conn.begin(async (t) => {
    await t`SELECT 1 FROM leases
            WHERE account_id = ${lease.accountId} AND session_id = ${lease.sessionId}
            FOR UPDATE`;
    locked();
    await go;
    const ended = await endOne(
      t as unknown as Sql,
      {
        accountId: lease.accountId,
        sessionId: lease.sessionId,
        runId: how === "released" ? lease.runId : undefined,
        ended: how,
        reason: how === "revoked" ? "test" : undefined,
      },
      { wait: true },
    );
    if (ended.outcome !== "ended")
      throw new Error(`the end did not end the lease: ${ended.outcome}`);
  });
  try {
    await Promise.race([isLocked, tx]);
    const decision = decide();
    decision.catch(() => {});
    await waitFor(
      async () =>
        (
          await db.sql`SELECT 1 FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock'`
        ).length > 0,
      { what: "the statement under test to wait on the row lock" },
    );
    proceed();
    await tx;
    return await decision;
  } finally {
    proceed();
    await conn.end({ timeout: 1 });
  }
}

const renewItem = (lease: LeaseRecord) => ({
  accountId: lease.accountId,
  sessionId: lease.sessionId,
  runId: lease.runId,
  ttlMs: 30_000,
  lookupHandoff: false,
});

const acquireItem = (lease: LeaseRecord) => ({
  accountId: lease.accountId,
  sessionId: lease.sessionId,
  runId: lease.runId,
  ttlMs: 30_000,
  holder: "test",
});

describe("a renewal whose clock reading predates the end of its lease", () => {
  for (const how of ["released", "revoked"] as const) {
    it(`S4: the single-row renewal that waited on a lease ${how} meanwhile is lost (${how}), and the lease stays ended`, async () => {
      const lease = await grant(`renew-one-${how}`);
      const answer = await endedWhileWaiting(lease, how, () =>
        renewOne(db.sql, renewItem(lease), { wait: true }),
      );
      expect(answer).toEqual({ outcome: "lost", cause: how });
      expect(await row(lease)).toMatchObject({ ended: how, valid: false });
      expect(await store.get(lease)).toBeUndefined();
    });
  }

  it("S4: unary Renew (NOWAIT, then waiting) of a lease revoked while it waits fails with `revoked`", async () => {
    const lease = await grant("renew-unary");
    const answer = await endedWhileWaiting(lease, "revoked", () =>
      store.renew(lease, lease.runId, 30_000),
    );
    expect(answer).toEqual({ held: false, cause: "revoked" });
    expect(await row(lease)).toMatchObject({ ended: "revoked", valid: false });
  });

  it("S4: the batch statement waiting on a lease released meanwhile does not renew it", async () => {
    const lease = await grant("renew-many");
    const other = await grant("renew-many-other");
    const answer = await endedWhileWaiting(lease, "released", () =>
      renewMany(db.sql, [renewItem(lease), renewItem(other)], { wait: true }),
    );
    expect(answer[0]?.outcome).not.toBe("renewed");
    expect(answer[1]?.outcome).toBe("renewed");
    expect(await row(lease)).toMatchObject({ ended: "released", valid: false });
  });

  it("S4: a KeepAlive renewal retried on a locked row that was released meanwhile is lost (released)", async () => {
    const lease = await grant("renew-batcher");
    const batcher = createRenewalBatcher({ store, tickMs: 5 });
    try {
      const answer = await endedWhileWaiting(lease, "released", () =>
        batcher.renew(renewItem(lease)),
      );
      expect(answer).toEqual({ renewed: false, cause: "released" });
      expect(await row(lease)).toMatchObject({ ended: "released", valid: false });
    } finally {
      batcher.close();
    }
  });
});

describe("a same-run Acquire of an ended lease is refused, never a new grant", () => {
  for (const how of ["released", "revoked"] as const) {
    it(`S4, S5: the single-row acquire that waited on a lease ${how} meanwhile is refused (${how}); the row stays ended`, async () => {
      const lease = await grant(`acquire-one-${how}`);
      const answer = await endedWhileWaiting(lease, how, () =>
        acquireOne(db.sql, acquireItem(lease), { wait: true, maxLeasesPerAccount: 0 }),
      );
      expect(answer).toEqual({ outcome: "ended", cause: how });
      expect(await row(lease)).toMatchObject({
        ended: how,
        valid: false,
        fencingToken: lease.fencingToken,
      });
    });
  }

  it("S4, S5: the batch acquire waiting on a lease revoked meanwhile refuses that key and grants the others", async () => {
    const lease = await grant("acquire-many");
    const free = freshKey("acquire-many-free");
    const answer = await endedWhileWaiting(lease, "revoked", () =>
      acquireMany(
        db.sql,
        [acquireItem(lease), { ...free, runId: randomUUID(), ttlMs: 30_000, holder: "test" }],
        { wait: true, maxLeasesPerAccount: 0 },
      ),
    );
    expect(answer[0]).toEqual({ outcome: "ended", cause: "revoked" });
    expect(answer[1]?.outcome).toBe("granted");
    expect(await row(lease)).toMatchObject({ ended: "revoked", valid: false });
  });

  it("S4, S5: the store's Acquire (NOWAIT, then waiting) of a lease released while it waits throws LEASE_NOT_HELD (released)", async () => {
    const lease = await grant("acquire-store");
    const answer = endedWhileWaiting(lease, "released", () => store.acquire(acquireItem(lease)));
    await expect(answer).rejects.toBeInstanceOf(LeaseNotHeldError);
    await expect(answer).rejects.toMatchObject({ reason: "released" });
    expect(await row(lease)).toMatchObject({ ended: "released", valid: false });
  });

  it("S4, S5: a same-run Acquire after Release, Revoke or expiry is refused with the cause", async () => {
    const released = await grant("again-released");
    expect(await store.release(released, released.runId)).toBeDefined();
    const revoked = await grant("again-revoked");
    expect(await store.revoke(revoked, "test")).toBeDefined();
    const expired = await grant("again-expired", 1_000);
    await untilExpired(db.sql, expired);
    for (const [lease, cause] of [
      [released, "released"],
      [revoked, "revoked"],
      [expired, "expired"],
    ] as const) {
      await expect(store.acquire(acquireItem(lease))).rejects.toMatchObject({
        name: "LeaseNotHeldError",
        reason: cause,
      });
      expect(await row(lease)).toMatchObject({ valid: false, fencingToken: lease.fencingToken });
    }
    // Several of them in one group-committed statement decide the same way.
    const answers = await Promise.allSettled(
      [released, revoked, expired].map((lease) => store.acquire(acquireItem(lease))),
    );
    expect(
      answers.map((a) => a.status === "rejected" && (a.reason as LeaseNotHeldError).reason),
    ).toEqual(["released", "revoked", "expired"]);
  });

  it("S4: a run whose lease ended is refused also after another run held the key in between (single-row, batched and the store)", async () => {
    // The key's row names the other run now: only the audit trail remembers
    // the first run's grant. Each way of ending it, and each statement form.
    const cases = [] as { lease: LeaseRecord; cause: "released" | "revoked" | "expired" }[];
    for (const cause of ["released", "revoked", "expired"] as const) {
      const lease = await grant(`again-after-other-${cause}`, cause === "expired" ? 1_000 : 30_000);
      if (cause === "released") await store.release(lease, lease.runId);
      if (cause === "revoked") await store.revoke(lease, "test");
      if (cause === "expired") await untilExpired(db.sql, lease);
      const other = await store.acquire({
        ...acquireItem(lease),
        runId: randomUUID(),
        ttlMs: 1_000,
      });
      if (!other.acquired) throw new Error("another run must be granted");
      // The other run ends too (by expiry), so nothing stands in the way.
      await untilExpired(db.sql, other.lease);
      cases.push({ lease, cause });
    }
    for (const { lease, cause } of cases) {
      expect(
        await acquireOne(db.sql, acquireItem(lease), { wait: false, maxLeasesPerAccount: 0 }),
      ).toEqual({ outcome: "ended", cause });
    }
    const batched = await acquireMany(
      db.sql,
      cases.map(({ lease }) => acquireItem(lease)),
      { wait: false, maxLeasesPerAccount: 0 },
    );
    expect(batched).toEqual(cases.map(({ cause }) => ({ outcome: "ended", cause })));
    for (const { lease, cause } of cases) {
      await expect(store.acquire(acquireItem(lease))).rejects.toMatchObject({
        name: "LeaseNotHeldError",
        reason: cause,
      });
      // Nothing was granted: the row still names the other run's ended lease.
      expect((await row(lease))?.runId).not.toBe(lease.runId);
    }
  });

  it("S3: a new run still takes over an ended lease, with a larger token", async () => {
    const lease = await grant("again-new-run");
    await store.release(lease, lease.runId);
    const next = await store.acquire({ ...acquireItem(lease), runId: randomUUID() });
    if (!next.acquired) throw new Error("a new run must be granted");
    expect(next.lease.fencingToken).toBeGreaterThan(lease.fencingToken);
  });
});

describe("an end whose clock reading predates another end", () => {
  it("S5: a release waiting on a lease revoked meanwhile ends nothing and records nothing", async () => {
    const lease = await grant("end-after-end");
    const answer = await endedWhileWaiting(lease, "revoked", () =>
      endOne(
        db.sql,
        { ...lease, runId: lease.runId, ended: "released", reason: undefined },
        { wait: true },
      ),
    );
    expect(answer).toEqual({ outcome: "none" });
    expect(await row(lease)).toMatchObject({ ended: "revoked", valid: false });
    expect(await endEvents(lease)).toEqual(["revoked"]);
  });
});
