// Small helpers shared by lease tests.

import { randomUUID } from "node:crypto";
import type { SessionKey } from "../../src/lease/types.js";
import type { Sql } from "../../src/postgres/pool.js";
import { type OpenTransaction, openTransaction, type TestDatabase } from "./db.js";

let counter = 0;

/** A key no other test uses. */
export function freshKey(prefix = "s"): SessionKey {
  counter += 1;
  return {
    accountId: "acct",
    sessionId: `${prefix}-${process.pid}-${counter}-${randomUUID().slice(0, 8)}`,
  };
}

/**
 * Waits until the database clock passes the key's deadline, using the
 * database's own clock (pg_sleep_until) instead of a guessed sleep.
 */
export async function untilExpired(sql: Sql, key: SessionKey): Promise<void> {
  await sql`
    SELECT pg_sleep_until(expires_at + interval '1 millisecond')
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
}

/** Every row of `leases` and `lease_events`, for before/after comparisons. */
export async function storedState(sql: Sql): Promise<unknown> {
  const leases = await sql`SELECT * FROM leases ORDER BY account_id, session_id`;
  const events = await sql`SELECT * FROM lease_events ORDER BY id`;
  return { leases: [...leases], events: [...events] };
}

/** Another transaction takes the key's row lock (FOR UPDATE) and holds it until `end`. */
export function lockLeaseRow(
  db: TestDatabase,
  key: SessionKey,
  options: { lockTimeoutMs?: number } = {},
): Promise<OpenTransaction> {
  return openTransaction(
    db,
    (tx) => tx`SELECT 1 FROM leases
               WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
               FOR UPDATE`,
    options,
  );
}
