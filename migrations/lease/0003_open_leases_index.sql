-- The per-account quota counts an account's valid leases inside the acquire
-- statement. Valid leases are among the rows not ended by a release or a
-- revoke, so this partial index lets the count skip the account's
-- tombstones, which an account that cycles through many session ids piles
-- up until the tombstone horizon. `ended` changes on acquire and release,
-- never on renewal: renewals stay HOT updates (DESIGN §3).
CREATE INDEX leases_open_by_account ON leases (account_id) WHERE ended IS NULL;
