// The database connection pool. Every connection carries the timeouts of
// DESIGN §3 as startup parameters, so no statement, lock wait or forgotten
// transaction can hold a lease row (or a pool slot) for long.

import postgres from "postgres";

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
}

/** Opens a postgres.js pool that returns int8 as bigint (fencing tokens). */
export function openDatabase(options: DatabaseOptions): Sql {
  return postgres(options.url, {
    max: options.maxConnections,
    idle_timeout: options.idleTimeoutSeconds ?? 60,
    connect_timeout: options.connectTimeoutSeconds ?? 5,
    types: { bigint: postgres.BigInt },
    transform: postgres.camel,
    onnotice: () => {},
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
