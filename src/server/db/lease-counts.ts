// Counting valid leases: per account for the quota, in total for the
// `leases held` gauge. Counting decides no grant by itself (see quota.ts).

import type { Sql } from "./pool.js";
import { classifyDatabaseError } from "../lease/errors.js";

export interface LeaseCounts {
  /**
   * Valid leases of `accountId` on sessions other than `exceptSessionId`,
   * counted up to `upTo`: a range scan of the primary key's account prefix
   * that stops once `upTo` are found (tombstones in the range are read too).
   */
  heldByAccount(accountId: string, exceptSessionId: string, upTo: number): Promise<number>;
  /** Valid leases of every account (a scan of the table). */
  heldTotal(): Promise<number>;
}

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
