// The benchmark's PostgreSQL: embedded (the same package `npm start` and the
// tests use) in a temporary folder, one migrated database that the service,
// the raw-SQL limit and the store all share, and the counters that say how
// hard the database worked during a window.

import { readFile, rm } from "node:fs/promises";
import path from "node:path";
import postgres from "postgres";
import { defaultTimeouts } from "../src/config/host-config.js";
import { makeDataParent, startEmbeddedPostgres } from "../src/postgres/embedded-postgres.js";
import { allMigrationSets, migrate } from "../src/postgres/migrate.js";
import { openDatabase, type Sql } from "../src/postgres/pool.js";
import { processTree } from "./process-stats.js";

export interface BenchPostgres {
  /** URL of the benchmark database. */
  url: string;
  version: string;
  /** The settings that bound commit throughput, as SHOW prints them. */
  settings: Record<string, string>;
  /** The postmaster and its backends. */
  pids(): number[];
  counters(): Promise<DatabaseCounters>;
  /** S1 on the database's own record: grants of a key that began before the previous run ended. */
  overlappingGrants(accountId: string, sessionId: string): Promise<number>;
  stop(): Promise<void>;
}

export interface DatabaseCounters {
  at: number;
  /** Committed + rolled back transactions: every autocommit statement is one. */
  transactions: number;
  walSyncs: number;
  walBytes: number;
}

const shownSettings = [
  "shared_buffers",
  "max_connections",
  "fsync",
  "synchronous_commit",
  "wal_sync_method",
  "commit_delay",
  "max_wal_size",
  "checkpoint_timeout",
  "autovacuum",
];

/**
 * `migrate: false` leaves the schema to the first server that starts: a
 * server of another build (--server-cli) may know other migrations.
 */
export async function startBenchPostgres(options: { migrate: boolean }): Promise<BenchPostgres> {
  const dir = await makeDataParent("leasehold-bench-");
  const embedded = await startEmbeddedPostgres({
    dataDir: path.join(dir, "pgdata"),
    ephemeral: true,
  });
  try {
    const admin = postgres(embedded.url, { max: 1, onnotice: () => {} });
    await admin.unsafe("CREATE DATABASE leasehold_bench");
    await admin.end();
    const url = embedded.urlFor("leasehold_bench");
    if (options.migrate) await migrate(url, allMigrationSets);
    const sql = openDatabase({
      url,
      maxConnections: 1,
      ...defaultTimeouts,
      applicationName: "leasehold-bench-monitor",
    });
    await createSeedTable(sql);
    const settings: Record<string, string> = {};
    for (const name of shownSettings) {
      const [row] = await sql.unsafe<{ value: string }[]>(
        `SELECT current_setting('${name}') AS value`,
      );
      settings[name] = row?.value ?? "";
    }
    const [{ version } = { version: "" }] = await sql<{ version: string }[]>`SELECT version()`;
    const postmaster = Number(
      (await readFile(path.join(embedded.dataDir, "postmaster.pid"), "utf8")).split("\n")[0],
    );
    return {
      url,
      version,
      settings,
      pids: () => processTree(postmaster),
      counters: async () => {
        const [db] = await sql<{ transactions: string }[]>`
          SELECT (xact_commit + xact_rollback)::text AS transactions
          FROM pg_stat_database WHERE datname = current_database()`;
        const [wal] = await sql<{ walSync: string; walBytes: string }[]>`
          SELECT wal_sync::text AS "walSync", wal_bytes::text AS "walBytes" FROM pg_stat_wal`;
        return {
          at: performance.now(),
          transactions: Number(db?.transactions ?? 0),
          walSyncs: Number(wal?.walSync ?? 0),
          walBytes: Number(wal?.walBytes ?? 0),
        };
      },
      overlappingGrants: (accountId, sessionId) =>
        countOverlappingGrants(sql, accountId, sessionId),
      stop: async () => {
        await sql.end({ timeout: 1 });
        await embedded.stop();
        await rm(dir, { recursive: true, force: true });
      },
    };
  } catch (error) {
    await embedded.stop();
    await rm(dir, { recursive: true, force: true });
    throw error;
  }
}

/**
 * The seed's table, for the raw-SQL limit: exactly the columns its two
 * statements need, next to Leasehold's own tables in the same database.
 */
export async function createSeedTable(sql: Sql): Promise<void> {
  await sql`
    CREATE TABLE demo_session_lease (
      account_id text NOT NULL,
      session_id text NOT NULL,
      run_id uuid NOT NULL,
      expires_at timestamptz NOT NULL,
      PRIMARY KEY (account_id, session_id)
    )`;
}

/**
 * S1 on the database's own record. Each grant's span runs from its
 * 'acquired' event to the first event that ended that run, on the database
 * clock; in token (= grant) order, a grant that starts before an earlier
 * one ended means two runs held the key at that moment.
 */
export async function countOverlappingGrants(
  sql: Sql,
  accountId: string,
  sessionId: string,
): Promise<number> {
  const [row] = await sql<{ overlaps: string }[]>`
    WITH events AS (
      SELECT type, run_id, fencing_token, at FROM lease_events
      WHERE account_id = ${accountId} AND session_id = ${sessionId}
    ),
    spans AS (
      SELECT g.fencing_token, g.at AS started,
             coalesce((SELECT min(e.at) FROM events e
                       WHERE e.run_id = g.run_id
                         AND e.type IN ('released', 'expired', 'revoked')), 'infinity') AS ended
      FROM events g WHERE g.type = 'acquired'
    ),
    ordered AS (
      SELECT started, max(ended) OVER (ORDER BY fencing_token
        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_ended
      FROM spans
    )
    SELECT count(*)::text AS overlaps FROM ordered WHERE started < earlier_ended`;
  return Number(row?.overlaps ?? 0);
}

/** Per-second rates between two counter readings. */
export function databaseRates(before: DatabaseCounters, after: DatabaseCounters) {
  const s = (after.at - before.at) / 1000;
  return {
    statementsPerSec: Math.round((after.transactions - before.transactions) / s),
    walSyncsPerSec: Math.round((after.walSyncs - before.walSyncs) / s),
    walMiBPerSec: Math.round(((after.walBytes - before.walBytes) / s / 1048576) * 10) / 10,
  };
}
