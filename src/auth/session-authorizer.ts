// Session-level authorization (DESIGN §7): a server-side check run before
// any lease logic. The lease decides among authorized runs; it does not
// replace authorization. Two implementations, chosen by configuration: every
// session of the caller's own account (the default), or the session_acl
// table. The account itself is always checked before, by the interceptor.

import type { Principal } from "./authn.js";

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

/** The rows of the session_acl table, read by primary key (db/session-acl.ts). */
export interface SessionAclTable {
  /**
   * True when a row for the subject (or '*'), the session (or '*') and the
   * action (or '*') exists in the account.
   */
  allows(accountId: string, subject: string, sessionId: string, action: string): Promise<boolean>;
}

/**
 * The session_acl table (migrations): a row for the subject (or '*'), the
 * session (or '*') and the action (or '*') allows; no row denies. An
 * anonymous principal (development mode) matches only '*' rows.
 */
export function aclTableAuthorizer(table: SessionAclTable): SessionAuthorizer {
  return {
    allows: (principal, sessionId, action) =>
      table.allows(
        principal.account,
        principal.subject === "" ? "*" : principal.subject,
        sessionId === "" ? "*" : sessionId,
        action,
      ),
  };
}
