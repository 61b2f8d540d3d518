-- Leases, the fencing-token sequence and the audit trail (DESIGN §2).

-- S6: CACHE 1, because a per-connection cache would hand a later grant on
-- another connection a smaller number. NO CYCLE: a wrapped token would order
-- a new run before every old one.
CREATE SEQUENCE lease_fencing_token AS bigint START 1 INCREMENT 1 NO CYCLE CACHE 1;

-- One row per session. A released, revoked or expired lease stays as a
-- tombstone (expires_at in the past) so that the next acquire of the key goes
-- through ON CONFLICT DO UPDATE, under the row lock, and draws its fencing
-- token there: tokens then follow grant order (S6).
CREATE TABLE leases (
  account_id text NOT NULL,
  session_id text NOT NULL,
  run_id uuid NOT NULL,
  fencing_token bigint NOT NULL,
  holder text NOT NULL DEFAULT '',
  ttl interval NOT NULL,
  acquired_at timestamptz NOT NULL,
  expires_at timestamptz NOT NULL,
  -- How the lease ended before its deadline: 'released' or 'revoked'; NULL
  -- while it runs to its deadline. Lets a failed renewal name its cause.
  ended text CHECK (ended IN ('released', 'revoked')),
  -- The lease this grant replaced, kept for the audit trail (an expiry has no
  -- statement of its own; the takeover records it).
  previous_run_id uuid,
  previous_fencing_token bigint,
  previous_holder text,
  previous_ended text,
  previous_expires_at timestamptz,
  PRIMARY KEY (account_id, session_id)
) WITH (
  -- Every live lease is rewritten every few seconds by renewals. Free space
  -- on each page lets those updates stay HOT (no index touches expires_at),
  -- so the table and its index do not bloat between vacuums.
  fillfactor = 50,
  autovacuum_vacuum_scale_factor = 0.02,
  autovacuum_vacuum_threshold = 1000,
  autovacuum_vacuum_cost_delay = 0,
  autovacuum_analyze_scale_factor = 0.05
);

CREATE TABLE lease_events (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  account_id text NOT NULL,
  session_id text NOT NULL,
  type text NOT NULL CHECK (type IN ('acquired', 'released', 'expired', 'revoked', 'handoff_requested')),
  run_id uuid,
  fencing_token bigint,
  holder text,
  reason text,
  at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX lease_events_by_key ON lease_events (account_id, session_id, id);
-- Retention trims by age; a BRIN index fits an append-only time column.
CREATE INDEX lease_events_by_time ON lease_events USING brin (at);
