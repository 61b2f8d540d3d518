-- Keepers (K1, K2; docs/keepers.md, "Row locks on a keeper"): a grant on a
-- keeper reads the keeper row FOR KEY SHARE, so that a heartbeat (an update
-- of no key column: FOR NO KEY UPDATE) never waits for a grant. The expiry
-- marking must still exclude a grant in flight, as a close does: it locks the
-- row FOR UPDATE before it writes. Its UPDATE alone takes FOR NO KEY UPDATE,
-- which does not conflict with a grant's FOR KEY SHARE; FOR UPDATE does, so
-- the marking waits for a grant in flight to commit, and a grant that comes
-- after it waits, re-checks `ended IS NULL` on the marked version and is
-- refused. Otherwise as in 0006: a heartbeat that committed first makes the
-- marking's re-check fail (the keeper is valid: NULL); one that waits behind
-- the marking re-checks `ended IS NULL` on the marked version, and fails.
-- The lock is taken only when there is a keeper to mark: a takeover of
-- another lease of a keeper already marked reads it without a lock.
CREATE OR REPLACE FUNCTION leasehold_keeper_free_at(p_keeper_id uuid, p_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE STRICT
AS $$
DECLARE
  v_free timestamptz;
BEGIN
  SELECT k.expires_at + k.lock_delay INTO v_free
  FROM keepers k
  WHERE k.id = p_keeper_id AND k.ended IS NULL AND k.expires_at <= p_at
  FOR UPDATE;
  IF FOUND THEN
    UPDATE keepers SET ended = 'expired' WHERE id = p_keeper_id;
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
