// A keeper's leases seen through the server's streams (K1, K2;
// docs/keepers.md), on a server in this process over real sockets. Watch:
// the snapshot shows each lease with its keeper's deadline, a heartbeat
// moves that deadline without an event, and when the keeper expires every
// one of its leases is reported EXPIRED at the keeper's deadline, confirmed
// by the expiry tracker's reading of the database (S9). A waiting Acquire of
// a lock-delayed key is granted when the delay is over, not before, and
// waits without trying again in between. The keepers and their leases are
// made in the database (the store), as another instance would: the server
// learns of them by reading.

import { randomUUID } from "node:crypto";
import { describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { createKeeperStore } from "../src/server/db/keeper-store.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import type { LeaseServer } from "../src/server/server.js";
import { openTransaction } from "./support/db.js";
import { useTestServer } from "./support/fixture.js";
import { ms, openWatch } from "./support/streams.js";

const { db, client, server } = useTestServer();

const micros = (t: { seconds: bigint; nanos: number } | undefined) =>
  t === undefined ? 0n : t.seconds * 1_000_000n + BigInt(Math.floor(t.nanos / 1_000));

/** A keeper of a fresh account, opened in the database (as another instance would). */
async function openKeeper(name: string, ttlMs: number, lockDelayMs: number) {
  const keepers = createKeeperStore(db.sql);
  const accountId = `acct-${name}-${randomUUID().slice(0, 8)}`;
  const opened = await keepers.open({
    id: randomUUID(),
    accountId,
    holder: "worker",
    ttlMs,
    lockDelayMs,
  });
  if (!opened.held) throw new Error("keeper not opened");
  return { keepers, accountId, keeper: opened.keeper };
}

describe("Watch on a keeper's leases", () => {
  it("K1, L1: each lease of an expired keeper is reported EXPIRED at the keeper's deadline; a heartbeat before it moves the deadline without an event", async () => {
    const { keepers, accountId, keeper } = await openKeeper("keeper-watch", 1_500, 0);
    const store = createLeaseStore(db.sql);
    const sessions = ["a", "b", "c"];
    const tokens = new Map<string, bigint>();
    for (const sessionId of sessions) {
      const granted = await store.acquire({
        accountId,
        sessionId,
        runId: randomUUID(),
        ttlMs: 60_000,
        holder: "worker",
        keeperId: keeper.id,
      });
      if (!granted.acquired) throw new Error("not acquired");
      tokens.set(sessionId, granted.lease.fencingToken);
    }

    const watch = openWatch(client, { accountId, sessionId: "" });
    const first = await watch.reader.next();
    if (first.kind.case !== "snapshot") throw new Error("no snapshot first");
    expect(first.kind.value.leases.map((l) => l.key?.sessionId).sort()).toEqual(sessions);
    for (const lease of first.kind.value.leases) {
      expect(micros(lease.expiresAt)).toBe(keeper.expiresAtUs);
    }

    // One heartbeat: the deadline the watcher's tracker armed passes with
    // the keeper renewed, so its reading finds the leases valid.
    const beat = await keepers.heartbeat(accountId, keeper.id);
    if (!beat.held) throw new Error("heartbeat failed");
    const deadline = beat.keeper.expiresAtUs;

    const events = [];
    for (let i = 0; i < sessions.length; i++) events.push(await watch.reader.next());
    const expired = events.map((m) => {
      if (m.kind.case !== "event") throw new Error(`expected an event, got ${m.kind.case}`);
      return m.kind.value;
    });
    expect(expired.map((e) => e.type)).toEqual(sessions.map(() => EventType.EXPIRED));
    expect(expired.map((e) => e.key?.sessionId).sort()).toEqual(sessions);
    for (const e of expired) {
      expect(micros(e.at)).toBe(deadline);
      expect(e.fencingToken).toBe(tokens.get(e.key?.sessionId ?? ""));
    }
    // Reported once the database clock passed the deadline (S9).
    const [clock] = await db.sql<{ nowUs: bigint }[]>`
      SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now_us`;
    expect(clock?.nowUs ?? 0n).toBeGreaterThan(deadline);
    watch.abort();
  });

  it("K1, S9: no EXPIRED is reported for a keeper's lease while a heartbeat that beat the deadline is being written; after it commits the lease lives on", async () => {
    const { accountId, keeper } = await openKeeper("keeper-late-beat", 1_000, 0);
    const key = { accountId, sessionId: "late-beat" };
    const held = await createLeaseStore(db.sql).acquire({
      ...key,
      runId: randomUUID(),
      ttlMs: 60_000,
      holder: "worker",
      keeperId: keeper.id,
    });
    if (!held.acquired) throw new Error("not acquired");
    // The watcher's snapshot carries the lease and its deadline (the
    // keeper's), which the expiry tracker then watches.
    const watch = openWatch(client, key);
    const snapshot = await watch.reader.next((m) => m.kind.case === "snapshot");
    expect(snapshot.kind.case === "snapshot" && snapshot.kind.value.leases.length).toBe(1);

    // The heartbeat: decided by the database clock before the deadline, its
    // commit held back across it.
    const beat = await openTransaction(db, async (tx) => {
      const rows = await tx`
        UPDATE keepers SET expires_at = clock_timestamp() + interval '60 seconds'
        WHERE id = ${keeper.id}::uuid AND ended IS NULL AND expires_at > clock_timestamp()
        RETURNING 1`;
      if (rows.length !== 1) throw new Error("the heartbeat did not match");
    });
    // Past the old deadline on the database clock, by more than the
    // tracker's first readings (at the deadline, then 20 and 40 ms later).
    await db.sql`SELECT pg_sleep_until(to_timestamp(${Number(keeper.expiresAtUs) / 1e6})
                                       + interval '300 milliseconds')`;
    const expiredEarly = watch.reader.received.some(
      (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
    );
    expect(expiredEarly).toBe(false);
    await beat.end();
    // The lease lived on: the next change the watcher is told is its release.
    const released = await client.release({ key, runId: held.lease.runId });
    expect(released.released).toBe(true);
    const next = await watch.reader.next((m) => m.kind.case === "event");
    expect(next.kind.case === "event" && next.kind.value.type).toBe(EventType.RELEASED);
    watch.abort();
  });

  it("K2: a waiting Acquire of a lock-delayed key is granted once the delay is over on the database clock, with no attempts in between", async () => {
    const { accountId, keeper } = await openKeeper("keeper-wait", 1_000, 1_500);
    const store = createLeaseStore(db.sql);
    const key = { accountId, sessionId: "delayed" };
    const held = await store.acquire({
      ...key,
      runId: randomUUID(),
      ttlMs: 60_000,
      holder: "worker",
      keeperId: keeper.id,
    });
    if (!held.acquired) throw new Error("not acquired");
    await db.sql`SELECT pg_sleep_until(expires_at + interval '1 millisecond')
      FROM keepers WHERE id = ${keeper.id}::uuid`;
    const waiters = (server as LeaseServer).streaming.waiters.stats;
    const attemptsBefore = waiters.attempts;
    const answer = await client.acquire({ key, ttl: ms(10_000), wait: ms(10_000) });
    expect(answer.acquired).toBe(true);
    const acquiredAtUs = micros(answer.lease?.acquiredAt);
    expect(acquiredAtUs).toBeGreaterThanOrEqual(keeper.expiresAtUs + 1_500_000n);
    expect(answer.lease?.fencingToken).toBeGreaterThan(held.lease.fencingToken);
    // One attempt when the delay is over (a change or the periodic re-check may add one), not a spin.
    expect(waiters.attempts - attemptsBefore).toBeLessThanOrEqual(3);
  });
});
