// The database connection pool. Every connection carries the timeouts of
// DESIGN §3 as startup parameters, so no statement, lock wait or forgotten
// transaction can hold a lease row (or a pool slot) for long.

import postgres from "postgres";
import { Counter } from "prom-client";
import type { Logger } from "../log/logger.js";

export type Sql = postgres.Sql<{ bigint: bigint }>;

export interface DatabaseOptions {
  url: string;
  /** Upper bound on open connections (the pool size). */
  maxConnections: number;
  statementTimeoutMs: number;
  /** S8: an acquire that meets a locked row fails fast instead of queueing. */
  lockTimeoutMs: number;
  idleInTransactionTimeoutMs: number;
  applicationName: string;
  /** Seconds before an idle connection is closed. */
  idleTimeoutSeconds?: number;
  connectTimeoutSeconds?: number;
  /** Where the server's notices go; without it they are dropped. */
  notices?: DatabaseNotices;
}

export interface DatabaseNotices {
  logger: Logger;
  /** Incremented per cancelled wait for a synchronous standby (see below). */
  syncReplicationCancelled: { inc(): void };
}

/**
 * Cancelled waits for the synchronous standby, counted by the pool's notice
 * handler (below). The pool opens before the server's registry exists,
 * so the counter starts in no registry and the lease server's metrics add it.
 */
export function createSyncReplicationCancelledCounter(): Counter {
  return new Counter({
    name: "leasehold_db_sync_replication_cancelled_total",
    help: "commits whose wait for the synchronous standby was cancelled (committed on the primary, maybe not on the standby)",
    registers: [],
  });
}

/**
 * PostgreSQL's warning, sent instead of an error, when a COMMIT waiting for
 * its synchronous standby is cancelled (pg_cancel_backend, or the server
 * ending the session): the commit stands on the primary and the statement
 * reports success, but the standby may not have it, so a failover right
 * then can lose a lease change the client was told about (docs/failover.md).
 * Matched on the English text (lc_messages C, as embedded PostgreSQL runs).
 */
export function isSyncReplicationCancelled(notice: { message?: string }): boolean {
  return /^canceling (the )?wait for synchronous replication/.test(notice.message ?? "");
}

function noticeHandler(
  notices: DatabaseNotices | undefined,
  applicationName: string,
): (notice: postgres.Notice) => void {
  return (notice) => {
    if (!notices || !isSyncReplicationCancelled(notice)) return;
    notices.syncReplicationCancelled.inc();
    notices.logger.warn(
      { applicationName, notice: notice.message, detail: notice.detail },
      "a commit's wait for the synchronous standby was cancelled: committed on the primary, maybe not on the standby",
    );
  };
}

/**
 * Seconds postgres.js waits before reopening a connection that failed, given
 * the count of failures in a row (shared by the whole pool, reset by the
 * next connection that opens). The driver's own curve, 0.03 s tripled per
 * failure, reaches its 20 s cap after seven failures, which a pool of ten
 * connections makes in a database outage of under two seconds. A query that
 * later lands on such a connection waits out its delay although the database
 * is back: after a restart and a failover, single calls took 6–10 s in the
 * fault suite, past a lease's deadline. The same curve capped at 0.5 s keeps
 * the first calls after an outage quick; a storm of reconnections is bounded
 * by the pool's size anyway, and clients back off themselves.
 */
export function reconnectDelaySeconds(failures: number): number {
  return (0.5 + Math.random() / 2) * Math.min(3 ** failures / 100, 0.5);
}

/** Opens a postgres.js pool that returns int8 as bigint (fencing tokens). */
export function openDatabase(options: DatabaseOptions): Sql {
  return postgres(options.url, {
    max: options.maxConnections,
    idle_timeout: options.idleTimeoutSeconds ?? 60,
    connect_timeout: options.connectTimeoutSeconds ?? 5,
    backoff: reconnectDelaySeconds,
    types: { bigint: postgres.BigInt },
    transform: postgres.camel,
    onnotice: noticeHandler(options.notices, options.applicationName),
    connection: {
      application_name: options.applicationName,
      statement_timeout: options.statementTimeoutMs,
      lock_timeout: options.lockTimeoutMs,
      idle_in_transaction_session_timeout: options.idleInTransactionTimeoutMs,
      // Statements are prepared once per connection; every lease statement
      // probes the primary key (or the open-leases index) per row, so the
      // generic plan is as good as a custom one and skips planning, which
      // for the multi-row statements costs more than running them.
      plan_cache_mode: "force_generic_plan",
    },
  }) as unknown as Sql;
}
