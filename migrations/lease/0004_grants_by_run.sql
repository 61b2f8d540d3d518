-- S4: a run whose lease ended never holds that session again, also after
-- another run held it in between (the key's row then names the other run).
-- The acquire statement looks for an earlier grant of the requesting run on
-- the key in the audit trail; this partial index keeps that lookup to the
-- key's grants of that run, however long the key's history.
CREATE INDEX lease_events_grants_by_run ON lease_events (account_id, session_id, run_id)
  WHERE type = 'acquired';
