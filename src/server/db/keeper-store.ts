// The keepers on PostgreSQL (K1, K2; docs/keepers.md): open or re-attach,
// heartbeat, close and revoke. Every statement reads the database clock once
// (S9), in a materialized `lease_clock` CTE, and runs in autocommit.
//
// K1: a heartbeat is one row written, whatever the number of leases on the
//     keeper: leases on a keeper keep expires_at 'infinity' and take the
//     keeper's deadline (lease-columns.ts, leaseDeadline and keeperValid).
// S4: the heartbeat's guard is `ended IS NULL AND expires_at > observed_at`:
//     a late heartbeat of an expired keeper fails, even when none of its
//     keys was taken over. A takeover of one of its keys marks the keeper
//     `expired` under its row lock first (keeper-acquire.ts), so a heartbeat
//     that read its clock before the deadline and waited behind that
//     marking re-checks `ended` and fails.
// Row locks on a keeper (docs/keepers.md): a grant reads the keeper row FOR
//     KEY SHARE; a heartbeat locks it FOR NO KEY UPDATE, which does not
//     conflict with that, so a heartbeat never waits for a grant; a close or
//     revoke locks it FOR UPDATE, which does: it waits for a grant in flight,
//     and a grant after it is refused.

import { ResourceExhaustedError } from "../../lease/errors.js";
import type {
  EndedLease,
  KeeperEnd,
  KeeperLease,
  KeeperRecord,
  KeeperResult,
  KeeperStore,
  OpenKeeperInput,
} from "../../lease/types.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";
import type { Sql } from "../../postgres/pool.js";
import { LimitName } from "../../protocol/errors.js";
import { createGroupCommit, type GroupCommitStats } from "./group-commit.js";
import { leaseColumns, leaseOf } from "./lease-columns.js";

export interface KeeperStoreOptions {
  /** Open keepers one account may hold at once; 0 (the default) means no limit. */
  maxKeepersPerAccount?: number;
  /** Heartbeats per group-committed statement. */
  maxBatch?: number;
  /** Heartbeat statements in flight at once. */
  maxInFlight?: number;
}

interface Beat {
  accountId: string;
  id: string;
  /** A new TTL for the keeper (it then keeps it); null keeps its TTL. */
  ttlMs: number | null;
}

/** The keeper columns of alias `k`, relative to `lease_clock.observed_at`. */
function keeperColumns(sql: Sql, k: string) {
  return sql`
    ${sql(k)}.id, ${sql(k)}.account_id, ${sql(k)}.holder,
    (extract(epoch FROM ${sql(k)}.ttl) * 1000)::bigint AS ttl_ms,
    (extract(epoch FROM ${sql(k)}.lock_delay) * 1000)::bigint AS lock_delay_ms,
    (extract(epoch FROM ${sql(k)}.created_at) * 1000000)::bigint AS created_at_us,
    (extract(epoch FROM ${sql(k)}.expires_at) * 1000000)::bigint AS expires_at_us,
    (extract(epoch FROM greatest(${sql(k)}.expires_at - lease_clock.observed_at, interval '0'))
      * 1000000)::bigint AS remaining_us`;
}

/**
 * Why keeper `id` of `accountId` does not keep leases now: how it ended, or
 * `expired` when it ran past its deadline unmarked; `not_found` when there is
 * no such keeper in the account. Read at the statement's snapshot; it
 * explains a refusal and decides nothing.
 */
export async function keeperEnd(sql: Sql, accountId: string, id: string): Promise<KeeperEnd> {
  const [row] = await sql<{ ended: KeeperEnd | null }[]>`
    SELECT ended FROM keepers WHERE id = ${id}::uuid AND account_id = ${accountId}`;
  if (!row) return "not_found";
  return row.ended ?? "expired";
}

export function createKeeperStore(
  sql: Sql,
  options: KeeperStoreOptions = {},
): KeeperStore & { readonly stats: { heartbeat: GroupCommitStats } } {
  const maxKeepers = options.maxKeepersPerAccount ?? 0;

  const run = async <T>(statement: () => Promise<T>): Promise<T> => {
    try {
      return await statement();
    } catch (error) {
      throw classifyDatabaseError(error);
    }
  };

  const notHeld = async (accountId: string, id: string): Promise<KeeperResult> => ({
    held: false,
    cause: await keeperEnd(sql, accountId, id),
  });

  /**
   * One keeper's heartbeat (K1: one row, whatever the number of leases;
   * S4: not once over), for one the batch did not renew: by key, it waits on
   * the row lock (up to lock_timeout), re-checks its guard on the version it
   * locked, and decides or names the cause.
   */
  const heartbeatOne = async ({ accountId, id, ttlMs }: Beat): Promise<KeeperResult> => {
    const rows = await sql<KeeperRecord[]>`
      WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
      new_ttl AS MATERIALIZED (SELECT ${ttlMs}::bigint * interval '1 millisecond' AS ttl)
      UPDATE keepers AS k SET ttl = coalesce(new_ttl.ttl, k.ttl),
        expires_at = lease_clock.observed_at + coalesce(new_ttl.ttl, k.ttl)
      FROM lease_clock, new_ttl
      WHERE k.id = ${id}::uuid AND k.account_id = ${accountId}
        AND k.ended IS NULL AND k.expires_at > lease_clock.observed_at
      RETURNING ${keeperColumns(sql, "k")}`;
    const keeper = rows[0];
    return keeper ? { held: true, keeper } : notHeld(accountId, id);
  };

  /**
   * Many keepers' heartbeats in one statement (every stream of an instance:
   * DESIGN §3's batching, as for KeepAlive renewals), also for a batch of
   * one: rows are locked in id order with SKIP LOCKED, so a keeper's row
   * another transaction holds never holds up the statement, nor the
   * heartbeats queued behind it (S8). FOR NO KEY UPDATE, the lock the
   * UPDATE takes anyway (it changes no key column): it does not conflict
   * with the FOR KEY SHARE of grants on the keeper, so a heartbeat is not
   * skipped for a grant in flight; a close or revoke (FOR UPDATE), an
   * expiry marking, another heartbeat or a stuck writer still skip it.
   * Undefined: not renewed here (locked, or not held), decided alone by
   * heartbeatOne outside the batch.
   */
  const heartbeatMany = async (beats: readonly Beat[]): Promise<(KeeperRecord | undefined)[]> => {
    const rows = await sql<(KeeperRecord & { idx: number; beaten: boolean })[]>`
      WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
      wanted AS MATERIALIZED (
        SELECT * FROM unnest(
          ${beats.map((_, i) => i)}::int[],
          ${beats.map((b) => b.id)}::uuid[],
          ${beats.map((b) => b.accountId)}::text[],
          ${beats.map((b) => b.ttlMs)}::bigint[]
        ) AS w(idx, id, account_id, ttl_ms)
      ),
      locked AS MATERIALIZED (
        SELECT w.idx, w.ttl_ms * interval '1 millisecond' AS new_ttl, held.ctid AS row_id
        FROM (SELECT * FROM wanted ORDER BY id) w
        CROSS JOIN LATERAL (
          SELECT k.ctid FROM keepers k
          WHERE k.id = w.id AND k.account_id = w.account_id AND k.ended IS NULL
            AND k.expires_at > (SELECT observed_at FROM lease_clock)
          FOR NO KEY UPDATE SKIP LOCKED
        ) held
      ),
      beaten AS (
        -- The locked row versions, by ctid: stable while the lock is held.
        -- A heartbeat's new TTL (ttl is in no index: still a HOT update).
        UPDATE keepers AS k SET ttl = coalesce(l.new_ttl, k.ttl),
          expires_at = lease_clock.observed_at + coalesce(l.new_ttl, k.ttl)
        FROM locked l, lease_clock
        WHERE k.ctid = ANY (ARRAY(SELECT row_id FROM locked))
          AND k.ctid = l.row_id AND k.ended IS NULL
          AND k.expires_at > lease_clock.observed_at
        RETURNING l.idx, k.*
      )
      SELECT w.idx, b.idx IS NOT NULL AS beaten, ${keeperColumns(sql, "b")}
      FROM wanted w CROSS JOIN lease_clock LEFT JOIN beaten b ON b.idx = w.idx
      ORDER BY w.idx`;
    return rows.map(({ idx: _, beaten, ...keeper }) => (beaten ? keeper : undefined));
  };

  const heartbeats = createGroupCommit<Beat, KeeperRecord | undefined>({
    run: (beats) => run(() => heartbeatMany(beats)),
    keyOf: (beat) => beat.id,
    maxBatch: options.maxBatch ?? 500,
    maxInFlight: options.maxInFlight ?? 1,
    operation: "heartbeat",
  });

  return {
    stats: { heartbeat: heartbeats.stats },

    open: (input: OpenKeeperInput) =>
      run(async () => {
        // A new id inserts; the id of a valid keeper of the same account
        // re-attaches, which renews it (a heartbeat) with the TTL it names. The open-keeper count
        // leaves out this id, so a re-attach at the limit succeeds.
        const rows = await sql<(KeeperRecord & { overLimit: boolean })[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          open_keepers AS MATERIALIZED (
            SELECT CASE WHEN ${maxKeepers} > 0 THEN (
              SELECT count(*)::int FROM (
                SELECT 1 FROM keepers k, lease_clock c
                WHERE k.account_id = ${input.accountId} AND k.ended IS NULL
                  AND k.expires_at > c.observed_at AND k.id <> ${input.id}::uuid
                LIMIT ${maxKeepers}
              ) counted
            ) ELSE 0 END AS n
          ),
          opened AS (
            INSERT INTO keepers AS k
              (id, account_id, holder, ttl, lock_delay, created_at, expires_at)
            SELECT ${input.id}::uuid, ${input.accountId}, ${input.holder},
                   ${input.ttlMs}::bigint * interval '1 millisecond',
                   ${input.lockDelayMs}::bigint * interval '1 millisecond',
                   c.observed_at, c.observed_at + ${input.ttlMs}::bigint * interval '1 millisecond'
            FROM lease_clock c, open_keepers o
            WHERE ${maxKeepers} = 0 OR o.n < ${maxKeepers}
            -- A re-attach takes the TTL it names (OpenKeeper.ttl), from now on.
            ON CONFLICT (id) DO UPDATE SET ttl = EXCLUDED.ttl,
              expires_at = EXCLUDED.created_at + EXCLUDED.ttl
            WHERE k.account_id = EXCLUDED.account_id AND k.ended IS NULL
              AND k.expires_at > EXCLUDED.created_at
            RETURNING k.*
          )
          SELECT ${keeperColumns(sql, "opened")},
                 ${maxKeepers} > 0 AND o.n >= ${maxKeepers} AS over_limit
          FROM lease_clock CROSS JOIN open_keepers o LEFT JOIN opened ON true`;
        const row = rows[0];
        if (row?.id != null) {
          const { overLimit: _, ...keeper } = row;
          return { held: true, keeper };
        }
        const cause = await keeperEnd(sql, input.accountId, input.id);
        if (cause === "not_found" && row?.overLimit) {
          throw new ResourceExhaustedError(
            `the account holds ${maxKeepers} open keepers, the most --max-keepers-per-account allows: close one first`,
            LimitName.keepersPerAccount,
            maxKeepers,
          );
        }
        return { held: false, cause };
      }),

    status: (accountId, id) =>
      run(async () => {
        const [row] = await sql<
          {
            valid: boolean;
            ended: KeeperEnd | null;
            endReason: string | null;
            expiresAtUs: bigint;
          }[]
        >`
          SELECT k.ended IS NULL AND k.expires_at > clock_timestamp() AS valid, k.ended,
                 k.end_reason, (extract(epoch FROM k.expires_at) * 1000000)::bigint AS expires_at_us
          FROM keepers k WHERE k.id = ${id}::uuid AND k.account_id = ${accountId}`;
        if (!row) return { valid: false, cause: "not_found", reason: "" };
        if (row.valid) return { valid: true, expiresAtUs: row.expiresAtUs };
        return { valid: false, cause: row.ended ?? "expired", reason: row.endReason ?? "" };
      }),

    leasesOf: (accountId, id) =>
      run(async () => {
        // Through leases_open_by_keeper; a valid keeper's open leases are its leases.
        const rows = await sql<KeeperLease[]>`
          SELECT l.account_id, l.session_id, l.run_id::text AS run_id, l.fencing_token
          FROM leases l
          WHERE l.keeper_id = ${id}::uuid AND l.ended IS NULL AND l.account_id = ${accountId}
          ORDER BY l.session_id`;
        return [...rows];
      }),

    // Group-committed: concurrent heartbeats share one statement.
    async heartbeat(accountId, id, ttlMs) {
      const beat = { accountId, id, ttlMs: ttlMs ?? null };
      const keeper = await heartbeats.submit(beat);
      return keeper ? { held: true, keeper } : run(() => heartbeatOne(beat));
    },

    end: (accountId, id, how) =>
      run(async () => {
        // The keeper first, alone: once it is ended, every lease on it is
        // over (keeperValid), whatever happens to the second statement. Its
        // end is never before its last heartbeat's clock reading.
        // K1, S5: the row is locked FOR UPDATE before it is written (the
        // UPDATE alone would take FOR NO KEY UPDATE, which a grant's FOR
        // KEY SHARE does not conflict with). So this waits for every grant
        // in flight on the keeper to commit, which the second statement
        // then sees and ends; a grant that comes later waits for this one
        // and re-checks `ended IS NULL` on the ended version: refused. The
        // scalar subquery takes the lock before the UPDATE reads the row.
        const reason = how.ended === "revoked" ? how.reason : null;
        const ended = await sql<{ id: string }[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          closing AS MATERIALIZED (
            SELECT k.id FROM keepers k, lease_clock
            WHERE k.id = ${id}::uuid AND k.account_id = ${accountId}
              AND k.ended IS NULL AND k.expires_at > lease_clock.observed_at
            FOR UPDATE OF k
          )
          UPDATE keepers AS k
          SET ended = ${how.ended}, end_reason = ${reason}::text,
              expires_at = greatest(lease_clock.observed_at, k.expires_at - k.ttl)
          FROM lease_clock
          WHERE k.id = (SELECT c.id FROM closing c)
            AND k.ended IS NULL AND k.expires_at > lease_clock.observed_at
          RETURNING k.id`;
        const cause = ended.length > 0 ? undefined : await keeperEnd(sql, accountId, id);
        if (cause === "expired" || cause === "not_found")
          return { ended: false, cause, leases: [] };
        // Then its open leases, released (closed) or revoked, at the
        // keeper's end, one audit row each. Also run when the keeper was
        // already closed or revoked: a close retried after this statement
        // failed finishes the leases.
        const rows = await sql<(EndedLease & Record<string, unknown>)[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          keeper AS MATERIALIZED (
            SELECT k.id, k.expires_at, k.end_reason,
                   CASE k.ended WHEN 'closed' THEN 'released' ELSE 'revoked' END AS lease_end
            FROM keepers k
            WHERE k.id = ${id}::uuid AND k.account_id = ${accountId}
              AND k.ended IN ('closed', 'revoked')
          ),
          ended AS (
            UPDATE leases AS held
            SET ended = keeper.lease_end, expires_at = greatest(held.acquired_at, keeper.expires_at)
            FROM keeper
            WHERE held.keeper_id = keeper.id AND held.ended IS NULL
              AND held.expires_at = 'infinity'
            RETURNING held.*, keeper.end_reason
          ),
          audit AS (
            INSERT INTO lease_events
              (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
            SELECT account_id, session_id, ended, run_id, fencing_token, holder, end_reason,
                   expires_at
            FROM ended
            RETURNING id, account_id, session_id
          )
          SELECT ${leaseColumns(sql, "ended")}, audit.id AS event_id
          FROM ended
          CROSS JOIN lease_clock
          JOIN audit ON audit.account_id = ended.account_id AND audit.session_id = ended.session_id
          ORDER BY ended.account_id, ended.session_id`;
        const leases = rows.map((row) => ({ ...leaseOf(row), eventId: row.eventId as bigint }));
        return cause === undefined ? { ended: true, leases } : { ended: false, cause, leases };
      }),
  };
}
