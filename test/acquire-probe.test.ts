// S4 across holders costs one probe of the audit trail per acquire of a run
// new to its key (acquire-statement.ts, earlierGrantEnd). That probe must
// look up the requesting runs only: written as EXISTS, PostgreSQL may plan
// the batched form as a hashed subplan that reads every grant ever recorded
// once per statement — it did on a table without statistics (any young
// database, and the benchmark's), where the cycle rate at 32 concurrent
// callers fell by a quarter and kept falling as the history grew. Counted in
// index entries read (pg_stat_user_indexes), not in time.

import { randomUUID } from "node:crypto";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { Sql } from "../src/postgres/pool.js";
import { acquireMany, acquireOne } from "../src/server/db/acquire-statement.js";
import { useTestDatabase } from "./support/fixture.js";

const { db } = useTestDatabase();
const historyGrants = 5_000;
let one: Sql;

beforeAll(async () => {
  // No statistics, deterministically: autovacuum would analyze the table
  // within a minute of the history below.
  await db.sql`ALTER TABLE lease_events SET (autovacuum_enabled = off)`;
  await db.sql`
    INSERT INTO lease_events (account_id, session_id, type, run_id, fencing_token, holder)
    SELECT 'history', 's' || (i % 1000), 'acquired', gen_random_uuid(), i, 'h'
    FROM generate_series(1, ${historyGrants}) i`;
  // One connection, so that its pending statistics can be flushed and read.
  one = db.connect(1);
});

afterAll(async () => {
  await one.end({ timeout: 1 });
});

async function flushStatistics() {
  await one`SELECT pg_stat_force_next_flush()`;
  await one`SELECT 1`;
}

/** Index entries read from the grants-by-run index so far, this connection's included. */
async function grantsIndexReads(): Promise<number> {
  await flushStatistics();
  const [row] = await one<{ reads: bigint }[]>`
    SELECT idx_tup_read AS reads FROM pg_stat_user_indexes
    WHERE indexrelname = 'lease_events_grants_by_run'`;
  return Number(row?.reads ?? -1);
}

function freshItems(n: number) {
  const account = `probe-${randomUUID()}`;
  return Array.from({ length: n }, (_, i) => ({
    accountId: account,
    sessionId: `s${i}`,
    runId: randomUUID(),
    ttlMs: 30_000,
    holder: "probe",
  }));
}

describe("the ended-run probe of an acquire reads the requesting runs' grants only", () => {
  it("the counter these tests read moves: a lookup of one recorded grant reads its index entry", async () => {
    // Without this, a counter that never moved would pass the bounds below.
    const [grant] = await one<{ sessionId: string; runId: string }[]>`
      SELECT session_id, run_id FROM lease_events WHERE account_id = 'history' LIMIT 1`;
    if (!grant) throw new Error("no history");
    const before = await grantsIndexReads();
    const [found] = await one<{ n: number }[]>`
      SELECT count(*)::int AS n FROM lease_events
      WHERE account_id = 'history' AND session_id = ${grant.sessionId}
        AND type = 'acquired' AND run_id = ${grant.runId}::uuid`;
    expect(found?.n).toBe(1);
    expect((await grantsIndexReads()) - before).toBeGreaterThanOrEqual(1);
  });

  it("S4: a batched acquire of 16 new runs reads no other run's grants, on a history without statistics", async () => {
    // Several statements: the planner's choice may change once a statement is prepared.
    for (let round = 0; round < 8; round++) {
      const before = await grantsIndexReads();
      const outcomes = await acquireMany(one, freshItems(16), {
        wait: false,
        maxLeasesPerAccount: 0,
      });
      expect(outcomes.map((o) => o.outcome)).toEqual(Array(16).fill("granted"));
      const read = (await grantsIndexReads()) - before;
      expect(read, `round ${round}: index entries read`).toBeLessThanOrEqual(16);
    }
  });

  it("S4: a single-row acquire of a new run reads no other run's grants", async () => {
    for (let round = 0; round < 8; round++) {
      const before = await grantsIndexReads();
      const [item] = freshItems(1);
      if (!item) throw new Error("no item");
      const outcome = await acquireOne(one, item, { wait: false, maxLeasesPerAccount: 0 });
      expect(outcome.outcome).toBe("granted");
      expect((await grantsIndexReads()) - before, `round ${round}`).toBeLessThanOrEqual(1);
    }
  });
});
