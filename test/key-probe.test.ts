// Renew, Release and Revoke find their lease by its key, with `ended IS NULL`
// in the guard (S4, S5). Each must read that key's index entries only,
// however many open leases its account holds: an index of open leases by
// account alone satisfies the guard too, and on a table without statistics
// (any young database, and the benchmark's) the planner chose it, so every
// probe read the account's whole range — a KeepAlive batch of 100 renewals
// read 29,900 buffers at 10,000 leases of one account, and every stream of
// the benchmark ended at statement_timeout (migrations/lease/0005). The
// batched forms then update the locked rows by ctid, and the same guard
// there let the planner read that index in full (every open lease of the
// table, per statement) instead. Counted in index entries read
// (pg_stat_user_indexes), not in time.

import { randomUUID } from "node:crypto";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { Sql } from "../src/postgres/pool.js";
import { endMany, endOne } from "../src/server/db/end-statement.js";
import { renewMany, renewOne } from "../src/server/db/renew-statement.js";
import { useTestDatabase } from "./support/fixture.js";

const { db } = useTestDatabase();
const account = "crowded";
const openLeases = 5_000;
const runIds: string[] = [];
let one: Sql;

beforeAll(async () => {
  // No statistics, deterministically: autovacuum would analyze the table
  // within a minute of the rows below.
  await db.sql`ALTER TABLE leases SET (autovacuum_enabled = off)`;
  for (let i = 0; i < openLeases; i++) runIds.push(randomUUID());
  await db.sql`
    INSERT INTO leases (account_id, session_id, run_id, fencing_token, holder, ttl,
                        acquired_at, expires_at)
    SELECT ${account}, 's' || (u.i - 1), u.r, nextval('lease_fencing_token'), 'probe',
           interval '1 hour', clock_timestamp(), clock_timestamp() + interval '1 hour'
    FROM unnest(${runIds}::uuid[]) WITH ORDINALITY AS u(r, i)`;
  // One connection, so that its pending statistics can be flushed and read.
  one = db.connect(1);
});

afterAll(async () => {
  await one.end({ timeout: 1 });
});

/** Index entries read from every index of `leases` so far, this connection's included. */
async function leaseIndexReads(): Promise<number> {
  await one`SELECT pg_stat_force_next_flush()`;
  await one`SELECT 1`;
  const [row] = await one<{ reads: bigint }[]>`
    SELECT coalesce(sum(idx_tup_read), 0)::bigint AS reads FROM pg_stat_user_indexes
    WHERE relname = 'leases'`;
  return Number(row?.reads ?? -1);
}

let next = 0;
/** Leases of the crowded account not used by an earlier test. */
function take(n: number) {
  const picked = Array.from({ length: n }, (_, k) => next + k);
  next += n;
  return picked.map((i) => ({
    accountId: account,
    sessionId: `s${i}`,
    runId: runIds[i] as string,
  }));
}

/** At most this many index entries per key: the probe, and a re-read by key. */
const perKey = 4;

describe(`probes by key read one key's entries at ${openLeases.toLocaleString("en-US")} open leases of one account, without statistics`, () => {
  it("the counter these tests read moves: a lookup of one lease reads its index entry", async () => {
    // Without this, a counter that never moved would pass the bounds below.
    const before = await leaseIndexReads();
    const [found] = await one<{ n: number }[]>`
      SELECT count(*)::int AS n FROM leases WHERE account_id = ${account} AND session_id = 's0'`;
    expect(found?.n).toBe(1);
    expect((await leaseIndexReads()) - before).toBeGreaterThanOrEqual(1);
  });

  it("S4: a batched renewal of 100 leases (the KeepAlive statement)", async () => {
    // Several statements: the planner's choice may change once a statement is prepared.
    for (let round = 0; round < 6; round++) {
      const items = take(100).map((k) => ({ ...k, ttlMs: 60_000, lookupHandoff: false }));
      const before = await leaseIndexReads();
      const results = await renewMany(one, items, { wait: false });
      expect(results.map((r) => r.outcome)).toEqual(Array(100).fill("renewed"));
      const read = (await leaseIndexReads()) - before;
      expect(read, `round ${round}: index entries read`).toBeLessThanOrEqual(100 * perKey);
    }
  });

  it("renewals stay HOT updates: no index of leases holds a column a renewal changes (DESIGN §3)", async () => {
    const updates = async () => {
      await one`SELECT pg_stat_force_next_flush()`;
      await one`SELECT 1`;
      const [row] = await one<{ all: bigint; hot: bigint }[]>`
        SELECT n_tup_upd AS all, n_tup_hot_upd AS hot FROM pg_stat_user_tables
        WHERE relname = 'leases'`;
      return { all: Number(row?.all ?? 0), hot: Number(row?.hot ?? 0) };
    };
    const items = take(100).map((k) => ({ ...k, ttlMs: 60_000, lookupHandoff: false }));
    const before = await updates();
    const results = await renewMany(one, items, { wait: false });
    expect(results.map((r) => r.outcome)).toEqual(Array(100).fill("renewed"));
    const after = await updates();
    expect(after.all - before.all).toBe(100);
    expect(after.hot - before.hot, "HOT updates among the 100 renewals").toBe(100);
  });

  it("S4: a single-row renewal", async () => {
    for (let round = 0; round < 6; round++) {
      const [key] = take(1);
      if (!key) throw new Error("no key");
      const before = await leaseIndexReads();
      const result = await renewOne(
        one,
        { ...key, ttlMs: 60_000, lookupHandoff: false },
        { wait: false },
      );
      expect(result.outcome).toBe("renewed");
      expect((await leaseIndexReads()) - before, `round ${round}`).toBeLessThanOrEqual(perKey);
    }
  });

  it("S5: a batched release of 50 leases, and a batched revoke", async () => {
    for (let round = 0; round < 6; round++) {
      const revoke = round % 2 === 1;
      const items = take(50).map((k) => ({
        ...k,
        runId: revoke ? undefined : k.runId,
        ended: revoke ? ("revoked" as const) : ("released" as const),
        reason: revoke ? "probe" : undefined,
      }));
      const before = await leaseIndexReads();
      const results = await endMany(one, items, { wait: false });
      expect(results.map((r) => r.outcome)).toEqual(Array(50).fill("ended"));
      const read = (await leaseIndexReads()) - before;
      expect(read, `round ${round}: index entries read`).toBeLessThanOrEqual(50 * perKey);
    }
  });

  it("S5: a single-row release", async () => {
    for (let round = 0; round < 6; round++) {
      const [key] = take(1);
      if (!key) throw new Error("no key");
      const before = await leaseIndexReads();
      const result = await endOne(
        one,
        { ...key, ended: "released", reason: undefined },
        { wait: false },
      );
      expect(result.outcome).toBe("ended");
      expect((await leaseIndexReads()) - before, `round ${round}`).toBeLessThanOrEqual(perKey);
    }
  });
});
