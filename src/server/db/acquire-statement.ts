// The acquire statement (DESIGN §3): the seed's conditional UPSERT, for many
// keys at once. One statement, autocommit, one clock reading; a key appears
// at most once (group-commit.ts sees to it).
//
// S2: the primary key decides between racers: INSERT … ON CONFLICT DO UPDATE.
// S3: DO UPDATE applies only to an expired or ended row, or to the same run
//     re-acquiring (an idempotent retry that keeps its token).
// S6: a takeover draws its token inside DO UPDATE SET, under the row lock,
//     so tokens follow grant order; tombstones make every re-acquire take
//     that path. New keys are inserted in key order, so two batches that
//     insert the same new keys wait on each other in one order, never in a cycle.
// S8: the batch's existing rows are locked first, in key order, with SKIP
//     LOCKED: a row another transaction holds is left out of the statement
//     and answered `busy`, and the caller tries that key alone, waiting on
//     the lock up to lock_timeout. A stuck transaction on one key never holds
//     up the others.
// S9: observed_at is read once; a row locked at its latest version decides
//     with that earlier instant and counts the deadline from it: both err on
//     the safe side.
// Quota: valid leases of the account on other sessions, counted once per
// account per statement up to the quota, at the statement's snapshot, plus
// the grants before it in the same batch. Grants being committed by other
// statements at the same time (other instances) are not counted, so an
// account can overshoot by the acquires of it running concurrently
// elsewhere, as with any count that does not serialize every acquire of an
// account behind one lock (S8 keeps sessions independent). The count
// excludes the requested session, so an idempotent retry or a takeover at
// the quota still succeeds.

import type postgres from "postgres";
import type { ExpiredLease, LeaseRecord } from "../../lease/types.js";
import type { Sql } from "../../postgres/pool.js";
import {
  keeperAcquireCtes,
  keeperDelayedUntil,
  keeperExpiresAt,
  keeperRefusal,
  keeperTakeover,
  keeperTtl,
} from "./keeper-acquire.js";
import { keeperValid, leaseColumns, leaseDeadline, leaseOf } from "./lease-columns.js";

export interface AcquireItem {
  accountId: string;
  sessionId: string;
  runId: string;
  ttlMs: number;
  holder: string;
  /** Keepers: the keeper to grant the lease on (keeper-acquire.ts). */
  keeperId?: string;
}

/** How a run's own lease ended, as a same-run Acquire finds it. */
export type EndCause = "released" | "revoked" | "expired";

export type AcquireOutcome =
  | {
      outcome: "granted";
      lease: LeaseRecord;
      /** The same run again (an idempotent retry): same token, later deadline. */
      retried: boolean;
      /** The 'acquired' row in lease_events; 0n for an idempotent retry. */
      eventId: bigint;
      /** The unreleased lease past its deadline this grant replaced. */
      expired: ExpiredLease | undefined;
    }
  /** Held by another run's valid lease: `current`, read under the row lock. */
  | { outcome: "held"; current: LeaseRecord }
  /**
   * S4: the key's row is this run's lease, ended (released, revoked, or
   * past its deadline): a run whose lease ended never holds it again.
   */
  | { outcome: "ended"; cause: EndCause }
  /** Another transaction holds the row (SKIP LOCKED): not decided. */
  | { outcome: "busy" }
  /** The account holds as many valid leases as its quota allows. */
  | { outcome: "quota" }
  /** Keepers: the keeper asked for is not valid (expired, ended, unknown, another account's). */
  | { outcome: "keeper" }
  /** Keepers: the keeper holds as many leases as the leases-per-keeper limit allows. */
  | { outcome: "keeper_full" }
  /**
   * Keepers (K2): the key's lease was on a keeper that expired; no run gets
   * it before `untilUs` (database time, µs since the epoch).
   */
  | { outcome: "delayed"; untilUs: bigint }
  /**
   * Not granted, and the lease in the way is not known: a row inserted after
   * this statement's snapshot by a concurrent grant. Not decided here.
   */
  | { outcome: "unknown" };

interface AcquireRow extends Record<string, unknown> {
  decision: "try" | "busy" | "quota" | "ended" | "keeper" | "keeper_full";
  reusedCause: EndCause | "expired" | null;
  granted: boolean;
  retried: boolean | null;
  eventId: bigint | null;
  expiredEventId: bigint | null;
  expiredRunId: string | null;
  expiredFencingToken: bigint | null;
  expiredHolder: string | null;
  expiredExpiresAtUs: bigint | null;
  heldByLock: boolean;
  ownEnded: boolean;
  lockedEnded: EndCause | null;
  delayedUntilUs: bigint | null;
}

/**
 * Decides `items` (distinct keys) in one statement. With `wait` false, rows
 * locked by other transactions are answered `busy`; with `wait` true, the
 * statement waits for them (up to lock_timeout). `maxLeasesPerAccount` 0
 * turns the quota off.
 */
export async function acquireMany(
  sql: Sql,
  items: readonly AcquireItem[],
  options: { wait: boolean; maxLeasesPerAccount: number; maxLeasesPerKeeper?: number },
): Promise<AcquireOutcome[]> {
  const quota = options.maxLeasesPerAccount;
  const perKeeper = options.maxLeasesPerKeeper ?? 0;
  const rows = await sql<AcquireRow[]>`
    WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
    wanted AS MATERIALIZED (
      SELECT * FROM unnest(
        ${items.map((_, i) => i)}::int[],
        ${items.map((i) => i.accountId)}::text[],
        ${items.map((i) => i.sessionId)}::text[],
        ${items.map((i) => i.runId)}::uuid[],
        ${items.map((i) => i.ttlMs)}::bigint[],
        ${items.map((i) => i.holder)}::text[],
        ${items.map((i) => i.keeperId ?? null)}::uuid[]
      ) AS w(idx, account_id, session_id, run_id, ttl_ms, holder, keeper_id)
    ),
    -- The rows of this batch that exist, locked at their latest version, in
    -- key order. A LATERAL probe per key keeps each lookup on the primary key.
    locked AS MATERIALIZED (
      SELECT w.idx, l.run_id, l.fencing_token, l.holder, l.ttl, l.acquired_at, l.expires_at,
             l.ended, l.keeper_id
      FROM (SELECT * FROM wanted ORDER BY account_id, session_id) w
      CROSS JOIN LATERAL (
        SELECT l.run_id, l.fencing_token, l.holder, l.ttl, l.acquired_at, l.expires_at, l.ended,
               l.keeper_id
        FROM leases l
        WHERE l.account_id = w.account_id AND l.session_id = w.session_id
        FOR UPDATE ${options.wait ? sql`` : sql`SKIP LOCKED`}
      ) l
    ),
    -- Keepers (K1, K2): keeper-acquire.ts.
    ${keeperAcquireCtes(
      sql,
      perKeeper,
      items.some((i) => i.keeperId !== undefined),
    )},
    state AS MATERIALIZED (
      SELECT w.*, k.idx IS NOT NULL AS locked,
             coalesce(k.expires_at > c.observed_at
                      -- Keepers: and its keeper valid (K1).
                      AND ${keeperValid(sql, "k", sql`c.observed_at`)}, false) AS own_valid,
             -- Keepers: why a grant on a keeper is not tried; the rows
             -- before it in this batch on the same keeper count as grants.
             ${keeperRefusal(
               sql,
               sql`w.keeper_id`,
               sql`w.account_id`,
               "k",
               sql`(count(*) OVER (PARTITION BY w.keeper_id ORDER BY w.idx) - 1)`,
               perKeeper,
             )} AS keeper_refusal,
             CASE WHEN coalesce(k.run_id <> w.run_id, true) THEN ${earlierGrantEnd(
               sql,
               sql`w.account_id`,
               sql`w.session_id`,
               sql`w.run_id`,
             )} END AS reused_cause,
             -- Present in the snapshot but not locked: another transaction
             -- holds it. A scalar subquery, never hashed (see earlierGrantEnd).
             k.idx IS NULL AND coalesce((
               SELECT true FROM leases p
               WHERE p.account_id = w.account_id AND p.session_id = w.session_id
               LIMIT 1
             ), false) AS busy
      FROM wanted w CROSS JOIN lease_clock c LEFT JOIN locked k ON k.idx = w.idx
    ),
    account_held AS MATERIALIZED (
      SELECT a.account_id, (
        SELECT count(*)::int FROM (
          SELECT 1 FROM leases l, lease_clock c
          WHERE l.account_id = a.account_id AND l.ended IS NULL
            AND l.expires_at > c.observed_at
            -- Keepers: a lease of a keeper that is over is not held (K1).
            AND ${keeperValid(sql, "l", sql`c.observed_at`)}
          LIMIT ${quota + 1}
        ) counted
      ) AS held
      FROM (SELECT DISTINCT account_id FROM state WHERE ${quota} > 0 AND NOT busy) a
    ),
    -- A row that would add a lease (its key holds no valid one) counts the
    -- rows before it in this batch that would too, so a batch does not
    -- overshoot the quota by itself.
    tried AS MATERIALIZED (
      SELECT s.*,
        CASE
          WHEN s.busy THEN 'busy'
          WHEN s.reused_cause IS NOT NULL THEN 'ended'
          -- Keepers: the keeper asked for refuses the grant.
          WHEN s.keeper_refusal IS NOT NULL THEN s.keeper_refusal
          WHEN ${quota} > 0
            AND ah.held - s.own_valid::int + CASE WHEN s.own_valid THEN 0 ELSE s.new_before END
                >= ${quota}
            THEN 'quota'
          ELSE 'try'
        END AS decision
      FROM (
        SELECT s.*, count(*) FILTER (
          WHERE NOT s.own_valid AND NOT s.busy AND s.reused_cause IS NULL
            AND s.keeper_refusal IS NULL
        ) OVER (
          PARTITION BY s.account_id ORDER BY s.idx
          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
        ) AS new_before
        FROM state s
      ) s
      LEFT JOIN account_held ah ON ah.account_id = s.account_id
    ),
    granted AS (
      INSERT INTO leases AS held
        (account_id, session_id, run_id, fencing_token, holder, ttl, acquired_at, expires_at,
         keeper_id)
      SELECT t.account_id, t.session_id, t.run_id, nextval('lease_fencing_token'), t.holder,
             ${keeperTtl(sql, sql`t.keeper_id`, sql`t.ttl_ms * interval '1 millisecond'`)},
             c.observed_at,
             ${keeperExpiresAt(
               sql,
               sql`t.keeper_id`,
               sql`c.observed_at + t.ttl_ms * interval '1 millisecond'`,
             )},
             t.keeper_id
      FROM tried t CROSS JOIN lease_clock c
      WHERE t.decision = 'try'
      ORDER BY t.account_id, t.session_id
      ${upsertOnConflict(sql)}
      RETURNING held.*
    ),
    audit AS (${grantAudit(sql)})
    SELECT t.idx, t.decision, t.reused_cause, g.account_id IS NOT NULL AS granted,
           ${leaseColumns(sql, "g")},
           g.acquired_at < lease_clock.observed_at AS retried,
           ev.acquired_id AS event_id,
           ev.expired_id AS expired_event_id,
           g.previous_run_id AS expired_run_id,
           g.previous_fencing_token AS expired_fencing_token,
           g.previous_holder AS expired_holder,
           (extract(epoch FROM g.previous_expires_at) * 1000000)::bigint AS expired_expires_at_us,
           -- Not granted: the lease in the way, as this statement locked it
           -- (an ended row is in nobody's way: it was ended after this
           -- statement's clock reading, and the key is decided again).
           k.idx IS NOT NULL AND k.ended IS NULL AS held_by_lock,
           -- Keepers (K2): the lease in the way is over, its key lock-delayed.
           ${keeperDelayedUntil(sql, "k")} AS delayed_until_us,
           ${ownEnded(sql, "k", sql`t.run_id`)} AS own_ended,
           k.ended AS locked_ended,
           ${leaseColumns(sql, "cur", "cur")}
    FROM tried t
    CROSS JOIN lease_clock
    LEFT JOIN granted g ON g.account_id = t.account_id AND g.session_id = t.session_id
    LEFT JOIN LATERAL (
      SELECT max(a.id) FILTER (WHERE a.type = 'acquired') AS acquired_id,
             max(a.id) FILTER (WHERE a.type = 'expired') AS expired_id
      FROM audit a WHERE a.account_id = g.account_id AND a.session_id = g.session_id
    ) ev ON true
    LEFT JOIN locked k ON k.idx = t.idx AND g.account_id IS NULL
    LEFT JOIN LATERAL (
      SELECT t.account_id, t.session_id, k.run_id, k.fencing_token, k.holder, k.ttl,
             k.acquired_at, k.expires_at, k.keeper_id
    ) cur ON k.idx IS NOT NULL
    ORDER BY t.idx`;
  return rows.map((row): AcquireOutcome => {
    if (row.decision === "busy") return { outcome: "busy" };
    if (row.ownEnded) return { outcome: "ended", cause: row.lockedEnded ?? "expired" };
    if (row.decision === "ended") return { outcome: "ended", cause: row.reusedCause ?? "expired" };
    if (row.decision === "quota") return { outcome: "quota" };
    if (row.decision === "keeper") return { outcome: "keeper" };
    if (row.decision === "keeper_full") return { outcome: "keeper_full" };
    if (row.granted) return grantOf(row);
    if (row.heldByLock && row.delayedUntilUs !== null) {
      return { outcome: "delayed", untilUs: row.delayedUntilUs };
    }
    if (row.heldByLock) return { outcome: "held", current: leaseOf(row, "cur") };
    return { outcome: "unknown" };
  });
}

interface OneRow extends Record<string, unknown> {
  overQuota: boolean;
  keeperRefusal: "keeper" | "keeper_full" | null;
  delayedUntilUs: bigint | null;
  reusedCause: EndCause | "expired" | null;
  ownEnded: boolean;
  lockedEnded: EndCause | null;
  granted: boolean;
  retried: boolean | null;
  eventId: bigint | null;
  expiredEventId: bigint | null;
  expiredRunId: string | null;
  expiredFencingToken: bigint | null;
  expiredHolder: string | null;
  expiredExpiresAtUs: bigint | null;
}

/**
 * Decides one acquire in a statement lighter than a batch of one (what a
 * call gets when no other acquire is waiting). The key's row is locked
 * first: with `wait` false, NOWAIT answers `busy` at once when another
 * transaction holds it, so the caller decides the key alone, waiting,
 * without holding up the calls queued behind this statement (S8). A refusal
 * answers `held` without the lease in the way (`current` is read by the
 * caller with getOne), since RETURNING sees only rows it changed.
 */
export async function acquireOne(
  sql: Sql,
  item: AcquireItem,
  options: { wait: boolean; maxLeasesPerAccount: number; maxLeasesPerKeeper?: number },
): Promise<AcquireOutcome | { outcome: "refused" }> {
  const quota = options.maxLeasesPerAccount;
  const perKeeper = options.maxLeasesPerKeeper ?? 0;
  const keeperId = item.keeperId ?? null;
  let rows: OneRow[];
  try {
    rows = await sql<OneRow[]>`
      WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
      -- The version locked is the latest, maybe committed after this
      -- statement's snapshot: what the upsert below decides on.
      locked AS MATERIALIZED (
        SELECT run_id, ended, expires_at, keeper_id FROM leases
        WHERE account_id = ${item.accountId} AND session_id = ${item.sessionId}
        FOR UPDATE ${options.wait ? sql`` : sql`NOWAIT`}
      ),
      -- Keepers (K1, K2): keeper-acquire.ts.
      wanted AS (SELECT ${item.accountId}::text AS account_id, ${keeperId}::uuid AS keeper_id),
      ${keeperAcquireCtes(sql, perKeeper, keeperId !== null)},
      keeper_refused AS MATERIALIZED (${
        keeperId === null
          ? sql`SELECT NULL::text AS refusal`
          : sql`SELECT ${keeperRefusal(
              sql,
              sql`${keeperId}::uuid`,
              sql`${item.accountId}::text`,
              "k",
              sql`0`,
              perKeeper,
            )} AS refusal
            FROM (SELECT 1) one LEFT JOIN locked k ON true`
      }),
      -- Valid leases of the account on other sessions (the quota); reading
      -- \`locked\` here takes the row lock before the upsert below runs.
      others AS MATERIALIZED (
        SELECT CASE WHEN ${quota} > 0 THEN (
          SELECT count(*)::int FROM (
            SELECT 1 FROM leases l, lease_clock c
            WHERE l.account_id = ${item.accountId} AND l.session_id <> ${item.sessionId}
              AND l.ended IS NULL AND l.expires_at > c.observed_at
              -- Keepers: a lease of a keeper that is over is not held (K1).
              AND ${keeperValid(sql, "l", sql`c.observed_at`)}
            LIMIT ${quota}
          ) counted
        ) ELSE 0 END AS held
        FROM (SELECT count(*) FROM locked) lock_taken
      ),
      -- After the lock (it reads \`locked\`): the requesting run's earlier
      -- lease on this key, when the row now names another run or none.
      reused AS MATERIALIZED (
        SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM locked k WHERE k.run_id = ${item.runId}::uuid)
          THEN ${earlierGrantEnd(
            sql,
            sql`${item.accountId}::text`,
            sql`${item.sessionId}::text`,
            sql`${item.runId}::uuid`,
          )} END AS cause
      ),
      granted AS (
        INSERT INTO leases AS held
          (account_id, session_id, run_id, fencing_token, holder, ttl, acquired_at, expires_at,
           keeper_id)
        SELECT ${item.accountId}, ${item.sessionId}, ${item.runId}::uuid,
               nextval('lease_fencing_token'), ${item.holder},
               ${keeperTtl(sql, sql`${keeperId}::uuid`, sql`${item.ttlMs}::bigint * interval '1 millisecond'`)},
               c.observed_at,
               ${keeperExpiresAt(
                 sql,
                 sql`${keeperId}::uuid`,
                 sql`c.observed_at + ${item.ttlMs}::bigint * interval '1 millisecond'`,
               )},
               ${keeperId}::uuid
        FROM lease_clock c CROSS JOIN others o CROSS JOIN reused r CROSS JOIN keeper_refused kr
        WHERE (${quota} = 0 OR o.held < ${quota}) AND r.cause IS NULL
          -- Keepers: the keeper asked for takes the grant.
          AND kr.refusal IS NULL
        ${upsertOnConflict(sql)}
        RETURNING held.*
      ),
      audit AS (${grantAudit(sql)})
      SELECT ${quota} > 0 AND o.held >= ${quota} AS over_quota,
             (SELECT refusal FROM keeper_refused) AS keeper_refusal,
             (SELECT ${keeperDelayedUntil(sql, "k")} FROM locked k) AS delayed_until_us,
             (SELECT cause FROM reused) AS reused_cause,
             g.account_id IS NOT NULL AS granted,
             coalesce((SELECT ${ownEnded(sql, "k", sql`${item.runId}::uuid`)} FROM locked k), false)
               AS own_ended,
             (SELECT ended FROM locked) AS locked_ended,
             ${leaseColumns(sql, "g")},
             g.acquired_at < lease_clock.observed_at AS retried,
             (SELECT max(id) FROM audit WHERE type = 'acquired') AS event_id,
             (SELECT max(id) FROM audit WHERE type = 'expired') AS expired_event_id,
             g.previous_run_id AS expired_run_id,
             g.previous_fencing_token AS expired_fencing_token,
             g.previous_holder AS expired_holder,
             (extract(epoch FROM g.previous_expires_at) * 1000000)::bigint AS expired_expires_at_us
      FROM lease_clock CROSS JOIN others o LEFT JOIN granted g ON true`;
  } catch (error) {
    // NOWAIT: another transaction holds the row.
    if (!options.wait && (error as { code?: unknown }).code === "55P03") return { outcome: "busy" };
    throw error;
  }
  const row = rows[0];
  if (!row) throw new Error("the acquire statement returned no row");
  if (row.granted) return grantOf(row);
  if (row.ownEnded) return { outcome: "ended", cause: row.lockedEnded ?? "expired" };
  if (row.reusedCause) return { outcome: "ended", cause: row.reusedCause };
  if (row.keeperRefusal) return { outcome: row.keeperRefusal };
  if (row.overQuota) return { outcome: "quota" };
  if (row.delayedUntilUs !== null) return { outcome: "delayed", untilUs: row.delayedUntilUs };
  return { outcome: "refused" };
}

type GrantRow = Pick<
  OneRow,
  | "retried"
  | "eventId"
  | "expiredEventId"
  | "expiredRunId"
  | "expiredFencingToken"
  | "expiredHolder"
  | "expiredExpiresAtUs"
>;

function grantOf(row: GrantRow): AcquireOutcome {
  const expired =
    row.expiredEventId !== null &&
    row.expiredRunId !== null &&
    row.expiredFencingToken !== null &&
    row.expiredExpiresAtUs !== null
      ? {
          runId: row.expiredRunId,
          fencingToken: row.expiredFencingToken,
          holder: row.expiredHolder ?? "",
          expiresAtUs: row.expiredExpiresAtUs,
          eventId: row.expiredEventId,
        }
      : undefined;
  return {
    outcome: "granted",
    lease: leaseOf(row),
    retried: row.retried === true,
    eventId: row.eventId ?? 0n,
    expired,
  };
}

/**
 * The conflict rule of the acquire UPSERT (S3, S4, S6): another run's expired
 * or ended row, or the same run re-acquiring its valid lease, is updated; a
 * valid lease of another run is left as it is, and so is the same run's
 * ended lease (released, revoked or expired): a run whose lease ended never
 * holds the session again. The token of a takeover is drawn here, under the
 * row lock.
 */
function upsertOnConflict(sql: Sql) {
  return sql`
    ON CONFLICT (account_id, session_id) DO UPDATE SET
      run_id = EXCLUDED.run_id,
      fencing_token = CASE
        WHEN held.run_id = EXCLUDED.run_id THEN held.fencing_token
        ELSE nextval('lease_fencing_token') END,
      acquired_at = CASE
        WHEN held.run_id = EXCLUDED.run_id THEN held.acquired_at
        ELSE EXCLUDED.acquired_at END,
      holder = EXCLUDED.holder,
      ttl = EXCLUDED.ttl,
      expires_at = EXCLUDED.expires_at,
      ended = NULL,
      keeper_id = EXCLUDED.keeper_id,
      -- Read by this statement's audit insert below: RETURNING sees only
      -- the new row.
      previous_run_id = held.run_id,
      previous_fencing_token = held.fencing_token,
      previous_holder = held.holder,
      previous_ended = held.ended,
      -- Keepers: a lease on a keeper ended at its keeper's deadline.
      previous_expires_at = ${leaseDeadline(sql, "held")}
    WHERE (held.run_id <> EXCLUDED.run_id AND held.expires_at <= EXCLUDED.acquired_at)
       -- S4: the same run only while its lease is valid and not ended. The
       -- row is the version locked, maybe ended after this statement read
       -- its clock: \`ended\` says so where the older clock reading cannot.
       OR (held.run_id = EXCLUDED.run_id AND held.ended IS NULL
           AND held.expires_at > EXCLUDED.acquired_at
           -- Keepers: and while its keeper is valid (K1, S4); a retry names
           -- the same keeper, or none for a lease of its own.
           AND held.keeper_id IS NOT DISTINCT FROM EXCLUDED.keeper_id
           AND ${keeperValid(sql, "held", sql`EXCLUDED.acquired_at`)})
       -- Keepers: a lease whose keeper is gone, once its lock-delay passed (K1, K2).
       OR ${keeperTakeover(sql)}`;
}

/**
 * S4 across holders: when the requesting run was granted this key before
 * (the audit trail keeps its grant), how its lease there ended — its latest
 * 'released', 'revoked' or 'expired' event, else 'expired' (a lease that ran
 * out with no takeover recorded, its tombstone since collected); NULL for a
 * run new to the key. Used only when the key's row is not the run's own, so
 * that another run's grant in between does not make an ended run new again.
 * Reads the statement's snapshot: a run's grant is committed long before.
 *
 * The grant lookup is a scalar subquery with LIMIT 1, not EXISTS: PostgreSQL
 * may plan a correlated EXISTS as a hashed subplan that reads every grant
 * of the table once per statement (it did for the batched form on a table
 * without statistics: a quarter of the cycle rate at 32 callers, worse as
 * the history grew); a scalar subquery is always one index probe per row
 * (test/acquire-probe.test.ts).
 */
function earlierGrantEnd(
  sql: Sql,
  accountId: postgres.PendingQuery<postgres.Row[]>,
  sessionId: postgres.PendingQuery<postgres.Row[]>,
  runId: postgres.PendingQuery<postgres.Row[]>,
) {
  return sql`CASE WHEN (
      SELECT true FROM lease_events e
      WHERE e.account_id = ${accountId} AND e.session_id = ${sessionId}
        AND e.type = 'acquired' AND e.run_id = ${runId}
      LIMIT 1
    ) THEN coalesce((
      SELECT e.type FROM lease_events e
      WHERE e.account_id = ${accountId} AND e.session_id = ${sessionId}
        AND e.run_id = ${runId} AND e.type IN ('released', 'revoked', 'expired')
      ORDER BY e.id DESC LIMIT 1
    ), 'expired') END`;
}

/**
 * Whether the locked row `k` (run_id, ended, expires_at) is the requesting
 * run's own lease that ended: what the conflict rule below refuses to renew.
 * Needs `lease_clock` in scope.
 */
function ownEnded(sql: Sql, k: string, runId: postgres.PendingQuery<postgres.Row[]>) {
  return sql`coalesce(${sql(k)}.run_id = ${runId} AND (${sql(k)}.ended IS NOT NULL
    OR ${sql(k)}.expires_at <= lease_clock.observed_at
    -- Keepers: or its keeper is over (K1).
    OR NOT ${keeperValid(sql, k, sql`lease_clock.observed_at`)}), false)`;
}

/**
 * The audit rows of the grants in CTE `granted`: 'expired' for an unreleased
 * lease past its deadline that a grant replaced, 'acquired' for every grant
 * (not for an idempotent retry, which keeps its token).
 */
function grantAudit(sql: Sql) {
  return sql`
    INSERT INTO lease_events (account_id, session_id, type, run_id, fencing_token, holder, at)
    SELECT g.account_id, g.session_id, 'expired', g.previous_run_id,
           g.previous_fencing_token, g.previous_holder, g.previous_expires_at
    FROM granted g
    WHERE g.previous_fencing_token IS DISTINCT FROM g.fencing_token
      AND g.previous_run_id IS NOT NULL AND g.previous_ended IS NULL
    UNION ALL
    SELECT g.account_id, g.session_id, 'acquired', g.run_id, g.fencing_token, g.holder,
           g.acquired_at
    FROM granted g
    WHERE g.previous_fencing_token IS DISTINCT FROM g.fencing_token
    RETURNING id, type, account_id, session_id`;
}
