// What every lease statement shares: the columns of a lease as LeaseRecord
// wants them, with database times in microseconds since the epoch and
// `remaining` computed from the statement's one clock reading (S9).

import type postgres from "postgres";
import type { LeaseRecord } from "../../lease/types.js";
import type { Sql } from "../../postgres/pool.js";

/**
 * The lease columns of table alias `t`, relative to `lease_clock.observed_at`
 * (every statement reads the clock once, in a materialized `lease_clock` CTE).
 * `prefix` names the output columns apart when a row carries two leases
 * (`cur` gives cur_account_id, …, read back by leaseOf(row, "cur")).
 * `withKey` false leaves out account, session and run, for a statement whose
 * caller already has them (the renewal batch).
 */
export function leaseColumns(
  sql: Sql,
  t: string,
  prefix = "",
  { withKey = true } = {},
): postgres.PendingQuery<postgres.Row[]> {
  const c = (name: string) => sql(prefix === "" ? name : `${prefix}_${name}`);
  const key = sql`
    ${sql(t)}.account_id AS ${c("account_id")}, ${sql(t)}.session_id AS ${c("session_id")},
    ${sql(t)}.run_id AS ${c("run_id")},`;
  return sql`
    ${withKey ? key : sql``} ${sql(t)}.fencing_token AS ${c("fencing_token")},
    ${sql(t)}.holder AS ${c("holder")}, ${sql(t)}.keeper_id::text AS ${c("keeper_id")},
    (extract(epoch FROM ${sql(t)}.ttl) * 1000)::bigint AS ${c("ttl_ms")},
    (extract(epoch FROM ${sql(t)}.acquired_at) * 1000000)::bigint AS ${c("acquired_at_us")},
    (extract(epoch FROM ${leaseDeadline(sql, t)}) * 1000000)::bigint AS ${c("expires_at_us")},
    (extract(epoch FROM greatest(${leaseDeadline(sql, t)} - lease_clock.observed_at, interval '0'))
      * 1000000)::bigint AS ${c("remaining_us")}`;
}

// Keepers (K1; docs/keepers.md). A lease on a keeper is stored with
// expires_at 'infinity' while open: every deadline guard on `leases` stays a
// necessary condition, and keeperValid below is the added one.
//
// The keeper's deadline is read by a scalar subquery written into each
// statement, not by calling the SQL function leasehold_keeper_deadline
// (migrations/lease/0006_keepers.sql), which answers the same: PostgreSQL
// does not inline a SQL function whose body has a subquery, and runs it
// through the SQL-function executor, which parses and plans its body once per
// call site in every execution of the calling statement. A single-row acquire
// or release of a keeper's lease has half a dozen such call sites: they cost
// PostgreSQL more than the rest of the statement. A subquery in the statement
// is planned with it (once: the pool prepares every statement) and reads the
// same snapshot a STABLE function would.

/**
 * The deadline keeper `keeper_id` of row alias `t` gives its leases: its
 * expires_at (its deadline while it runs, its end time once closed or
 * revoked), -infinity when it no longer exists (trimmed: long over), NULL for
 * a lease of its own (no keeper is read).
 */
function keeperDeadline(sql: Sql, t: string): postgres.PendingQuery<postgres.Row[]> {
  return sql`CASE WHEN ${sql(t)}.keeper_id IS NOT NULL THEN coalesce(
      (SELECT lease_keeper.expires_at FROM keepers lease_keeper
       WHERE lease_keeper.id = ${sql(t)}.keeper_id),
      '-infinity'::timestamptz) END`;
}

/**
 * The deadline of the lease in row alias `t` (which has acquired_at,
 * expires_at and keeper_id): its own, or its keeper's when earlier; never
 * before its grant (a keeper trimmed away reads as long over).
 */
export function leaseDeadline(sql: Sql, t: string): postgres.PendingQuery<postgres.Row[]> {
  return sql`greatest(${sql(t)}.acquired_at, least(${sql(t)}.expires_at, ${keeperDeadline(sql, t)}))`;
}

/**
 * K1: the keeper of the lease in row alias `t`, if it has one, is valid at
 * `at` (its deadline not passed, not closed or revoked: both set its
 * expires_at to the end). True for a lease of its own.
 */
export function keeperValid(
  sql: Sql,
  t: string,
  at: postgres.PendingQuery<postgres.Row[]>,
): postgres.PendingQuery<postgres.Row[]> {
  return sql`(${sql(t)}.keeper_id IS NULL OR ${keeperDeadline(sql, t)} > ${at})`;
}

/** The LeaseRecord of a row whose lease columns carry `prefix` (camelCased by the pool). */
export function leaseOf(row: object, prefix = ""): LeaseRecord {
  const get = (name: string) =>
    (row as Record<string, unknown>)[
      prefix === "" ? name : `${prefix}${name.charAt(0).toUpperCase()}${name.slice(1)}`
    ];
  const keeperId = get("keeperId") as string | null | undefined;
  return {
    accountId: get("accountId") as string,
    sessionId: get("sessionId") as string,
    runId: get("runId") as string,
    fencingToken: get("fencingToken") as bigint,
    holder: get("holder") as string,
    ttlMs: get("ttlMs") as bigint,
    acquiredAtUs: get("acquiredAtUs") as bigint,
    expiresAtUs: get("expiresAtUs") as bigint,
    remainingUs: get("remainingUs") as bigint,
    // Only a keeper's lease carries it (K1): a lease of its own stays as it was.
    ...(keeperId ? { keeperId } : {}),
  };
}
