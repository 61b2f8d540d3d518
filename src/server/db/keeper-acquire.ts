// The keeper part of the acquire statement (K1, K2; docs/keepers.md), kept
// apart from acquire-statement.ts, which uses these fragments in clearly
// marked places. A lease on a keeper is stored with expires_at 'infinity'
// while open, so the statement's own deadline tests keep holding for it; what
// is added here decides on the keeper.
//
// Takeover. The lease rows the statement locked (CTE `locked`: keeper_id,
// ended) whose keeper is past its deadline are taken over only once that
// keeper is marked `expired`, under its row lock, in this statement
// (`keeper_marked`). The write is what makes it safe against a heartbeat in
// flight that read its clock before the deadline: either the heartbeat
// committed first (the marking re-checks the new deadline and does not mark:
// no takeover), or it waits behind the marking and re-checks `ended IS NULL`
// on the marked version (it fails: the keeper is lost). A FOR SHARE lock
// would let that heartbeat go on without a re-check, and extend a keeper one
// of whose leases was just taken over. K2: a keeper that expired frees its
// keys at expires_at + lock_delay; a closed or revoked one at its end.
//
// Grant on a keeper. The keeper must be valid, of the account, and below the
// leases-per-keeper limit, read under FOR SHARE (`keeper_granting`): a close
// or a heartbeat of it waits for the grant, and the grant sees a close that
// committed first. Its leases take its TTL.

import type postgres from "postgres";
import type { Sql } from "../../postgres/pool.js";

type Fragment = postgres.PendingQuery<postgres.Row[]>;

/**
 * The CTEs `keeper_marked`, `keeper_free` and `keeper_granting`, to follow
 * `lease_clock`, `locked` (lease rows with keeper_id and ended) and
 * `wanted` (requests with account_id and keeper_id) in a WITH list.
 * `maxLeasesPerKeeper` 0: no limit.
 */
export function keeperAcquireCtes(sql: Sql, maxLeasesPerKeeper: number): Fragment {
  return sql`
    keeper_marked AS MATERIALIZED (
      UPDATE keepers kp SET ended = 'expired'
      FROM lease_clock c
      WHERE kp.id IN (SELECT k.keeper_id FROM locked k WHERE k.ended IS NULL)
        AND kp.ended IS NULL AND kp.expires_at <= c.observed_at
      RETURNING kp.id, kp.expires_at + kp.lock_delay AS free_at
    ),
    keeper_free AS MATERIALIZED (
      SELECT id, free_at FROM keeper_marked
      UNION ALL
      -- Ended before this statement's snapshot: final, never running again.
      SELECT kp.id, kp.expires_at
               + CASE WHEN kp.ended = 'expired' THEN kp.lock_delay ELSE interval '0' END
      FROM keepers kp
      WHERE kp.id IN (SELECT k.keeper_id FROM locked k WHERE k.ended IS NULL)
        AND kp.ended IS NOT NULL
      UNION ALL
      -- Trimmed away: long over.
      SELECT DISTINCT k.keeper_id, '-infinity'::timestamptz FROM locked k
      WHERE k.keeper_id IS NOT NULL AND k.ended IS NULL
        AND NOT EXISTS (SELECT 1 FROM keepers kp WHERE kp.id = k.keeper_id)
    ),
    keeper_granting AS MATERIALIZED (
      SELECT kp.id, kp.account_id, kp.ttl,
             CASE WHEN ${maxLeasesPerKeeper} > 0 THEN (
               SELECT count(*)::int FROM (
                 SELECT 1 FROM leases l
                 WHERE l.keeper_id = kp.id AND l.ended IS NULL AND l.expires_at = 'infinity'
                 LIMIT ${maxLeasesPerKeeper + 1}
               ) counted
             ) ELSE 0 END AS open_leases
      FROM keepers kp, lease_clock c
      WHERE kp.id IN (SELECT w.keeper_id FROM wanted w)
        AND kp.ended IS NULL AND kp.expires_at > c.observed_at
      FOR SHARE OF kp
    )`;
}

/**
 * The added disjunct of the UPSERT's takeover condition: another run takes
 * over an open lease whose keeper is gone and whose lock-delay has passed.
 * Needs `keeper_free` in the statement.
 */
export function keeperTakeover(sql: Sql): Fragment {
  return sql`(held.run_id <> EXCLUDED.run_id AND held.ended IS NULL AND held.keeper_id IS NOT NULL
      AND EXISTS (SELECT 1 FROM keeper_free f
                  WHERE f.id = held.keeper_id AND f.free_at <= EXCLUDED.acquired_at))`;
}

/**
 * Why a request on a keeper (`keeperId`, `accountId`; the key's locked row
 * in alias `k`, maybe absent) is not tried, or NULL: `keeper` when the keeper
 * is not valid or not the account's, `keeper_full` at the leases-per-keeper
 * limit (the rows before it in this batch on the same keeper counted by
 * `before`; the key's own open lease on that keeper is not a new one).
 * Needs `keeper_granting`.
 */
export function keeperRefusal(
  sql: Sql,
  keeperId: Fragment,
  accountId: Fragment,
  k: string,
  before: Fragment,
  maxLeasesPerKeeper: number,
): Fragment {
  return sql`CASE WHEN ${keeperId} IS NULL THEN NULL
    WHEN NOT EXISTS (SELECT 1 FROM keeper_granting g
                     WHERE g.id = ${keeperId} AND g.account_id = ${accountId}) THEN 'keeper'
    WHEN ${maxLeasesPerKeeper} > 0 AND (SELECT g.open_leases FROM keeper_granting g WHERE g.id = ${keeperId})
         - coalesce((${sql(k)}.keeper_id = ${keeperId} AND ${sql(k)}.ended IS NULL
                     AND ${sql(k)}.expires_at = 'infinity')::int, 0)
         + ${before} >= ${maxLeasesPerKeeper} THEN 'keeper_full'
    END`;
}

/** The TTL a grant takes: its keeper's, else its own. Needs `keeper_granting`. */
export function keeperTtl(sql: Sql, keeperId: Fragment, ttl: Fragment): Fragment {
  return sql`coalesce((SELECT g.ttl FROM keeper_granting g WHERE g.id = ${keeperId}), ${ttl})`;
}

/** The deadline a grant stores: 'infinity' on a keeper (its keeper's decides), else its own. */
export function keeperExpiresAt(sql: Sql, keeperId: Fragment, expiresAt: Fragment): Fragment {
  return sql`CASE WHEN ${keeperId} IS NULL THEN ${expiresAt} ELSE 'infinity'::timestamptz END`;
}

/**
 * K2: when the locked lease row `k` is an open lease of a keeper that is
 * gone but whose lock-delay has not passed, the instant the key is free, in
 * µs since the epoch; else NULL. Needs `keeper_free` and `lease_clock`.
 */
export function keeperDelayedUntil(sql: Sql, k: string): Fragment {
  return sql`(SELECT (extract(epoch FROM f.free_at) * 1000000)::bigint FROM keeper_free f
    WHERE ${sql(k)}.ended IS NULL AND f.id = ${sql(k)}.keeper_id
      AND f.free_at > lease_clock.observed_at
    LIMIT 1)`;
}
