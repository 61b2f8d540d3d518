// Forward-only schema migrations, one set per component: migrations/<set>/
// holds NNNN_name.sql files numbered 1, 2, 3 … without gaps. Each file is
// applied in its own transaction under an advisory lock and recorded in
// leasehold_schema_migrations as (set, version). The lease server applies
// `lease`; the guarded store applies `fence` then `guarded`; any other
// resource may apply `fence` alone (it only ships leasehold_fence).
//
// Order is strict, so that every database goes through the same sequence:
// a set is applied from its first unapplied version on, and a database is
// refused when it records a version this release does not know (a newer
// release migrated it) or lacks a version below its newest applied one (it
// was migrated by another line of releases).

import { readdir, readFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import postgres from "postgres";

export const migrationsDir = fileURLToPath(new URL("../../migrations/", import.meta.url));

/** The migration sets, in the order a server that needs several applies them. */
export type MigrationSet = "lease" | "fence" | "guarded";

export const leaseServerSets: readonly MigrationSet[] = ["lease"];
export const guardedStoreSets: readonly MigrationSet[] = ["fence", "guarded"];
/** Every set: one database holding both servers' tables (tests, benchmarks). */
export const allMigrationSets: readonly MigrationSet[] = ["lease", "fence", "guarded"];

// An arbitrary constant shared by every Leasehold process: two servers
// starting at once take turns instead of racing on the same DDL.
const migrationLockKey = 7_140_241_817_205_311n;

export interface Migration {
  set: MigrationSet;
  version: number;
  name: string;
  sql: string;
}

/** The database was migrated past what this release knows, or out of order. */
export class SchemaMismatchError extends Error {
  override readonly name = "SchemaMismatchError";
}

/** Reads migrations/<set>/NNNN_name.sql; versions must run 1, 2, 3 … */
export async function loadMigrations(set: MigrationSet, dir = migrationsDir): Promise<Migration[]> {
  const folder = `${dir}${set}/`;
  const files = (await readdir(folder)).filter((f) => /^\d{4}_[a-z0-9_]+\.sql$/.test(f)).sort();
  const migrations: Migration[] = [];
  for (const file of files) {
    const version = Number(file.slice(0, 4));
    if (version !== migrations.length + 1) {
      throw new Error(
        `migrations/${set}/${file}: expected version ${migrations.length + 1}; versions run 1, 2, 3 … without gaps or repeats`,
      );
    }
    migrations.push({
      set,
      version,
      name: file.slice(5, -4),
      sql: await readFile(`${folder}${file}`, "utf8"),
    });
  }
  return migrations;
}

// Databases migrated before the sets existed recorded one numbered list in
// leasehold_migrations: 1 (leases), 2 (fence and documents), 4 (session
// ACL). They are adopted once: those versions count as applied in the new
// table, and the old table gets a version no earlier release knows, so an
// earlier release refuses the database instead of migrating it again.
const legacyVersions: Record<number, [MigrationSet, number][]> = {
  1: [["lease", 1]],
  2: [
    ["fence", 1],
    ["guarded", 1],
  ],
  4: [["lease", 2]],
};
const legacyAdopted = 1000;

type Db = postgres.Sql<{ bigint: bigint }>;

/**
 * Applies the pending migrations of `sets` to the database at `url` and
 * returns what it applied. Uses its own single connection, closed before
 * returning. `given` replaces the files (tests).
 */
export async function migrate(
  url: string,
  sets: readonly MigrationSet[] = leaseServerSets,
  given?: Migration[],
): Promise<{ set: MigrationSet; version: number }[]> {
  const sql: Db = postgres(url, { max: 1, onnotice: () => {}, types: { bigint: postgres.BigInt } });
  try {
    await sql`SELECT pg_advisory_lock(${migrationLockKey})`;
    try {
      await sql`
        CREATE TABLE IF NOT EXISTS leasehold_schema_migrations (
          migration_set text NOT NULL,
          version integer NOT NULL,
          name text NOT NULL,
          applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
          PRIMARY KEY (migration_set, version)
        )`;
      await adoptLegacy(sql);
      const ran: { set: MigrationSet; version: number }[] = [];
      for (const set of sets) {
        const all = given?.filter((m) => m.set === set) ?? (await loadMigrations(set));
        for (const m of await pending(sql, set, all)) {
          await sql.begin(async (tx) => {
            await tx.unsafe(m.sql);
            await tx`
              INSERT INTO leasehold_schema_migrations (migration_set, version, name)
              VALUES (${m.set}, ${m.version}, ${m.name})`;
          });
          ran.push({ set: m.set, version: m.version });
        }
      }
      return ran;
    } finally {
      await sql`SELECT pg_advisory_unlock(${migrationLockKey})`;
    }
  } finally {
    await sql.end({ timeout: 5 });
  }
}

/** The migrations of `set` still to apply, after checking the recorded ones against `all`. */
async function pending(sql: Db, set: MigrationSet, all: Migration[]): Promise<Migration[]> {
  const applied = (
    await sql<{ version: number }[]>`
      SELECT version FROM leasehold_schema_migrations
      WHERE migration_set = ${set} ORDER BY version`
  ).map((r) => r.version);
  const known = all.length;
  const newest = applied.at(-1) ?? 0;
  if (newest > known) {
    throw new SchemaMismatchError(
      `the database's ${set} schema is at version ${newest}, newer than this release knows (${known}); ` +
        "upgrade Leasehold instead of running an older release against it",
    );
  }
  const missing = all.filter((m) => m.version < newest && !applied.includes(m.version));
  if (missing.length > 0) {
    throw new SchemaMismatchError(
      `the database's ${set} schema has version ${newest} but not ${missing.map((m) => m.version).join(", ")}: ` +
        "it was migrated by another line of releases; migrations apply strictly in order",
    );
  }
  return all.filter((m) => m.version > newest);
}

async function adoptLegacy(sql: Db): Promise<void> {
  const [legacy] = await sql<{ t: string | null }[]>`
    SELECT to_regclass('leasehold_migrations')::text AS t`;
  if (!legacy?.t) return;
  const versions = (
    await sql<{ version: number }[]>`SELECT version FROM leasehold_migrations ORDER BY version`
  ).map((r) => r.version);
  if (versions.includes(legacyAdopted)) return;
  const unknown = versions.filter((v) => !(v in legacyVersions));
  if (unknown.length > 0) {
    throw new SchemaMismatchError(
      `leasehold_migrations records version ${unknown.join(", ")}, which this release does not know`,
    );
  }
  await sql.begin(async (tx) => {
    for (const v of versions) {
      for (const [set, version] of legacyVersions[v] ?? []) {
        await tx`
          INSERT INTO leasehold_schema_migrations (migration_set, version, name)
          VALUES (${set}, ${version}, ${`adopted from leasehold_migrations ${v}`})
          ON CONFLICT DO NOTHING`;
      }
    }
    await tx`
      INSERT INTO leasehold_migrations (version, name)
      VALUES (${legacyAdopted}, 'moved to leasehold_schema_migrations')`;
  });
}
