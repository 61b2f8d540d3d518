// Session-level authorization (DESIGN §7): a server-side check run before
// any lease logic. The lease decides among authorized runs; it does not
// replace authorization. Two implementations, chosen by configuration: every
// session of the caller's own account (the default), or the session_acl
// table. The account itself is always checked before, by the interceptor.

import type { Principal } from "./authn.js";
import type { Sql } from "../db/pool.js";
import { classifyDatabaseError } from "../lease/errors.js";

/** What a call does to a session; each RPC maps to one action. */
export type SessionAction =
  | "acquire"
  | "renew"
  | "release"
  | "read"
  | "watch"
  | "handoff"
  | "revoke";

export interface SessionAuthorizer {
  /**
   * True when `principal` may perform `action` on `sessionId` of its own
   * account; an empty sessionId means every session (List, account-wide Watch).
   */
  allows(principal: Principal, sessionId: string, action: SessionAction): Promise<boolean>;
}

/** The default: a caller may act on every session of its own account. */
export const ownAccountAuthorizer: SessionAuthorizer = {
  allows: async () => true,
};

/**
 * The session_acl table (migrations/0004): a row for the subject (or '*'),
 * the session (or '*') and the action (or '*') allows; no row denies.
 * One primary-key lookup per check.
 */
export function aclTableAuthorizer(sql: Sql): SessionAuthorizer {
  return {
    allows: async (principal, sessionId, action) => {
      try {
        const rows = await sql<{ allowed: boolean }[]>`
          SELECT EXISTS (
            SELECT 1 FROM session_acl
            WHERE account_id = ${principal.account}
              AND session_id IN (${sessionId === "" ? "*" : sessionId}, '*')
              AND subject IN (${principal.subject === "" ? "*" : principal.subject}, '*')
              AND actions && ARRAY[${action}, '*']
          ) AS allowed`;
        return rows[0]?.allowed === true;
      } catch (error) {
        throw classifyDatabaseError(error);
      }
    },
  };
}
