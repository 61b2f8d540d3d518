// The session_acl table (DESIGN §7, the acl-table session authorizer): one
// primary-key lookup per check.

import { classifyDatabaseError } from "../../postgres/database-errors.js";
import type { Sql } from "../../postgres/pool.js";

export function createSessionAclTable(sql: Sql) {
  return {
    /** `subject` and `sessionId` are '*' when the caller has none (anonymous, account-wide). */
    allows: async (
      accountId: string,
      subject: string,
      sessionId: string,
      action: string,
    ): Promise<boolean> => {
      try {
        const rows = await sql<{ allowed: boolean }[]>`
          SELECT EXISTS (
            SELECT 1 FROM session_acl
            WHERE account_id = ${accountId}
              AND session_id IN (${sessionId}, '*')
              AND subject IN (${subject}, '*')
              AND actions && ARRAY[${action}, '*']
          ) AS allowed`;
        return rows[0]?.allowed === true;
      } catch (error) {
        throw classifyDatabaseError(error);
      }
    },
  };
}
