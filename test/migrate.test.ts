// The migration runner: concurrent servers take turns, applied versions are
// recorded once, and a schema newer than the release is refused.

import { mkdtemp, rm, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import postgres from "postgres";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { loadMigrations, migrate, SchemaTooNewError } from "../src/server/db/migrate.js";
import { createTestDatabase, type TestDatabase } from "./support/db.js";

let db: TestDatabase;

beforeAll(async () => {
  db = await createTestDatabase();
});
afterAll(async () => {
  await db?.close();
});

async function emptyDatabase(): Promise<string> {
  const name = `leasehold_migrate_${Math.random().toString(36).slice(2, 10)}`;
  await db.sql.unsafe(`CREATE DATABASE ${name}`);
  const u = new URL(db.url);
  u.pathname = `/${name}`;
  return u.toString();
}

describe("migrations", () => {
  it("four servers migrating one empty database at once apply each file exactly once", async () => {
    const url = await emptyDatabase();
    const results = await Promise.all([migrate(url), migrate(url), migrate(url), migrate(url)]);
    const all = (await loadMigrations()).map((m) => m.version);
    expect(results.flat().sort()).toEqual(all);
    const check = postgres(url, { max: 1 });
    try {
      const rows = await check`SELECT version FROM leasehold_migrations ORDER BY version`;
      expect(rows.map((r) => r.version)).toEqual(all);
      const [seq] =
        await check`SELECT cache_size, cycle FROM pg_sequences WHERE sequencename = 'lease_fencing_token'`;
      // S6: a per-connection cache would hand later grants smaller numbers.
      expect(seq).toMatchObject({ cache_size: "1", cycle: false });
    } finally {
      await check.end();
    }
  });

  it("a database migrated by a newer release is refused and left unchanged", async () => {
    const url = await emptyDatabase();
    await migrate(url);
    const migrations = await loadMigrations();
    const known = migrations.at(-1)?.version ?? 0;
    const c = postgres(url, { max: 1 });
    try {
      await c`INSERT INTO leasehold_migrations (version, name) VALUES (${known + 1}, 'from_the_future')`;
      await expect(migrate(url)).rejects.toBeInstanceOf(SchemaTooNewError);
      const rows = await c`SELECT count(*)::int AS n FROM leasehold_migrations`;
      expect(rows[0]?.n).toBe(migrations.length + 1);
    } finally {
      await c.end();
    }
  });

  it("a failing migration rolls back whole and records nothing", async () => {
    const url = await emptyDatabase();
    const migrations = await loadMigrations();
    const newest = migrations.at(-1)?.version ?? 0;
    const broken = [
      ...migrations,
      {
        version: newest + 1,
        name: "broken",
        sql: "CREATE TABLE half_done (x int); SELECT 1/0;",
      },
    ];
    await expect(migrate(url, broken)).rejects.toThrow(/division by zero/);
    const c = postgres(url, { max: 1 });
    try {
      const [t] = await c`SELECT to_regclass('half_done') AS t`;
      expect(t?.t).toBeNull();
      const rows = await c`SELECT max(version)::int AS v FROM leasehold_migrations`;
      expect(rows[0]?.v).toBe(newest);
    } finally {
      await c.end();
    }
  });

  it("versions may skip numbers but must strictly increase", async () => {
    const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-migrations-"));
    try {
      await writeFile(path.join(dir, "0001_a.sql"), "SELECT 1;");
      await writeFile(path.join(dir, "0004_d.sql"), "SELECT 4;");
      const loaded = await loadMigrations(`${dir}/`);
      expect(loaded.map((m) => m.version)).toEqual([1, 4]);
      await writeFile(path.join(dir, "0004_e.sql"), "SELECT 4;");
      await expect(loadMigrations(`${dir}/`)).rejects.toThrow(/migration 4_e repeats or precedes/);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
