// The statement that ends valid leases before their deadline, for many keys
// at once: Release (a run ends its own lease) and Revoke (an admin ends
// whichever run's lease, audited with a reason). One statement, autocommit,
// one clock reading; a key appears at most once.
//
// S5: a release matches key + run_id + still valid (not ended, before its
//     deadline), so it can never end another run's lease, nor end a lease
//     twice: a statement that waited on the row lock may find it ended after
//     its clock reading, with an end later than that reading. Releasing
//     nothing is an answer, not an error.
// S6: the row stays as a tombstone (ended, expires_at = the end), not a
//     DELETE, so the next acquire of the key draws its token under the lock.
// S1, S6: a statement that locked a row at its latest version may find a
//     lease granted after this statement's clock reading; ending it before
//     it began would put this grant's interval out of order with the next
//     one's, so the end is never before acquired_at. Nor before the clock
//     reading of the last renewal (expires_at − ttl, at least acquired_at):
//     an end that waited behind that renewal's row lock comes after it, and
//     the audit trail says so (the fault checkers order by these times).
// S8: rows are locked in key order with SKIP LOCKED unless `wait`: a row
//     another transaction holds is answered `busy` and tried alone.

import type { EndedLease, GrantVersion } from "../../lease/types.js";
import type { Sql } from "../../postgres/pool.js";
import { keeperValid, leaseColumns, leaseOf } from "./lease-columns.js";

export interface EndItem {
  accountId: string;
  sessionId: string;
  /** The run whose lease to end; undefined ends any run's (Revoke). */
  runId: string | undefined;
  ended: "released" | "revoked";
  /** Recorded in lease_events (a revoke's reason). */
  reason: string | undefined;
  /** Ends the lease only while it is this grant with this deadline (unchanged since). */
  grant?: GrantVersion;
}

export type EndOutcome =
  | { outcome: "ended"; lease: EndedLease }
  /** No valid lease matched: nothing to end. */
  | { outcome: "none" }
  /** A matching row is held by another transaction (SKIP LOCKED): not decided. */
  | { outcome: "busy" };

interface EndRow extends Record<string, unknown> {
  ended: boolean;
  busy: boolean;
  eventId: bigint | null;
}

export async function endMany(
  sql: Sql,
  items: readonly EndItem[],
  options: { wait: boolean },
): Promise<EndOutcome[]> {
  const rows = await sql<EndRow[]>`
    WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
    wanted AS MATERIALIZED (
      SELECT * FROM unnest(
        ${items.map((_, i) => i)}::int[],
        ${items.map((i) => i.accountId)}::text[],
        ${items.map((i) => i.sessionId)}::text[],
        ${items.map((i) => i.runId ?? null)}::uuid[],
        ${items.map((i) => i.ended)}::text[],
        ${items.map((i) => i.reason ?? null)}::text[],
        -- As text: postgres.js does not send an array of JavaScript bigints as an array.
        ${items.map((i) => i.grant?.fencingToken.toString() ?? null)}::bigint[],
        ${items.map((i) => i.grant?.expiresAtUs.toString() ?? null)}::bigint[]
      ) AS w(idx, account_id, session_id, run_id, ended, reason, grant_token, grant_expires_us)
    ),
    locked AS MATERIALIZED (
      SELECT w.idx, w.ended, w.reason, held.ctid AS row_id, w.grant_token, w.grant_expires_us
      FROM (SELECT * FROM wanted ORDER BY account_id, session_id) w
      CROSS JOIN LATERAL (
        SELECT l.ctid FROM leases l
        WHERE l.account_id = w.account_id AND l.session_id = w.session_id
          AND (w.run_id IS NULL OR l.run_id = w.run_id) AND l.ended IS NULL
          AND l.expires_at > (SELECT observed_at FROM lease_clock)
          -- Keepers: S4, S5 for a lease on a keeper that is over (K1).
          AND ${keeperValid(sql, "l", sql`(SELECT observed_at FROM lease_clock)`)}
          AND (w.grant_token IS NULL OR (l.fencing_token = w.grant_token
               AND (extract(epoch FROM l.expires_at) * 1000000)::bigint = w.grant_expires_us))
        FOR UPDATE ${options.wait ? sql`` : sql`SKIP LOCKED`}
      ) held
    ),
    ended AS (
      -- The locked row versions, by ctid: stable while the lock is held.
      UPDATE leases AS held
      SET expires_at = ${endAt(sql)}, ended = k.ended
      FROM locked k, lease_clock
      -- S5's "ended IS NULL", written with coalesce: see renew-statement.ts.
      WHERE held.ctid = ANY (ARRAY(SELECT row_id FROM locked))
        AND held.ctid = k.row_id AND coalesce(held.ended, 'open') = 'open'
        AND held.expires_at > lease_clock.observed_at
        AND ${keeperValid(sql, "held", sql`lease_clock.observed_at`)}
        AND (k.grant_token IS NULL OR (held.fencing_token = k.grant_token
             AND (extract(epoch FROM held.expires_at) * 1000000)::bigint = k.grant_expires_us))
      RETURNING k.idx, k.reason, held.*
    ),
    audit AS (
      INSERT INTO lease_events
        (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
      SELECT account_id, session_id, ended, run_id, fencing_token, holder, reason, expires_at
      FROM ended
      RETURNING id, account_id, session_id
    )
    SELECT w.idx, e.idx IS NOT NULL AS ended, a.id AS event_id,
           ${leaseColumns(sql, "e")},
           -- Valid and matching in the snapshot, yet not locked: another
           -- transaction holds the row. Or locked, yet not ended: the row
           -- version locked was made by a transaction that committed after
           -- the snapshot, which the UPDATE cannot see. A scalar subquery,
           -- never hashed (acquire-statement.ts, earlierGrantEnd).
           e.idx IS NULL AND (k.idx IS NOT NULL OR coalesce((
             SELECT true FROM leases p
             WHERE p.account_id = w.account_id AND p.session_id = w.session_id
               AND (w.run_id IS NULL OR p.run_id = w.run_id) AND p.ended IS NULL
               AND p.expires_at > lease_clock.observed_at
               AND ${keeperValid(sql, "p", sql`lease_clock.observed_at`)}
               AND (w.grant_token IS NULL OR (p.fencing_token = w.grant_token
                    AND (extract(epoch FROM p.expires_at) * 1000000)::bigint = w.grant_expires_us))
             LIMIT 1
           ), false)) AS busy
    FROM wanted w
    CROSS JOIN lease_clock
    LEFT JOIN ended e ON e.idx = w.idx
    LEFT JOIN locked k ON k.idx = w.idx
    LEFT JOIN audit a ON a.account_id = e.account_id AND a.session_id = e.session_id
    ORDER BY w.idx`;
  return rows.map((row): EndOutcome => {
    if (row.ended) {
      return { outcome: "ended", lease: { ...leaseOf(row), eventId: row.eventId ?? 0n } };
    }
    return row.busy ? { outcome: "busy" } : { outcome: "none" };
  });
}

/**
 * Ends one lease in a statement lighter than a batch of one. The row is
 * locked first: with `wait` false, NOWAIT answers `busy` at once when
 * another transaction holds it (S8), and the caller decides it alone, waiting.
 */
export async function endOne(
  sql: Sql,
  item: EndItem,
  options: { wait: boolean },
): Promise<EndOutcome> {
  const grantToken = item.grant?.fencingToken ?? null;
  const grantExpiresUs = item.grant?.expiresAtUs ?? null;
  let rows: (EndedLease & Record<string, unknown>)[];
  try {
    rows = await sql<(EndedLease & Record<string, unknown>)[]>`
      WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
      locked AS MATERIALIZED (
        SELECT 1 FROM leases l, lease_clock c
        WHERE l.account_id = ${item.accountId} AND l.session_id = ${item.sessionId}
          AND (${item.runId ?? null}::uuid IS NULL OR l.run_id = ${item.runId ?? null}::uuid)
          AND l.ended IS NULL AND l.expires_at > c.observed_at
          -- Keepers: S4, S5 for a lease on a keeper that is over (K1).
          AND ${keeperValid(sql, "l", sql`c.observed_at`)}
          AND (${grantToken}::bigint IS NULL OR (l.fencing_token = ${grantToken}::bigint
               AND (extract(epoch FROM l.expires_at) * 1000000)::bigint = ${grantExpiresUs}::bigint))
        FOR UPDATE OF l ${options.wait ? sql`` : sql`NOWAIT`}
      ),
      -- By key, not by the locked ctid: when the lock was taken after a
      -- wait, the version locked is newer than this statement's snapshot,
      -- and an UPDATE by key re-checks its guard on that version (as an
      -- UPDATE does in READ COMMITTED) where one by ctid would not see it.
      ended AS (
        UPDATE leases AS held
        SET expires_at = ${endAt(sql)},
            ended = ${item.ended}
        FROM locked k, lease_clock
        WHERE held.account_id = ${item.accountId} AND held.session_id = ${item.sessionId}
          AND (${item.runId ?? null}::uuid IS NULL OR held.run_id = ${item.runId ?? null}::uuid)
          AND held.ended IS NULL AND held.expires_at > lease_clock.observed_at
          AND ${keeperValid(sql, "held", sql`lease_clock.observed_at`)}
          AND (${grantToken}::bigint IS NULL OR (held.fencing_token = ${grantToken}::bigint
               AND (extract(epoch FROM held.expires_at) * 1000000)::bigint = ${grantExpiresUs}::bigint))
        RETURNING held.*
      ),
      audit AS (
        INSERT INTO lease_events
          (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
        SELECT account_id, session_id, ended, run_id, fencing_token, holder,
               ${item.reason ?? null}::text, expires_at
        FROM ended
        RETURNING id
      )
      SELECT ${leaseColumns(sql, "ended")}, audit.id AS event_id,
             (SELECT count(*) FROM locked)::int AS locked_rows
      FROM lease_clock LEFT JOIN (ended CROSS JOIN audit) ON true`;
  } catch (error) {
    if (!options.wait && (error as { code?: unknown }).code === "55P03") return { outcome: "busy" };
    throw error;
  }
  const row = rows[0];
  if (row?.eventId != null) {
    return { outcome: "ended", lease: { ...leaseOf(row), eventId: row.eventId } };
  }
  // Locked, yet not ended: should not happen (the UPDATE re-checks the
  // guard `locked` passed, on the version it holds). Kept so that a plan
  // that did not re-check answers busy, and is retried, never "no lease".
  return row && Number(row.lockedRows) > 0 ? { outcome: "busy" } : { outcome: "none" };
}

/**
 * The end time of row `held`: the clock reading, never before its last
 * grant or renewal's (expires_at − ttl). Keepers: a lease on a keeper has no
 * renewal of its own and an open deadline ('infinity'): never before its grant.
 */
function endAt(sql: Sql) {
  return sql`CASE WHEN held.keeper_id IS NULL
    THEN greatest(lease_clock.observed_at, held.expires_at - held.ttl)
    ELSE greatest(lease_clock.observed_at, held.acquired_at) END`;
}
