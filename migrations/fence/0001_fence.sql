-- Fencing for guarded resources (DESIGN S7, §5). Nothing here refers to the
-- lease tables: a resource in its own database can apply this file alone and
-- call leasehold_fence from any language that speaks SQL. The guarded store
-- applies it before its own set (migrations/guarded).

-- The highest fencing token a resource has seen per session. Deliberately not
-- derived from `leases`: a resource knows only the tokens presented to it, and
-- may live in another database than the lease server.
CREATE TABLE leasehold_fences (
  account_id text NOT NULL,
  session_id text NOT NULL,
  highest_token bigint NOT NULL CHECK (highest_token > 0),
  updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
  PRIMARY KEY (account_id, session_id)
) WITH (
  -- Every fenced write rewrites its row; room on the page keeps those
  -- updates HOT (no index covers the changing columns).
  fillfactor = 70
);

-- S7: accepts p_token when it is >= the highest token seen for the session,
-- records it as the new highest and returns it; otherwise raises SQLSTATE
-- LHF01 (DETAIL: the highest token) so the caller's transaction cannot
-- commit a stale write by forgetting to look at a result.
--
-- Call it inside the transaction that performs the guarded write, before the
-- write. The upsert leaves the session's fence row locked until that
-- transaction ends, so writers of one session at this resource are
-- serialized: a newer token cannot be checked between an older token's
-- check and its write, and an older token checked after a newer one commits
-- is refused. Equal tokens pass: one run writes many times.
CREATE FUNCTION leasehold_fence(p_account_id text, p_session_id text, p_token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
  v_highest bigint;
BEGIN
  IF p_account_id IS NULL OR p_session_id IS NULL OR p_token IS NULL THEN
    RAISE EXCEPTION 'leasehold_fence: account_id, session_id and token are required'
      USING ERRCODE = 'null_value_not_allowed';
  END IF;
  IF p_token <= 0 THEN
    RAISE EXCEPTION 'leasehold_fence: token must be positive, got %', p_token
      USING ERRCODE = 'invalid_parameter_value';
  END IF;

  INSERT INTO leasehold_fences AS f (account_id, session_id, highest_token)
  VALUES (p_account_id, p_session_id, p_token)
  ON CONFLICT (account_id, session_id) DO UPDATE
    SET highest_token = EXCLUDED.highest_token, updated_at = clock_timestamp()
    WHERE f.highest_token <= EXCLUDED.highest_token
  RETURNING f.highest_token INTO v_highest;

  IF v_highest IS NULL THEN
    -- ON CONFLICT locked the row even though its WHERE refused the update,
    -- so this read sees the value that decided.
    SELECT f.highest_token INTO v_highest
    FROM leasehold_fences f
    WHERE f.account_id = p_account_id AND f.session_id = p_session_id;
    RAISE EXCEPTION 'fencing token % is stale: the highest token seen is %', p_token, v_highest
      USING ERRCODE = 'LHF01', DETAIL = v_highest::text;
  END IF;
  RETURN v_highest;
END
$$;

COMMENT ON FUNCTION leasehold_fence(text, text, bigint) IS
  'Leasehold S7 fence check: call inside the guarded write''s transaction; raises LHF01 for a stale token';
