// Counting valid leases: per account for the quota, in total for the
// `leases held` gauge. Counting decides no grant by itself (see quota.ts).

import type { LeaseCounts } from "../lease/types.js";
import { classifyDatabaseError } from "./database-errors.js";
import type { Sql } from "./pool.js";

export function createLeaseCounts(sql: Sql): LeaseCounts {
  const run = async (statement: () => Promise<{ n: number }[]>) => {
    try {
      return (await statement())[0]?.n ?? 0;
    } catch (error) {
      throw classifyDatabaseError(error);
    }
  };
  return {
    heldByAccount: (accountId, exceptSessionId, upTo) =>
      run(
        () => sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM (
            SELECT 1 FROM leases
            WHERE account_id = ${accountId} AND session_id <> ${exceptSessionId}
              AND expires_at > clock_timestamp()
            LIMIT ${upTo}
          ) AS held`,
      ),
    heldTotal: () =>
      run(
        () => sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM leases WHERE expires_at > clock_timestamp()`,
      ),
  };
}
