-- Documents of the guarded store (GuardedStoreService). Each version records
-- the token of the run that wrote it.
CREATE TABLE guarded_documents (
  account_id text NOT NULL,
  session_id text NOT NULL,
  name text NOT NULL,
  value bytea NOT NULL,
  fencing_token bigint NOT NULL,
  updated_at timestamptz NOT NULL,
  PRIMARY KEY (account_id, session_id, name)
);
