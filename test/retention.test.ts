// Retention on real PostgreSQL: old audit events are trimmed, and the
// tombstone collector deletes only rows ended a whole horizon ago, skips a
// row an acquire is working on, and keeps S6 for the keys it deleted.

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import type { LeaseStore } from "../src/lease/types.js";
import { createLogger } from "../src/log/logger.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { createRetention, type Retention, startMaintenance } from "../src/server/db/retention.js";
import { openTransaction } from "./support/db.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";

const { db } = useTestDatabase();
let store: LeaseStore;
let retention: Retention;
const day = 86_400_000;

beforeAll(() => {
  store = createLeaseStore(db.sql);
  retention = createRetention(db.sql, { eventRetentionMs: 30 * day, tombstoneHorizonMs: day });
});

// Moves a row's times into the past, as if it ended `ageMs` ago.
async function age(key: { accountId: string; sessionId: string }, ageMs: number) {
  await db.sql`
    UPDATE leases SET
      acquired_at = clock_timestamp() - ${ageMs}::bigint * interval '1 ms' - interval '1 minute',
      expires_at = clock_timestamp() - ${ageMs}::bigint * interval '1 ms'
    WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
}

const rowExists = async (key: { accountId: string; sessionId: string }) =>
  (
    await db.sql`SELECT 1 FROM leases
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`
  ).length === 1;

describe("tombstone collector", () => {
  it("S6: deletes tombstones older than the horizon only; a later grant still gets a larger token", async () => {
    const old = freshKey("old");
    const recent = freshKey("recent");
    const valid = freshKey("valid");
    const tokens: bigint[] = [];
    for (const key of [old, recent, valid]) {
      const a = await store.acquire({ ...key, runId: randomUUID(), ttlMs: 60_000, holder: "" });
      if (!a.acquired) throw new Error("not acquired");
      tokens.push(a.lease.fencingToken);
      if (key !== valid) await store.release(key, a.lease.runId);
    }
    await age(old, day + 60_000);
    await age(recent, day - 60_000);

    expect(await retention.collectTombstones()).toBeGreaterThanOrEqual(1);
    expect(await rowExists(old)).toBe(false);
    expect(await rowExists(recent)).toBe(true);
    expect(await rowExists(valid)).toBe(true);

    const again = await store.acquire({ ...old, runId: randomUUID(), ttlMs: 60_000, holder: "" });
    expect(again.acquired).toBe(true);
    if (again.acquired) expect(again.lease.fencingToken).toBeGreaterThan(tokens[0] ?? 0n);
  });

  it("S3: a tombstone being re-granted (row locked) is skipped, and kept once the grant commits", async () => {
    const key = freshKey("busy");
    const a = await store.acquire({ ...key, runId: randomUUID(), ttlMs: 60_000, holder: "" });
    if (!a.acquired) throw new Error("not acquired");
    await store.release(key, a.lease.runId);
    await age(key, 2 * day);

    // A transaction that re-grants the row and holds its lock, as an
    // acquire does between its row lock and its commit.
    const regrant = await openTransaction(
      db,
      (t) => t`UPDATE leases SET expires_at = clock_timestamp() + interval '1 minute'
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`,
    );
    await retention.collectTombstones();
    expect(await rowExists(key)).toBe(true);
    await regrant.end();
    await retention.collectTombstones();
    expect(await rowExists(key)).toBe(true);
  });
});

describe("audit trail retention", () => {
  it("deletes events older than the retention and keeps newer ones", async () => {
    const key = freshKey("events");
    const a = await store.acquire({ ...key, runId: randomUUID(), ttlMs: 60_000, holder: "" });
    if (!a.acquired) throw new Error("not acquired");
    await store.release(key, a.lease.runId);
    const [oldest] = await db.sql<{ id: bigint }[]>`
      SELECT min(id) AS id FROM lease_events
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    await db.sql`UPDATE lease_events SET at = clock_timestamp() - interval '31 days'
      WHERE id = ${oldest?.id ?? 0n}`;

    expect(await retention.trimEvents()).toBe(1);
    const left = await db.sql<{ type: string }[]>`
      SELECT type FROM lease_events
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    expect(left.map((r) => r.type)).toEqual(["released"]);
  });

  it("one instance works at a time: a round finds the lock taken and deletes nothing", async () => {
    const holder = await openTransaction(
      db,
      (t) => t`SELECT pg_advisory_xact_lock(7140241817205312)`,
    );
    const key = freshKey("locked");
    const a = await store.acquire({ ...key, runId: randomUUID(), ttlMs: 60_000, holder: "" });
    if (!a.acquired) throw new Error("not acquired");
    await store.release(key, a.lease.runId);
    await age(key, 2 * day);
    const maintenance = startMaintenance(retention, 3_600_000, createLogger({ level: "silent" }));
    expect(await maintenance.runOnce()).toEqual({ events: 0, tombstones: 0 });
    await holder.end();
    expect((await maintenance.runOnce()).tombstones).toBeGreaterThanOrEqual(1);
    await maintenance.stop();
  });
});
