// Watch on a keeper's leases (K1; docs/keepers.md), on a server in this
// process over real sockets: the snapshot shows each lease with its keeper's
// deadline, a heartbeat moves that deadline without an event, and when the
// keeper expires every one of its leases is reported EXPIRED at the keeper's
// deadline, confirmed by the expiry tracker's reading of the database (S9).
// The keeper and its leases are made in the database (the store), as
// another instance would: the server learns of them by reading.

import { randomUUID } from "node:crypto";
import { describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { createKeeperStore } from "../src/server/db/keeper-store.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { useTestServer } from "./support/fixture.js";
import { openWatch } from "./support/streams.js";

const { db, client } = useTestServer();

const micros = (t: { seconds: bigint; nanos: number } | undefined) =>
  t === undefined ? 0n : t.seconds * 1_000_000n + BigInt(Math.floor(t.nanos / 1_000));

describe("Watch on a keeper's leases", () => {
  it("K1, L1: each lease of an expired keeper is reported EXPIRED at the keeper's deadline; a heartbeat before it moves the deadline without an event", async () => {
    const keepers = createKeeperStore(db.sql);
    const store = createLeaseStore(db.sql);
    const accountId = `acct-keeper-watch-${randomUUID().slice(0, 8)}`;
    const opened = await keepers.open({
      id: randomUUID(),
      accountId,
      holder: "worker",
      ttlMs: 1_500,
      lockDelayMs: 0,
    });
    if (!opened.held) throw new Error("keeper not opened");
    const keeper = opened.keeper;
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
});
