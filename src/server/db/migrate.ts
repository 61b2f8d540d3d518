// Forward-only schema migrations: numbered SQL files in migrations/, each
// applied in its own transaction under an advisory lock and recorded in
// leasehold_migrations. A database already migrated past the newest file
// this release knows is refused rather than used.

import { readdir, readFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import postgres from "postgres";

export const migrationsDir = fileURLToPath(new URL("../../../migrations/", import.meta.url));

// An arbitrary constant shared by every Leasehold process: two servers
// starting at once take turns instead of racing on the same DDL.
const migrationLockKey = 7_140_241_817_205_311n;

export interface Migration {
  version: number;
  name: string;
  sql: string;
}

export class SchemaTooNewError extends Error {
  override readonly name = "SchemaTooNewError";
}

/** Reads migrations/NNNN_name.sql in version order. */
export async function loadMigrations(dir = migrationsDir): Promise<Migration[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{4}_[a-z0-9_]+\.sql$/.test(f)).sort();
  const migrations: Migration[] = [];
  for (const file of files) {
    migrations.push({
      version: Number(file.slice(0, 4)),
      name: file.slice(5, -4),
      sql: await readFile(`${dir}${file}`, "utf8"),
    });
  }
  // Versions must strictly increase; gaps are allowed, so features developed
  // side by side can each claim a number without renumbering the others.
  migrations.forEach((m, i) => {
    const previous = migrations[i - 1];
    if (m.version < 1 || (previous !== undefined && m.version <= previous.version)) {
      throw new Error(`migration ${m.version}_${m.name} repeats or precedes another version`);
    }
  });
  return migrations;
}

/**
 * Applies every pending migration to the database at `url` and returns the
 * versions applied. Uses its own single connection, closed before returning.
 */
export async function migrate(url: string, migrations?: Migration[]): Promise<number[]> {
  const all = migrations ?? (await loadMigrations());
  const sql = postgres(url, { max: 1, onnotice: () => {}, types: { bigint: postgres.BigInt } });
  try {
    await sql`SELECT pg_advisory_lock(${migrationLockKey})`;
    try {
      await sql`
        CREATE TABLE IF NOT EXISTS leasehold_migrations (
          version integer PRIMARY KEY,
          name text NOT NULL,
          applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )`;
      const applied = await sql<{ version: number }[]>`
        SELECT version FROM leasehold_migrations ORDER BY version`;
      const known = all.at(-1)?.version ?? 0;
      const newest = applied.at(-1)?.version ?? 0;
      if (newest > known) {
        throw new SchemaTooNewError(
          `the database schema is at version ${newest}, newer than this release knows (${known}); ` +
            "upgrade Leasehold instead of running an older release against it",
        );
      }
      const done = new Set(applied.map((r) => r.version));
      const ran: number[] = [];
      for (const m of all) {
        if (done.has(m.version)) continue;
        await sql.begin(async (tx) => {
          await tx.unsafe(m.sql);
          await tx`INSERT INTO leasehold_migrations (version, name) VALUES (${m.version}, ${m.name})`;
        });
        ran.push(m.version);
      }
      return ran;
    } finally {
      await sql`SELECT pg_advisory_unlock(${migrationLockKey})`;
    }
  } finally {
    await sql.end({ timeout: 5 });
  }
}
