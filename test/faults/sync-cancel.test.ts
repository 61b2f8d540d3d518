// A COMMIT waiting for its synchronous standby, cancelled (pg_cancel_backend
// by an operator or a tool): PostgreSQL does not fail it. The commit stands
// on the primary, the statement reports success, and the only sign is a
// WARNING that the standby may not have it. Leasehold never cancels a lease
// statement itself (docs/failover.md); this is what the pool does with the
// warning when something else does: it logs it at warn level with the
// connection's application_name and counts it
// (leasehold_db_sync_replication_cancelled_total), because a failover right
// then can lose a lease change the client was told about (S6, S7 rely on
// every acknowledged grant being on the standby, DESIGN §8).
//
// Deterministic: the standby is stopped first, so the commit waits until the
// cancel, which is sent once pg_stat_activity shows the wait (SyncRep).

import { randomUUID } from "node:crypto";
import postgres from "postgres";
import { Counter, Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createLogger } from "../../src/log/logger.js";
import { allMigrationSets, migrate } from "../../src/postgres/migrate.js";
import { openDatabase, type Sql } from "../../src/postgres/pool.js";
import { createLeaseStore } from "../../src/server/db/lease-store.js";
import { waitFor } from "../support/wait.js";
import { type ReplicatedDatabase, startReplicatedDatabase } from "./replication.js";

const databaseName = "leasehold_sync_cancel";
const applicationName = "leasehold-sync-cancel";

describe("a cancelled wait for the synchronous standby", () => {
  let database: ReplicatedDatabase;
  let sql: Sql;
  let admin: postgres.Sql;
  const logLines: Record<string, unknown>[] = [];
  const registry = new Registry();
  const cancelled = new Counter({
    name: "leasehold_db_sync_replication_cancelled_total",
    help: "test",
    registers: [registry],
  });
  const counted = async () =>
    (await registry.getSingleMetric("leasehold_db_sync_replication_cancelled_total")?.get())
      ?.values[0]?.value ?? 0;

  beforeAll(async () => {
    database = await startReplicatedDatabase({ synchronous: true });
    admin = postgres(database.directUrlFor("postgres"), { max: 1, onnotice: () => {} });
    await admin.unsafe(`CREATE DATABASE ${databaseName}`);
    const url = database.directUrlFor(databaseName);
    await migrate(url, allMigrationSets);
    const logger = createLogger({
      level: "warn",
      destination: { write: (line: string) => logLines.push(JSON.parse(line)) },
    });
    sql = openDatabase({
      url,
      maxConnections: 2,
      statementTimeoutMs: 10_000,
      lockTimeoutMs: 1_000,
      idleInTransactionTimeoutMs: 10_000,
      applicationName,
      notices: { logger, syncReplicationCancelled: cancelled },
    });
  });

  afterAll(async () => {
    await sql?.end({ timeout: 1 });
    await admin?.end({ timeout: 1 });
    await database?.close();
  });

  it("other warnings are neither logged nor counted", async () => {
    await sql`DO $$ BEGIN RAISE WARNING 'an unrelated warning'; END $$`;
    expect(await counted()).toBe(0);
    expect(logLines).toEqual([]);
  });

  it("S6, S7: a grant whose commit wait is cancelled is answered as granted; the pool logs and counts the warning", async () => {
    const store = createLeaseStore(sql);
    await database.stopStandby();
    const grant = store.acquire({
      accountId: "sync-cancel",
      sessionId: "s1",
      runId: randomUUID(),
      ttlMs: 30_000,
      holder: "test",
    });
    const [waiting] = await waitFor(
      async () => {
        const rows = await admin<{ pid: number }[]>`
          SELECT pid FROM pg_stat_activity
          WHERE application_name = ${applicationName} AND wait_event = 'SyncRep'`;
        return rows.length > 0 ? rows : undefined;
      },
      { what: "the grant's commit to wait for the standby", timeoutMs: 10_000, intervalMs: 20 },
    );
    await admin`SELECT pg_cancel_backend(${waiting?.pid ?? 0})`;
    // What PostgreSQL reports, and so Leasehold: a grant, which the
    // stopped standby does not have.
    const answer = await grant;
    expect(answer.acquired).toBe(true);
    await waitFor(async () => ((await counted()) === 1 ? true : undefined), {
      what: "the counter",
      timeoutMs: 5_000,
      intervalMs: 10,
    });
    expect(logLines).toHaveLength(1);
    expect(logLines[0]).toMatchObject({
      level: 40,
      applicationName,
      notice: expect.stringMatching(/^canceling wait for synchronous replication/),
      detail: expect.stringMatching(/already committed locally/),
    });
  });
});
