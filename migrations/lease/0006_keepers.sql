-- Keepers (DESIGN K1, K2; docs/keepers.md): one heartbeat keeps every lease
-- acquired on a keeper. A heartbeat rewrites one keeper row, whatever the
-- number of its leases.

CREATE TABLE keepers (
  id uuid PRIMARY KEY,
  account_id text NOT NULL,
  holder text NOT NULL DEFAULT '',
  ttl interval NOT NULL,
  -- K2: after an expiry (not a close or a revoke), none of the keeper's keys
  -- is granted to another run before expires_at + lock_delay.
  lock_delay interval NOT NULL DEFAULT interval '0',
  created_at timestamptz NOT NULL,
  -- The deadline while the keeper runs; the end time once closed or revoked.
  expires_at timestamptz NOT NULL,
  -- Final once set: a keeper never runs again.
  ended text CHECK (ended IN ('closed', 'revoked', 'expired')),
  end_reason text
) WITH (
  -- Every heartbeat rewrites its row: free space on each page keeps those
  -- updates HOT (no index covers expires_at), as for leases.
  fillfactor = 50,
  autovacuum_vacuum_scale_factor = 0.02,
  autovacuum_vacuum_threshold = 1000,
  autovacuum_vacuum_cost_delay = 0,
  autovacuum_analyze_scale_factor = 0.05
);

-- The keepers-per-account limit counts an account's open keepers. `ended`
-- changes on end only, never on a heartbeat: heartbeats stay HOT. The id is
-- in the index too: a heartbeat's guard (id, account_id, ended IS NULL)
-- implies its predicate, and on a table without statistics the planner may
-- take it over the primary key (the cause of issue 33 on leases); with the
-- whole key a probe reads one entry whichever index is chosen.
CREATE INDEX keepers_open_by_account ON keepers (account_id, id) WHERE ended IS NULL;

-- The keeper a lease was acquired on; NULL for a lease of its own. A lease on
-- a keeper is written with expires_at 'infinity' while open: every deadline
-- guard on leases stays a necessary condition, and the keeper's deadline is
-- the added one (leasehold_keeper_deadline below). No foreign key: a missing
-- keeper reads as ended, and keepers are trimmed apart from tombstones.
ALTER TABLE leases ADD COLUMN keeper_id uuid;

-- A keeper's open leases: its close, its revoke, the leases-per-keeper limit.
-- keeper_id and ended change on grant and end, never on renewal (HOT).
CREATE INDEX leases_open_by_keeper ON leases (keeper_id)
  WHERE keeper_id IS NOT NULL AND ended IS NULL;

-- The deadline a keeper gives its leases: its expires_at (its deadline while
-- it runs, its end time once closed or revoked); -infinity for a keeper that
-- does not exist (trimmed: long over). STRICT: a lease without a keeper
-- (NULL) never calls it, and least(expires_at, NULL) is expires_at. STABLE:
-- it reads the calling statement's snapshot; a decision that must not race a
-- heartbeat locks the keeper row itself (acquire-statement.ts).
CREATE FUNCTION leasehold_keeper_deadline(p_keeper_id uuid)
RETURNS timestamptz
LANGUAGE sql
STABLE STRICT
AS $$
  SELECT coalesce((SELECT k.expires_at FROM keepers k WHERE k.id = p_keeper_id), '-infinity')
$$;

-- K1, K2: when another run may take over an open lease of keeper p_keeper_id
-- at p_at: its lock-delay's end after an expiry, its end after a close or a
-- revoke, -infinity for a keeper that no longer exists; NULL while the keeper
-- is valid. Called by the acquire UPSERT's takeover condition, under the
-- lease row's lock, for leases on a keeper only (STRICT; a lease of its own
-- never calls it).
--
-- A keeper past its deadline is first marked expired, under its row lock:
-- the write is what keeps an in-flight heartbeat from extending a keeper one
-- of whose leases is taken over. A heartbeat that committed first makes the
-- marking's re-check fail (the keeper is valid: NULL); one that waits behind
-- the marking re-checks `ended IS NULL` on the marked version, and fails.
-- VOLATILE: each statement here reads the latest committed version.
CREATE FUNCTION leasehold_keeper_free_at(p_keeper_id uuid, p_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE STRICT
AS $$
DECLARE
  v_free timestamptz;
BEGIN
  UPDATE keepers SET ended = 'expired'
  WHERE id = p_keeper_id AND ended IS NULL AND expires_at <= p_at
  RETURNING expires_at + lock_delay INTO v_free;
  IF FOUND THEN
    RETURN v_free;
  END IF;
  SELECT CASE WHEN k.ended IS NULL THEN NULL
              WHEN k.ended = 'expired' THEN k.expires_at + k.lock_delay
              ELSE k.expires_at END
  INTO v_free
  FROM keepers k WHERE k.id = p_keeper_id;
  IF NOT FOUND THEN
    RETURN '-infinity';
  END IF;
  RETURN v_free;
END
$$;
