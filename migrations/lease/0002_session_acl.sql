-- Session ACL for the acl-table session authorizer (DESIGN §7): which
-- subjects of an account may do what on which sessions. Rows are written by
-- the operator (or an admin tool); Leasehold only reads them. Without a
-- matching row, the acl-table authorizer denies.

CREATE TABLE session_acl (
  account_id text NOT NULL,
  -- The token's `sub`, or '*' for every subject of the account.
  subject text NOT NULL CHECK (subject <> ''),
  -- A session id, or '*' for every session of the account (List and an
  -- account-wide Watch need a '*' row).
  session_id text NOT NULL CHECK (session_id <> ''),
  -- Any of acquire, renew, release, read, watch, handoff, revoke; or '*'.
  actions text[] NOT NULL CHECK (
    actions <@ ARRAY['acquire', 'renew', 'release', 'read', 'watch', 'handoff', 'revoke', '*']
  ),
  PRIMARY KEY (account_id, session_id, subject)
);
