// Retention (DESIGN §2): trims lease_events by age and deletes old
// tombstones. Every instance runs it on a timer; a transaction-scoped
// advisory lock lets one instance work at a time, and each statement deletes
// a bounded batch, so no statement holds locks for long.
//
// Why deleting a tombstone keeps S6 (docs/operations.md has the long form):
// the fencing token of a grant that inserts a fresh row is drawn before the
// statement learns whether the row exists. Such a token could only be
// smaller than one granted on the old row if the statement drew it before
// that grant, and it can only insert if the old row was gone by then. The
// old row is deleted only once its expiry, which is never before its last
// grant, lies `tombstoneHorizonMs` in the past, so that statement would have
// run for longer than the horizon; statement_timeout, at most a tenth of the
// horizon (src/config/ops-config.ts), cancels it long before.

import type { Logger } from "../../log/logger.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";
import type { Sql } from "../../postgres/pool.js";

// Shared by every Leasehold process; distinct from the migration lock.
const retentionLockKey = 7_140_241_817_205_312n;
const batchSize = 5_000;

export interface RetentionOptions {
  eventRetentionMs: number;
  tombstoneHorizonMs: number;
}

export interface Retention {
  /** Deletes lease_events older than the retention; returns how many. */
  trimEvents(): Promise<number>;
  /**
   * Deletes tombstones whose expiry is older than the horizon; returns how
   * many. Keepers over for longer than the horizon are settled first: their
   * leases become such tombstones, and the keepers are deleted.
   */
  collectTombstones(): Promise<number>;
}

export function createRetention(sql: Sql, options: RetentionOptions): Retention {
  // Runs `statement` in batches while this instance holds the lock and a
  // batch comes back full; 0 when another instance holds the lock.
  const batches = async (statement: (tx: Sql) => Promise<number>): Promise<number> => {
    let total = 0;
    try {
      for (;;) {
        const n = await sql.begin(async (tx) => {
          const [lock] = await tx<{ locked: boolean }[]>`
            SELECT pg_try_advisory_xact_lock(${retentionLockKey}) AS locked`;
          if (!lock?.locked) return -1;
          return statement(tx as unknown as Sql);
        });
        if (n < 0) return total;
        total += n;
        if (n < batchSize) return total;
      }
    } catch (error) {
      throw classifyDatabaseError(error);
    }
  };

  return {
    trimEvents: () =>
      batches(async (tx) => {
        // Audit rows are append-only: nothing else writes an old row, so
        // a plain bounded delete in id order (the BRIN index on `at` finds
        // the old range) cannot race a writer.
        const rows = await tx`
          DELETE FROM lease_events
          WHERE id IN (
            SELECT id FROM lease_events
            WHERE at < clock_timestamp() - ${options.eventRetentionMs}::bigint * interval '1 millisecond'
            ORDER BY id
            LIMIT ${batchSize}
          )`;
        return rows.count;
      }),

    collectTombstones: async () => {
      await batches(settleKeepers);
      return batches(async (tx) => {
        // S6: only rows whose expiry lies a whole horizon in the past. The
        // outer condition is checked again on the row's newest version
        // after the row lock, so a row re-granted meanwhile is kept; SKIP
        // LOCKED leaves rows that an acquire is working on.
        const rows = await tx`
          DELETE FROM leases AS l
          USING (
            SELECT account_id, session_id FROM leases
            WHERE expires_at < clock_timestamp() - ${options.tombstoneHorizonMs}::bigint * interval '1 millisecond'
            LIMIT ${batchSize}
            FOR UPDATE SKIP LOCKED
          ) AS old
          WHERE l.account_id = old.account_id AND l.session_id = old.session_id
            AND l.expires_at < clock_timestamp() - ${options.tombstoneHorizonMs}::bigint * interval '1 millisecond'`;
        return rows.count;
      });
    },
  };

  /**
   * Keepers (K1, K2; docs/keepers.md). A lease on a keeper stays open
   * (expires_at 'infinity') after its keeper ended, over by the keeper's
   * deadline alone, so the tombstone rule never sees it. A keeper whose end,
   * lock-delay included, lies a whole horizon in the past is settled: its
   * open leases take its end as their expires_at (released or revoked with
   * an audit row when the keeper was closed or revoked and its close missed
   * them; left expired otherwise, as a plain lease that ran out), which makes
   * them tombstones of that age (S6 as above); then the keeper, with no open
   * lease left, is deleted. SKIP LOCKED leaves rows an acquire is working on;
   * their keeper is settled in a later round.
   */
  async function settleKeepers(tx: Sql): Promise<number> {
    const horizon = tx`clock_timestamp() - ${options.tombstoneHorizonMs}::bigint * interval '1 millisecond'`;
    const settled = await tx`
      WITH old AS MATERIALIZED (
        SELECT k.id, k.expires_at, k.end_reason,
               CASE k.ended WHEN 'closed' THEN 'released' WHEN 'revoked' THEN 'revoked' END AS lease_end
        FROM keepers k
        WHERE k.expires_at + k.lock_delay < ${horizon}
        LIMIT ${batchSize}
      ),
      open AS MATERIALIZED (
        SELECT l.account_id, l.session_id FROM leases l
        WHERE l.keeper_id IN (SELECT id FROM old) AND l.ended IS NULL AND l.expires_at = 'infinity'
        LIMIT ${batchSize}
        FOR UPDATE SKIP LOCKED
      ),
      ended AS (
        UPDATE leases AS l
        SET expires_at = greatest(l.acquired_at, old.expires_at), ended = old.lease_end
        FROM open, old
        WHERE l.account_id = open.account_id AND l.session_id = open.session_id
          AND l.keeper_id = old.id AND l.ended IS NULL AND l.expires_at = 'infinity'
        RETURNING l.*, old.end_reason
      ),
      audit AS (
        INSERT INTO lease_events
          (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
        SELECT account_id, session_id, ended, run_id, fencing_token, holder, end_reason, expires_at
        FROM ended WHERE ended IS NOT NULL
      )
      SELECT count(*)::int AS n FROM ended`;
    // A keeper with an open lease left (locked above, or granted on it
    // long ago and still open) is kept for a later round.
    const deleted = await tx`
      DELETE FROM keepers AS k
      WHERE k.id IN (
        SELECT id FROM keepers
        WHERE expires_at + lock_delay < ${horizon}
        LIMIT ${batchSize}
      )
        AND NOT EXISTS (SELECT 1 FROM leases l
                        WHERE l.keeper_id = k.id AND l.ended IS NULL AND l.expires_at = 'infinity')`;
    return Math.max((settled[0]?.n as number | undefined) ?? 0, deleted.count);
  }
}

export interface Maintenance {
  /** Runs one round now (tests, and the first round at start). */
  runOnce(): Promise<{ events: number; tombstones: number }>;
  stop(): Promise<void>;
}

/** Runs retention every `intervalMs`, with jitter so instances spread out. */
export function startMaintenance(
  retention: Retention,
  intervalMs: number,
  logger: Logger,
): Maintenance {
  let running: Promise<unknown> = Promise.resolve();
  const runOnce = async () => {
    const events = await retention.trimEvents();
    const tombstones = await retention.collectTombstones();
    if (events > 0 || tombstones > 0) {
      logger.info({ events, tombstones }, "retention deleted old events and tombstones");
    }
    return { events, tombstones };
  };
  let timer: NodeJS.Timeout | undefined;
  let stopped = false;
  const schedule = () => {
    if (stopped) return;
    timer = setTimeout(
      () => {
        running = runOnce()
          .catch((error: unknown) => logger.warn({ err: error }, "retention round failed"))
          .finally(schedule);
      },
      intervalMs * (0.75 + Math.random() * 0.5),
    );
    timer.unref();
  };
  schedule();
  return {
    runOnce,
    stop: async () => {
      stopped = true;
      clearTimeout(timer);
      await running;
    },
  };
}
