// The batched renewal statement behind KeepAlive (DESIGN §3): many leases per
// statement, the same guard as a single renewal (S4), loss causes named, and
// a locked row skipped instead of holding up the batch (S8).

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import type { LeaseStore } from "../src/lease/types.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { useTestDatabase } from "./support/fixture.js";
import { lockLeaseRow, untilExpired } from "./support/leases.js";

const { db } = useTestDatabase();
let store: LeaseStore;

beforeAll(() => {
  store = createLeaseStore(db.sql);
});

const account = "acct-batch";

async function grant(sessionId: string, ttlMs = 60_000) {
  const runId = randomUUID();
  const result = await store.acquire({ accountId: account, sessionId, runId, ttlMs, holder: "t" });
  if (!result.acquired) throw new Error(`could not acquire ${sessionId}`);
  return result.lease;
}

describe("renewMany", () => {
  it("S4: renews a thousand leases in one statement, keeping every token", async () => {
    const leases = await Promise.all(
      Array.from({ length: 1000 }, (_, i) => grant(`bulk-${i}`, 10_000)),
    );
    const results = await store.renewMany(
      leases.map((l) => ({
        accountId: l.accountId,
        sessionId: l.sessionId,
        runId: l.runId,
        ttlMs: 30_000,
        lookupHandoff: false,
      })),
      { wait: false },
    );
    expect(results).toHaveLength(1000);
    results.forEach((r, i) => {
      expect(r.outcome).toBe("renewed");
      if (r.outcome !== "renewed") return;
      expect(r.lease.sessionId).toBe(leases[i]?.sessionId);
      expect(r.lease.fencingToken).toBe(leases[i]?.fencingToken);
      expect(r.lease.ttlMs).toBe(30_000n);
      expect(r.lease.expiresAtUs).toBeGreaterThan(leases[i]?.expiresAtUs ?? 0n);
    });
  });

  it("S4/S5: names the loss cause of each lease that is no longer held", async () => {
    const expired = await grant("cause-expired", 50);
    const released = await grant("cause-released");
    const revoked = await grant("cause-revoked");
    const takenOver = await grant("cause-taken", 50);
    const kept = await grant("cause-kept");
    // On the database clock, past both 50 ms deadlines.
    await untilExpired(db.sql, expired);
    await untilExpired(db.sql, takenOver);
    await store.release(released, released.runId);
    await store.revoke(revoked, "test");
    const newRun = randomUUID();
    const taken = await store.acquire({ ...takenOver, runId: newRun, ttlMs: 60_000, holder: "b" });
    expect(taken.acquired).toBe(true);
    const items = [expired, released, revoked, takenOver, kept].map((l) => ({
      accountId: l.accountId,
      sessionId: l.sessionId,
      runId: l.runId,
      ttlMs: undefined,
      lookupHandoff: false,
    }));
    items.push({ ...items[0], sessionId: "cause-never", runId: randomUUID() } as never);
    const results = await store.renewMany(items, { wait: false });
    expect(results.map((r) => (r.outcome === "lost" ? r.cause : r.outcome))).toEqual([
      "expired",
      "released",
      "revoked",
      "taken_over",
      "renewed",
      "not_found",
    ]);
    // S4: the expired run was not resurrected by the batch.
    expect(await store.get(expired)).toBeUndefined();
    expect((await store.get(takenOver))?.runId).toBe(newRun);
  });

  it("S8: a row locked by a stuck transaction is skipped, the rest of the batch renews", async () => {
    const stuck = await grant("stuck-row");
    const free = await grant("free-row");
    const lock = await lockLeaseRow(db, stuck);
    const results = await store.renewMany(
      [stuck, free].map((l) => ({
        accountId: l.accountId,
        sessionId: l.sessionId,
        runId: l.runId,
        ttlMs: undefined,
        lookupHandoff: false,
      })),
      { wait: false },
    );
    expect(results.map((r) => r.outcome)).toEqual(["busy", "renewed"]);
    await lock.end();
    const retried = await store.renewMany([{ ...stuck, ttlMs: undefined, lookupHandoff: false }], {
      wait: true,
    });
    expect(retried[0]?.outcome).toBe("renewed");
  });

  it("returns the newest handoff request recorded for the renewed grant", async () => {
    const lease = await grant("handoff-lookup");
    await store.requestHandoff(lease, "browser", "first");
    const asked = await store.requestHandoff(lease, "phone", "continue here");
    expect(asked.lease?.runId).toBe(lease.runId);
    const [result] = await store.renewMany([{ ...lease, ttlMs: undefined, lookupHandoff: true }], {
      wait: false,
    });
    expect(result?.outcome).toBe("renewed");
    if (result?.outcome !== "renewed") return;
    expect(result.handoff).toMatchObject({
      requesterHolder: "phone",
      reason: "continue here",
      eventId: asked.eventId,
    });
    const [without] = await store.renewMany(
      [{ ...lease, ttlMs: undefined, lookupHandoff: false }],
      { wait: false },
    );
    expect(without?.outcome === "renewed" && without.handoff).toBe(undefined);
  });

  it("S3: a handoff request leaves the lease as it was and records nothing when free", async () => {
    const lease = await grant("handoff-s3");
    await store.requestHandoff(lease, "browser", "please");
    const after = await store.get(lease);
    expect(after?.runId).toBe(lease.runId);
    expect(after?.expiresAtUs).toBe(lease.expiresAtUs);
    const none = await store.requestHandoff(
      { accountId: account, sessionId: "handoff-free" },
      "browser",
      "anyone?",
    );
    expect(none.lease).toBeUndefined();
    const rows = await db.sql<{ count: bigint }[]>`
      SELECT count(*) FROM lease_events WHERE session_id = 'handoff-free'`;
    expect(rows[0]?.count).toBe(0n);
  });
});

describe("readScopes", () => {
  it("reads keys and whole accounts, valid rows and tombstones, with the end event", async () => {
    const a = await grant("scope-a");
    const b = await grant("scope-b");
    await store.revoke(b, "maintenance");
    const reading = await store.readScopes([
      { accountId: account, sessionId: "scope-a" },
      { accountId: account, sessionId: "scope-b" },
      { accountId: "acct-nobody", sessionId: "" },
    ]);
    expect(reading.observedAtUs).toBeGreaterThan(0n);
    const rows = new Map(reading.rows.map((r) => [r.sessionId, r]));
    expect(rows.size).toBe(2);
    expect(rows.get("scope-a")).toMatchObject({ valid: true, ended: null, runId: a.runId });
    expect(rows.get("scope-b")).toMatchObject({
      valid: false,
      ended: "revoked",
      endReason: "maintenance",
    });
    const whole = await store.readScopes([{ accountId: account, sessionId: "" }]);
    expect(whole.rows.length).toBeGreaterThan(1000);
    const empty = await store.readScopes([]);
    expect(empty.rows).toEqual([]);
  });
});
