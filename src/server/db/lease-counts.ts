// Counting valid leases, in total, for the `leases held` gauge. (The
// per-account quota is counted inside the acquire statement.)

import type { LeaseCounts } from "../../lease/types.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";
import type { Sql } from "../../postgres/pool.js";
import { keeperValid } from "./lease-columns.js";

export function createLeaseCounts(sql: Sql): LeaseCounts {
  const run = async (statement: () => Promise<{ n: number }[]>) => {
    try {
      return (await statement())[0]?.n ?? 0;
    } catch (error) {
      throw classifyDatabaseError(error);
    }
  };
  return {
    heldTotal: () =>
      run(
        () => sql<{ n: number }[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
          SELECT count(*)::int AS n FROM leases, lease_clock
          WHERE expires_at > lease_clock.observed_at
            AND ${keeperValid(sql, "leases", sql`lease_clock.observed_at`)}`,
      ),
  };
}
