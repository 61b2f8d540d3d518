// The renew statement, for many leases at once: the KeepAlive batch of every
// stream of an instance (one statement per tick) and unary Renew calls
// (group-committed). One statement, so throughput is not bound by commit
// latency (DESIGN §3).
//
// S4: key + run_id + not ended + not expired, at one clock reading: a late
//     renewal of an expired run matches nothing, even when nobody has taken
//     the session over. `ended` is checked as well as the deadline because a
//     statement that waited on the row lock sees the version a Release or
//     Revoke committed after its clock reading, whose end (expires_at) can
//     be later than that reading: only `ended` says that lease is over.
// S8: rows are locked in key order; with SKIP LOCKED a row held by another
//     transaction (a stuck one) is left out instead of stalling the batch,
//     answered `busy`, and the caller retries it alone, with waiting.

import type { LeaseRecord, RenewItem, RenewManyResult } from "../../lease/types.js";
import type { Sql } from "../../postgres/pool.js";
import { keeperValid, leaseColumns } from "./lease-columns.js";

// A renewed row's key and run are the request's (the guard matched them
// exactly; run ids reach the store lower-cased, as PostgreSQL prints a
// uuid): the statement does not send them back.
interface RenewManyRow
  extends Pick<
    LeaseRecord,
    "fencingToken" | "holder" | "ttlMs" | "acquiredAtUs" | "expiresAtUs" | "remainingUs"
  > {
  renewed: boolean;
  keeperId: string | null;
  currentExists: boolean;
  currentRunId: string | null;
  currentEnded: string | null;
  currentValid: boolean;
  handoffRequester: string | null;
  handoffReason: string | null;
  handoffAtUs: bigint | null;
  handoffEventId: bigint | null;
}

/** Results are in input order; a failed renewal names its cause (not decided: `busy`). */
export async function renewMany(
  sql: Sql,
  items: readonly RenewItem[],
  options: { wait: boolean },
): Promise<RenewManyResult[]> {
  if (items.length === 0) return [];
  const rows = await sql<RenewManyRow[]>`
    WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
    wanted AS MATERIALIZED (
      SELECT * FROM unnest(
        ${items.map((_, i) => i)}::int[],
        ${items.map((i) => i.accountId)}::text[],
        ${items.map((i) => i.sessionId)}::text[],
        ${items.map((i) => i.runId)}::uuid[],
        ${items.map((i) => (i.ttlMs === undefined ? null : i.ttlMs))}::bigint[],
        ${items.map((i) => (i.lookupHandoff ? 1 : 0))}::int[]
      ) AS w(idx, account_id, session_id, run_id, ttl_ms, lookup_handoff)
    ),
    -- LATERAL keeps every lookup an index probe by primary key, and
    -- the update a TID scan: a join would let the planner hash the
    -- whole table for each batch (35 ms per statement at 50,000 rows).
    locked AS MATERIALIZED (
      SELECT w.idx, w.ttl_ms, held.ctid AS row_id
      FROM (SELECT * FROM wanted ORDER BY account_id, session_id) w
      CROSS JOIN LATERAL (
        SELECT l.ctid FROM leases l
        WHERE l.account_id = w.account_id AND l.session_id = w.session_id
          AND l.run_id = w.run_id AND l.ended IS NULL
          AND l.expires_at > (SELECT observed_at FROM lease_clock)
          -- Keepers: S4 for a lease on a keeper that is over (K1).
          AND ${keeperValid(sql, "l", sql`(SELECT observed_at FROM lease_clock)`)}
        FOR UPDATE ${options.wait ? sql`` : sql`SKIP LOCKED`}
      ) held
    ),
    renewed AS (
      -- The locked row versions, by ctid: stable while the lock is held.
      -- A row changed by a transaction that committed after this
      -- statement began is not seen here and is answered busy.
      -- Keepers: a lease on a keeper keeps its TTL and its open deadline
      -- ('infinity'): only the keeper's heartbeat extends it.
      UPDATE leases AS held SET
        ttl = CASE WHEN held.keeper_id IS NOT NULL THEN held.ttl
          ELSE coalesce(k.ttl_ms * interval '1 millisecond', held.ttl) END,
        expires_at = CASE WHEN held.keeper_id IS NOT NULL THEN held.expires_at
          ELSE lease_clock.observed_at
            + coalesce(k.ttl_ms * interval '1 millisecond', held.ttl) END
      FROM locked k, lease_clock
      -- S4's "ended IS NULL", written with coalesce (ended is NULL,
      -- 'released' or 'revoked': the same test): written plainly, it let
      -- the planner read the open-leases index (whose predicate it is) in
      -- full, as a bitmap of every open lease of the table, which it
      -- preferred to the TID scan on a table without statistics.
      WHERE held.ctid = ANY (ARRAY(SELECT row_id FROM locked))
        AND held.ctid = k.row_id AND coalesce(held.ended, 'open') = 'open'
        AND held.expires_at > lease_clock.observed_at
        AND ${keeperValid(sql, "held", sql`lease_clock.observed_at`)}
      RETURNING k.idx, held.*
    )
    SELECT r.idx IS NOT NULL AS renewed,
           ${leaseColumns(sql, "r", "", { withKey: false })},
           cur.account_id IS NOT NULL AS current_exists,
           cur.run_id AS current_run_id,
           cur.ended AS current_ended,
           coalesce(cur.expires_at > lease_clock.observed_at
                    AND ${keeperValid(sql, "cur", sql`lease_clock.observed_at`)}, false) AS current_valid,
           h.holder AS handoff_requester, h.reason AS handoff_reason,
           h.at_us AS handoff_at_us, h.id AS handoff_event_id
    FROM wanted w
    CROSS JOIN lease_clock
    LEFT JOIN renewed r ON r.idx = w.idx
    -- Read at the statement's snapshot: explains a renewal that did
    -- not happen; it decides nothing.
    LEFT JOIN LATERAL (
      SELECT c.account_id, c.run_id, c.ended, c.expires_at, c.keeper_id FROM leases c
      WHERE r.idx IS NULL AND c.account_id = w.account_id AND c.session_id = w.session_id
      OFFSET 0 -- keeps it a per-row probe, skipped for renewed rows
    ) cur ON true
    LEFT JOIN LATERAL (
      SELECT e.id, e.holder, e.reason, (extract(epoch FROM e.at) * 1000000)::bigint AS at_us
      FROM lease_events e
      WHERE w.lookup_handoff = 1 AND r.idx IS NOT NULL
        AND e.account_id = w.account_id AND e.session_id = w.session_id
        AND e.type = 'handoff_requested' AND e.fencing_token = r.fencing_token
      ORDER BY e.id DESC
      LIMIT 1
    ) h ON true
    ORDER BY w.idx`;
  return rows.map((row, i): RenewManyResult => {
    const item = items[i] as RenewItem;
    if (row.renewed) {
      const handoff =
        row.handoffEventId === null
          ? undefined
          : {
              requesterHolder: row.handoffRequester ?? "",
              reason: row.handoffReason ?? "",
              atUs: row.handoffAtUs ?? 0n,
              eventId: row.handoffEventId,
            };
      const lease: LeaseRecord = {
        accountId: item.accountId,
        sessionId: item.sessionId,
        runId: item.runId,
        fencingToken: row.fencingToken,
        holder: row.holder,
        ttlMs: row.ttlMs,
        acquiredAtUs: row.acquiredAtUs,
        expiresAtUs: row.expiresAtUs,
        remainingUs: row.remainingUs,
        ...(row.keeperId ? { keeperId: row.keeperId } : {}),
      };
      return { outcome: "renewed", lease, handoff };
    }
    if (!row.currentExists) return { outcome: "lost", cause: "not_found" };
    if (row.currentRunId !== item.runId) return { outcome: "lost", cause: "taken_over" };
    if (row.currentEnded === "released") return { outcome: "lost", cause: "released" };
    if (row.currentEnded === "revoked") return { outcome: "lost", cause: "revoked" };
    if (!row.currentValid) return { outcome: "lost", cause: "expired" };
    return { outcome: "busy" };
  });
}

/**
 * Renews one lease in a statement lighter than a batch of one. The row is
 * locked first: with `wait` false, NOWAIT answers `busy` at once when
 * another transaction holds it (S8). A renewal that matched nothing is
 * explained by a second read, which decides nothing.
 */
export async function renewOne(
  sql: Sql,
  item: RenewItem,
  options: { wait: boolean },
): Promise<RenewManyResult> {
  const newTtl = item.ttlMs === undefined ? null : item.ttlMs;
  let rows: (LeaseRecord & { renewed: boolean; lockedRows: number })[];
  try {
    rows = await sql<(LeaseRecord & { renewed: boolean; lockedRows: number })[]>`
      WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
      locked AS MATERIALIZED (
        SELECT 1 FROM leases l, lease_clock c
        WHERE l.account_id = ${item.accountId} AND l.session_id = ${item.sessionId}
          AND l.run_id = ${item.runId}::uuid AND l.ended IS NULL
          AND l.expires_at > c.observed_at
          -- Keepers: S4 for a lease on a keeper that is over (K1).
          AND ${keeperValid(sql, "l", sql`c.observed_at`)}
        FOR UPDATE OF l ${options.wait ? sql`` : sql`NOWAIT`}
      ),
      -- By key, not by the locked ctid (end-statement.ts, endOne: a version
      -- locked after a wait is newer than the snapshot).
      renewed AS (
        -- Keepers: a lease on a keeper keeps its TTL and its open deadline.
        UPDATE leases AS held SET
          ttl = CASE WHEN held.keeper_id IS NOT NULL THEN held.ttl
            ELSE coalesce(${newTtl}::bigint * interval '1 millisecond', held.ttl) END,
          expires_at = CASE WHEN held.keeper_id IS NOT NULL THEN held.expires_at
            ELSE lease_clock.observed_at
              + coalesce(${newTtl}::bigint * interval '1 millisecond', held.ttl) END
        FROM locked k, lease_clock
        WHERE held.account_id = ${item.accountId} AND held.session_id = ${item.sessionId}
          AND held.run_id = ${item.runId}::uuid AND held.ended IS NULL
          AND held.expires_at > lease_clock.observed_at
          AND ${keeperValid(sql, "held", sql`lease_clock.observed_at`)}
        RETURNING held.*
      )
      SELECT ${leaseColumns(sql, "renewed")}, renewed.account_id IS NOT NULL AS renewed,
             (SELECT count(*) FROM locked)::int AS locked_rows
      FROM lease_clock LEFT JOIN renewed ON true`;
  } catch (error) {
    if (!options.wait && (error as { code?: unknown }).code === "55P03") return { outcome: "busy" };
    throw error;
  }
  const answer = rows[0];
  if (answer?.renewed) {
    const { renewed: _, lockedRows: __, ...lease } = answer;
    return { outcome: "renewed", lease, handoff: undefined };
  }
  // Locked, yet not renewed: should not happen (the UPDATE re-checks the
  // guard `locked` passed, on the version it holds). Kept so that a plan
  // that did not re-check answers busy, and is retried, never "lost".
  if (answer && answer.lockedRows > 0) return { outcome: "busy" };
  const [row] = await sql<{ runId: string; ended: string | null }[]>`
    SELECT run_id, ended FROM leases
    WHERE account_id = ${item.accountId} AND session_id = ${item.sessionId}`;
  if (!row) return { outcome: "lost", cause: "not_found" };
  if (row.runId !== item.runId) return { outcome: "lost", cause: "taken_over" };
  if (row.ended === "released") return { outcome: "lost", cause: "released" };
  if (row.ended === "revoked") return { outcome: "lost", cause: "revoked" };
  return { outcome: "lost", cause: "expired" };
}
