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
  /** Deletes tombstones whose expiry is older than the horizon; returns how many. */
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

    collectTombstones: () =>
      batches(async (tx) => {
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
      }),
  };
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
