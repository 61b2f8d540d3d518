// The benchmark's PostgreSQL: embedded (the same package `npm start` and the
// tests use) in a temporary folder, one migrated database that the service,
// the raw-SQL limit and the store all share, and the counters that say how
// hard the database worked during a window.

import { mkdtemp, readFile, rm } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import postgres from "postgres";
import { startEmbeddedPostgres } from "../src/server/embedded-postgres.js";
import { migrate } from "../src/server/migrate.js";
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

export async function startBenchPostgres(): Promise<BenchPostgres> {
  const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-bench-"));
  const embedded = await startEmbeddedPostgres({
    dataDir: path.join(dir, "pgdata"),
    ephemeral: true,
  });
  try {
    const admin = postgres(embedded.url, { max: 1, onnotice: () => {} });
    await admin.unsafe("CREATE DATABASE leasehold_bench");
    await admin.end();
    const url = embedded.urlFor("leasehold_bench");
    await migrate(url);
    const sql = postgres(url, { max: 1, onnotice: () => {} });
    // The seed's table, for the raw-SQL limit: exactly the columns its two
    // statements need, next to Leasehold's own tables in the same database.
    await sql`
      CREATE TABLE demo_session_lease (
        account_id text NOT NULL,
        session_id text NOT NULL,
        run_id uuid NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (account_id, session_id)
      )`;
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

/** Per-second rates between two counter readings. */
export function databaseRates(before: DatabaseCounters, after: DatabaseCounters) {
  const s = (after.at - before.at) / 1000;
  return {
    statementsPerSec: Math.round((after.transactions - before.transactions) / s),
    walSyncsPerSec: Math.round((after.walSyncs - before.walSyncs) / s),
    walMiBPerSec: Math.round(((after.walBytes - before.walBytes) / s / 1048576) * 10) / 10,
  };
}
