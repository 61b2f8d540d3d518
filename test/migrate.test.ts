// The migration runner: each component applies its own set; concurrent
// servers take turns and apply each file once; versions run without gaps and
// apply strictly in order; a schema newer than the release, or one migrated
// out of order, is refused; a database migrated before the sets existed is
// adopted.

import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import postgres from "postgres";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  allMigrationSets,
  guardedStoreSets,
  leaseServerSets,
  loadMigrations,
  type Migration,
  migrate,
  SchemaMismatchError,
} from "../src/postgres/migrate.js";
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

async function withConnection<T>(url: string, work: (c: postgres.Sql) => Promise<T>): Promise<T> {
  const c = postgres(url, { max: 1, onnotice: () => {} });
  try {
    return await work(c);
  } finally {
    await c.end();
  }
}

const recorded = (c: postgres.Sql) =>
  c<{ migrationSet: string; version: number }[]>`
    SELECT migration_set AS "migrationSet", version FROM leasehold_schema_migrations
    ORDER BY migration_set, version`;

async function everyMigration(): Promise<Migration[]> {
  return (await Promise.all(allMigrationSets.map((s) => loadMigrations(s)))).flat();
}

describe("migrations", () => {
  it("S6: four servers migrating one empty database at once apply each file exactly once", async () => {
    const url = await emptyDatabase();
    const results = await Promise.all([1, 2, 3, 4].map(() => migrate(url, allMigrationSets)));
    const all = await everyMigration();
    const key = (m: { set: string; version: number }) => `${m.set}/${m.version}`;
    expect(results.flat().map(key).sort()).toEqual(all.map(key).sort());
    await withConnection(url, async (c) => {
      expect((await recorded(c)).map((r) => `${r.migrationSet}/${r.version}`).sort()).toEqual(
        all.map(key).sort(),
      );
      const [seq] =
        await c`SELECT cache_size, cycle FROM pg_sequences WHERE sequencename = 'lease_fencing_token'`;
      // S6: a per-connection cache would hand later grants smaller numbers.
      expect(seq).toMatchObject({ cache_size: "1", cycle: false });
    });
  });

  it("each server applies its own set: the lease server no guarded store table, and the reverse", async () => {
    const leaseOnly = await emptyDatabase();
    await migrate(leaseOnly, leaseServerSets);
    const guardedOnly = await emptyDatabase();
    await migrate(guardedOnly, guardedStoreSets);
    const tables = (url: string) =>
      withConnection(url, async (c) => {
        const rows = await c<{ t: string | null }[]>`
          SELECT to_regclass(name)::text AS t
          FROM unnest(ARRAY['leases', 'lease_events', 'session_acl', 'leasehold_fences',
                            'guarded_documents']) AS name`;
        return rows.map((r) => r.t).filter((t) => t !== null);
      });
    expect(await tables(leaseOnly)).toEqual(["leases", "lease_events", "session_acl"]);
    expect(await tables(guardedOnly)).toEqual(["leasehold_fences", "guarded_documents"]);
  });

  it("a database migrated by a newer release is refused and left unchanged", async () => {
    const url = await emptyDatabase();
    await migrate(url, leaseServerSets);
    const known = (await loadMigrations("lease")).length;
    await withConnection(url, async (c) => {
      await c`INSERT INTO leasehold_schema_migrations (migration_set, version, name)
              VALUES ('lease', ${known + 1}, 'from_the_future')`;
      const before = await recorded(c);
      await expect(migrate(url, leaseServerSets)).rejects.toThrow(SchemaMismatchError);
      await expect(migrate(url, leaseServerSets)).rejects.toThrow(/newer than this release knows/);
      expect(await recorded(c)).toEqual(before);
    });
  });

  it("a version missing below the newest applied is refused: migrations apply strictly in order", async () => {
    const url = await emptyDatabase();
    // The bookkeeping table, made by migrating another set; then a record of
    // lease version 2 alone, as a release that numbered differently would leave.
    await migrate(url, ["fence"]);
    await withConnection(url, async (c) => {
      await c`INSERT INTO leasehold_schema_migrations (migration_set, version, name)
              VALUES ('lease', 2, 'session_acl')`;
    });
    await expect(migrate(url, leaseServerSets)).rejects.toThrow(
      /has version 2 but not 1: it was migrated by another line of releases/,
    );
    await withConnection(url, async (c) => {
      const [t] = await c`SELECT to_regclass('leases') AS t`;
      expect(t?.t).toBeNull();
    });
  });

  it("a failing migration rolls back whole and records nothing", async () => {
    const url = await emptyDatabase();
    const lease = await loadMigrations("lease");
    const broken: Migration[] = [
      ...lease,
      {
        set: "lease",
        version: lease.length + 1,
        name: "broken",
        sql: "CREATE TABLE half_done (x int); SELECT 1/0;",
      },
    ];
    await expect(migrate(url, leaseServerSets, broken)).rejects.toThrow(/division by zero/);
    await withConnection(url, async (c) => {
      const [t] = await c`SELECT to_regclass('half_done') AS t`;
      expect(t?.t).toBeNull();
      const rows = await c`SELECT max(version)::int AS v FROM leasehold_schema_migrations`;
      expect(rows[0]?.v).toBe(lease.length);
    });
  });

  it("files of a set are numbered 1, 2, 3 … without gaps or repeats", async () => {
    const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-migrations-"));
    try {
      const folder = path.join(dir, "lease");
      await mkdir(folder);
      await writeFile(path.join(folder, "0001_a.sql"), "SELECT 1;");
      await writeFile(path.join(folder, "0002_b.sql"), "SELECT 2;");
      expect((await loadMigrations("lease", `${dir}/`)).map((m) => m.version)).toEqual([1, 2]);
      await writeFile(path.join(folder, "0004_d.sql"), "SELECT 4;");
      await expect(loadMigrations("lease", `${dir}/`)).rejects.toThrow(
        /0004_d.sql: expected version 3/,
      );
      await rm(path.join(folder, "0004_d.sql"));
      await writeFile(path.join(folder, "0002_c.sql"), "SELECT 2;");
      await expect(loadMigrations("lease", `${dir}/`)).rejects.toThrow(
        /0002_c.sql: expected version 3/,
      );
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("a database of the earlier single list (leasehold_migrations 1, 2, 4) is adopted, not migrated again", async () => {
    const url = await emptyDatabase();
    // What the earlier release applied: the first two lease files, the fence and the documents.
    await migrate(url, allMigrationSets, [
      ...(await loadMigrations("lease")).slice(0, 2),
      ...(await loadMigrations("fence")),
      ...(await loadMigrations("guarded")),
    ]);
    await withConnection(url, async (c) => {
      // What the earlier release left: the same tables, its own record.
      await c`DROP TABLE leasehold_schema_migrations`;
      await c`CREATE TABLE leasehold_migrations (version integer PRIMARY KEY, name text NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT clock_timestamp())`;
      await c`INSERT INTO leasehold_migrations (version, name)
              VALUES (1, 'leases'), (2, 'fence'), (4, 'session_acl')`;
    });
    // Only what came after the single list is applied.
    const after = (await loadMigrations("lease"))
      .slice(2)
      .map((m) => ({ set: "lease", version: m.version }));
    expect(await migrate(url, allMigrationSets)).toEqual(after);
    await withConnection(url, async (c) => {
      expect((await recorded(c)).slice(0, 4)).toEqual([
        { migrationSet: "fence", version: 1 },
        { migrationSet: "guarded", version: 1 },
        { migrationSet: "lease", version: 1 },
        { migrationSet: "lease", version: 2 },
      ]);
      // An earlier release now finds a version it does not know, and refuses.
      const legacy = await c`SELECT max(version)::int AS v FROM leasehold_migrations`;
      expect(legacy[0]?.v).toBe(1000);
    });
  });

  it("a database of the earlier list without the session ACL (1, 2) gets that migration and what came after", async () => {
    const url = await emptyDatabase();
    const [leases] = await loadMigrations("lease");
    if (!leases) throw new Error("the lease set starts with its tables");
    await migrate(url, allMigrationSets, [
      leases,
      ...(await loadMigrations("fence")),
      ...(await loadMigrations("guarded")),
    ]);
    await withConnection(url, async (c) => {
      await c`DROP TABLE leasehold_schema_migrations`;
      await c`CREATE TABLE leasehold_migrations (version integer PRIMARY KEY, name text NOT NULL)`;
      await c`INSERT INTO leasehold_migrations (version, name) VALUES (1, 'leases'), (2, 'fence')`;
    });
    const after = (await loadMigrations("lease"))
      .slice(1)
      .map((m) => ({ set: "lease", version: m.version }));
    expect(await migrate(url, allMigrationSets)).toEqual(after);
    await withConnection(url, async (c) => {
      const [t] = await c`SELECT to_regclass('session_acl')::text AS t`;
      expect(t?.t).toBe("session_acl");
    });
  });
});
