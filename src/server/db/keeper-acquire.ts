// The keeper part of the acquire statement (K1, K2; docs/keepers.md), kept
// apart from acquire-statement.ts, which uses these fragments in clearly
// marked places. A lease on a keeper is stored with expires_at 'infinity'
// while open, so the statement's own deadline tests keep holding for it; what
// is added here decides on the keeper, and costs a request without a keeper
// and a key whose lease has none nothing but a NULL test.
//
// Takeover. An open lease on a keeper is taken over once its keeper is gone
// and, after an expiry, its lock-delay has passed: the SQL function
// leasehold_keeper_free_at (migrations/lease/0007_keeper_row_locks.sql), called under
// the lease row's lock, marks a keeper past its deadline `expired` under the
// keeper's row lock first. The write is what makes it safe against a
// heartbeat in flight that read its clock before the deadline: either the
// heartbeat committed first (the marking re-checks the new deadline and does
// not mark: no takeover), or it waits behind the marking and re-checks
// `ended IS NULL` on the marked version (it fails: the keeper is lost). A
// FOR SHARE lock would let that heartbeat go on without a re-check, and
// extend a keeper one of whose leases was just taken over. The marking
// locks the row FOR UPDATE before it writes (migrations/lease/0007): its
// UPDATE alone would lock FOR NO KEY UPDATE, which a grant's FOR KEY SHARE
// does not conflict with, and a grant could then commit on a keeper whose
// expiry was recorded before it.
//
// Grant on a keeper. The keeper must be valid, of the account, and below the
// leases-per-keeper limit, read under FOR KEY SHARE (`keeper_granting`). A
// heartbeat locks the row FOR NO KEY UPDATE (it changes no key column), which
// does not conflict: a heartbeat never waits for a grant, however many grant
// statements hold the row. What must not race a grant locks the row FOR
// UPDATE first, which does conflict: a close or revoke (keeper-store.ts) and
// the expiry marking above wait for a grant in flight to commit, and a grant
// that comes after them waits, then re-checks `ended IS NULL` on the version
// they wrote, and is refused. So a close sees every grant that committed
// before it, and none commits after it. Its leases take its TTL.

import type postgres from "postgres";
import type { Sql } from "../../postgres/pool.js";

type Fragment = postgres.PendingQuery<postgres.Row[]>;

/**
 * The CTE `keeper_granting`, to follow `lease_clock` and `wanted` (requests
 * with keeper_id) in a WITH list: the keepers asked for that are valid, with
 * their account, TTL and open leases. Without a request on a keeper
 * (`granting` false) it is empty, and nothing is read.
 * `maxLeasesPerKeeper` 0: no limit.
 */
export function keeperAcquireCtes(
  sql: Sql,
  maxLeasesPerKeeper: number,
  granting: boolean,
): Fragment {
  if (!granting) {
    return sql`
    keeper_granting AS (
      SELECT NULL::uuid AS id, NULL::text AS account_id, NULL::interval AS ttl, 0 AS open_leases
      WHERE false
    )`;
  }
  return sql`
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
      FOR KEY SHARE OF kp
    )`;
}

/**
 * The added disjunct of the UPSERT's takeover condition: another run takes
 * over an open lease whose keeper is gone and whose lock-delay has passed.
 */
export function keeperTakeover(sql: Sql): Fragment {
  return sql`(held.run_id <> EXCLUDED.run_id AND held.ended IS NULL AND held.keeper_id IS NOT NULL
      AND leasehold_keeper_free_at(held.keeper_id, EXCLUDED.acquired_at) <= EXCLUDED.acquired_at)`;
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
  return sql`CASE WHEN ${keeperId} IS NULL THEN ${ttl}
    ELSE (SELECT g.ttl FROM keeper_granting g WHERE g.id = ${keeperId}) END`;
}

/** The deadline a grant stores: 'infinity' on a keeper (its keeper's decides), else its own. */
export function keeperExpiresAt(sql: Sql, keeperId: Fragment, expiresAt: Fragment): Fragment {
  return sql`CASE WHEN ${keeperId} IS NULL THEN ${expiresAt} ELSE 'infinity'::timestamptz END`;
}

/**
 * K2: when the locked lease row `k` that was not taken over is an open lease
 * of a keeper that is gone but whose lock-delay has not passed, the instant
 * the key is free, in µs since the epoch; else NULL. Needs `lease_clock`.
 */
export function keeperDelayedUntil(sql: Sql, k: string): Fragment {
  return sql`(SELECT (extract(epoch FROM f.free_at) * 1000000)::bigint
    FROM (SELECT leasehold_keeper_free_at(${sql(k)}.keeper_id, lease_clock.observed_at) AS free_at
          WHERE ${sql(k)}.keeper_id IS NOT NULL AND ${sql(k)}.ended IS NULL) f
    WHERE f.free_at > lease_clock.observed_at)`;
}
