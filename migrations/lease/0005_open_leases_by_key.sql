-- The open-leases index of 0003 on the whole key, not the account alone.
--
-- Renew, Release and Revoke probe one key with `ended IS NULL` in their
-- guard (S4, S5). That guard implies 0003's predicate, so the planner may
-- use leases_open_by_account for the probe: an index on account_id alone,
-- which reads every open lease of the account to find one session. Without
-- statistics (a young table: the benchmark's, any new database before
-- autovacuum's first ANALYZE) it rated that index as cheap as the primary
-- key and chose it, the server's generic plans kept it, and a KeepAlive
-- batch of 100 renewals read 29,900 buffers at 10,000 leases of one
-- account (150–450 ms) and 147,400 at 50,000 (1.4 s), past
-- statement_timeout under load. Leading with the whole key, the index
-- finds one session in one probe whichever index the planner picks, and
-- the quota count (account_id = …) still reads it by its first column.
-- Neither column nor `ended` changes on renewal: renewals stay HOT
-- (DESIGN §3).
CREATE INDEX leases_open_by_key ON leases (account_id, session_id) WHERE ended IS NULL;
DROP INDEX leases_open_by_account;
