// K1's added conjunct reads the keeper's row inside each lease statement
// (lease-columns.ts, keeperValid and leaseDeadline), not through the SQL
// function leasehold_keeper_deadline: PostgreSQL does not inline a function
// whose body has a subquery, and parses and plans its body at every call site
// in every execution of the calling statement. With half a dozen call sites,
// a single-row acquire or release of a keeper's lease cost PostgreSQL more
// than twice what a lease of its own did (0.38 against 0.16 ms per statement,
// pg_stat_statements, the benchmark's keeper stream at 0.24× the raw SQL).
// Counted in calls of the function (pg_stat_user_functions, track_functions
// on this test's one connection), not in time; the answers are checked too.

import { randomUUID } from "node:crypto";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { KeeperRecord, LeaseStore } from "../src/lease/types.js";
import type { Sql } from "../src/postgres/pool.js";
import { createKeeperStore } from "../src/server/db/keeper-store.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { useTestDatabase } from "./support/fixture.js";

const { db } = useTestDatabase();
const account = "probe";
let one: Sql;
let store: LeaseStore;
let keeper: KeeperRecord;

beforeAll(async () => {
  // One connection, so that its function statistics can be flushed and read.
  one = db.connect(1);
  await one`SET track_functions = 'all'`;
  store = createLeaseStore(one);
  const opened = await createKeeperStore(one).open({
    id: randomUUID(),
    accountId: account,
    holder: "probe",
    ttlMs: 60_000,
    lockDelayMs: 0,
  });
  if (!opened.held) throw new Error(`keeper not opened: ${opened.cause}`);
  keeper = opened.keeper;
});

afterAll(async () => {
  await one.end({ timeout: 1 });
});

/** Calls of leasehold_keeper_deadline so far, this connection's included. */
async function deadlineCalls(): Promise<number> {
  await one`SELECT pg_stat_force_next_flush()`;
  await one`SELECT 1`;
  const [row] = await one<{ calls: bigint }[]>`
    SELECT coalesce(sum(calls), 0)::bigint AS calls FROM pg_stat_user_functions
    WHERE funcname = 'leasehold_keeper_deadline'`;
  return Number(row?.calls ?? -1);
}

describe("the lease statements read a keeper's deadline without calling a SQL function per lease", () => {
  it("the counter these tests read moves: a call of the function is counted", async () => {
    // Without this, a counter that never moved would pass the bound below.
    const before = await deadlineCalls();
    const [row] = await one<{ deadline: Date }[]>`
      SELECT leasehold_keeper_deadline(${keeper.id}::uuid) AS deadline`;
    expect(row?.deadline).toBeInstanceOf(Date);
    expect((await deadlineCalls()) - before).toBe(1);
  });

  it("K1: acquire, get, renew, release and list of a keeper's leases, alone and batched, answer the keeper's deadline with no call", async () => {
    const before = await deadlineCalls();
    // Alone (the single-row statements), then 8 at once (the batched ones).
    for (const n of [1, 8]) {
      const keys = Array.from({ length: n }, (_, i) => ({
        accountId: account,
        sessionId: `s${n}-${i}`,
      }));
      const runIds = keys.map(() => randomUUID());
      const acquired = await Promise.all(
        keys.map((key, i) =>
          store.acquire({
            ...key,
            runId: runIds[i] as string,
            ttlMs: 60_000,
            holder: "probe",
            keeperId: keeper.id,
          }),
        ),
      );
      for (const result of acquired) {
        expect(result.acquired).toBe(true);
        // The lease's deadline is its keeper's (K1), not the 'infinity' stored.
        if (result.acquired) expect(result.lease.expiresAtUs).toBe(keeper.expiresAtUs);
      }
      const got = await Promise.all(keys.map((key) => store.get(key)));
      for (const [i, lease] of got.entries()) expect(lease?.runId).toBe(runIds[i]);
      const renewed = await Promise.all(
        keys.map((key, i) => store.renew(key, runIds[i] as string, undefined)),
      );
      for (const r of renewed) {
        expect(r.held).toBe(true);
        if (r.held) expect(r.lease.expiresAtUs).toBe(keeper.expiresAtUs);
      }
      const listed = await store.list(account, 100, undefined);
      expect(listed.leases.map((l) => l.sessionId)).toEqual(
        expect.arrayContaining(keys.map((k) => k.sessionId)),
      );
      const released = await Promise.all(
        keys.map((key, i) => store.release(key, runIds[i] as string)),
      );
      for (const [i, ended] of released.entries()) {
        expect(ended?.runId).toBe(runIds[i]);
        // Ended now, before its keeper's deadline.
        expect(ended?.expiresAtUs).toBeLessThan(keeper.expiresAtUs);
      }
      expect(await Promise.all(keys.map((key) => store.get(key)))).toEqual(
        keys.map(() => undefined),
      );
    }
    expect((await deadlineCalls()) - before).toBe(0);
  });
});

describe("a lease whose keeper row is gone (trimmed) reads as long over in the statements' own read", () => {
  it("K1, S4: get, list, renew (alone and batched) and release refuse it, and another run takes the key", async () => {
    const gone = await createKeeperStore(one).open({
      id: randomUUID(),
      accountId: account,
      holder: "probe",
      ttlMs: 60_000,
      lockDelayMs: 0,
    });
    if (!gone.held) throw new Error(`keeper not opened: ${gone.cause}`);
    const key = { accountId: account, sessionId: `trimmed-${randomUUID()}` };
    const runId = randomUUID();
    const granted = await store.acquire({
      ...key,
      runId,
      ttlMs: 60_000,
      holder: "probe",
      keeperId: gone.keeper.id,
    });
    expect(granted.acquired).toBe(true);
    // Trimmed by retention while its lease row still names it (no foreign key).
    await one`DELETE FROM keepers WHERE id = ${gone.keeper.id}::uuid`;
    expect(await store.get(key)).toBeUndefined();
    const listed = await store.list(account, 1000, undefined);
    expect(listed.leases.map((l) => l.sessionId)).not.toContain(key.sessionId);
    expect((await store.renew(key, runId, undefined)).held).toBe(false);
    const [batched] = await store.renewMany(
      [{ ...key, runId, ttlMs: undefined, lookupHandoff: false }],
      { wait: true },
    );
    expect(batched?.outcome).toBe("lost");
    expect(await store.release(key, runId)).toBeUndefined();
    const other = await store.acquire({
      ...key,
      runId: randomUUID(),
      ttlMs: 5_000,
      holder: "next",
    });
    expect(other.acquired).toBe(true);
    if (other.acquired)
      expect(other.lease.fencingToken).toBeGreaterThan(
        granted.acquired ? granted.lease.fencingToken : 0n,
      );
  });
});
