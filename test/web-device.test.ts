// The page's device logic (web/src/device.ts) run in Node against a real
// server: connect-web's transport runs on Node's fetch, so this is the code
// the browser runs, with the same wire protocol.

import { describe, expect, it } from "vitest";
import type { Lease } from "../src/gen/leasehold/v1/lease_pb.js";
import { createLeaseClient } from "../web/src/api.js";
import { Device, type DeviceState } from "../web/src/device.js";
import { timestampDate } from "../web/src/durations.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { connectClient } from "./support/server.js";

const { db, server, connect, startServer } = useTestServer();

/** A device whose state changes can be awaited. */
function makeDevice(baseUrl: string) {
  const waiters = new Set<() => void>();
  const seen: Lease[] = [];
  const released: string[] = [];
  const device = new Device(
    createLeaseClient(baseUrl, () => ""),
    {
      onLease: (lease) => seen.push(lease),
      onReleased: (_key, runId) => released.push(runId),
      onChange: () => {
        for (const wake of waiters) wake();
      },
    },
  );
  const until = (predicate: (state: DeviceState) => boolean): Promise<DeviceState> =>
    new Promise((resolve) => {
      const check = () => {
        if (!predicate(device.state)) return;
        waiters.delete(check);
        resolve(device.state);
      };
      waiters.add(check);
      check();
    });
  return { device, seen, released, until };
}

async function validLease(key: { accountId: string; sessionId: string }) {
  const [row] = await db.sql<{ runId: string; valid: boolean }[]>`
    SELECT run_id, expires_at > clock_timestamp() AS valid
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  return row;
}

describe("the page as a device", () => {
  it("S3: starting on a session held elsewhere is refused and names the holder", async () => {
    const key = freshKey();
    const api = connectClient(server.url);
    const held = await api.acquire({ key, ttl: { seconds: 30n }, holder: "desktop" });
    const { device, seen } = makeDevice(server.url);
    await device.start({ key, holder: "browser", ttlMs: 5000 });
    expect(device.state.kind).toBe("idle");
    expect(device.note).toBe("Not started: the session is running on desktop.");
    expect(seen.map((l) => l.runId)).toEqual([held.lease?.runId]);
  });

  it("S5: stop releases the run's own lease", async () => {
    const key = freshKey();
    const { device, released } = makeDevice(server.url);
    await device.start({ key, holder: "browser", ttlMs: 5000 });
    const state = device.state;
    if (state.kind !== "running") throw new Error(`not running: ${device.note}`);
    expect((await validLease(key))?.runId).toBe(state.runId);
    await device.stop();
    expect(device.state.kind).toBe("idle");
    expect(device.note).toBe("Stopped and released.");
    expect(released).toEqual([state.runId]);
    expect((await validLease(key))?.valid).toBe(false);
  });

  it("S6: renewals about every TTL/3 keep the lease, and its token, past its first deadline", async () => {
    const key = freshKey();
    const { device } = makeDevice(server.url);
    await device.start({ key, holder: "browser", ttlMs: 1500 });
    const first = device.state;
    if (first.kind !== "running") throw new Error(`not running: ${device.note}`);
    const firstDeadline = timestampDate(first.lease.expiresAt);
    // Wait on the database clock until the first grant's deadline has passed.
    await db.sql`SELECT pg_sleep_until(${firstDeadline ?? new Date()}::timestamptz + interval '100 milliseconds')`;
    const row = await validLease(key);
    expect(row).toEqual({ runId: first.runId, valid: true });
    const now = device.state;
    expect(now.kind).toBe("running");
    if (now.kind === "running") expect(now.lease.fencingToken).toBe(first.lease.fencingToken);
    await device.stop();
  });

  it("L2: a renewal answered LEASE_NOT_HELD ends the run and says why", async () => {
    const key = freshKey();
    const { device, until } = makeDevice(server.url);
    await device.start({ key, holder: "browser", ttlMs: 3000 });
    const state = device.state;
    if (state.kind !== "running") throw new Error(`not running: ${device.note}`);
    // Another client ends the run (release is owner-checked by run id).
    await connect.release({ key, runId: state.runId });
    await until((s) => s.kind === "idle");
    expect(device.note).toBe("Lease lost: released.");
    expect(state.signal.aborted).toBe(true);
  });

  it("L2: with the server gone, the device stops presenting itself as the holder before the database expires its lease", async () => {
    // A server of its own, so that closing it leaves the other tests alone.
    const own = await startServer();
    const key = freshKey();
    const { device, until } = makeDevice(own.url);
    await device.start({ key, holder: "browser", ttlMs: 5000 });
    const state = device.state;
    if (state.kind !== "running") throw new Error(`not running: ${device.note}`);
    await own.close();
    await until((s) => s.kind === "idle");
    // The local deadline is counted from when each request was sent, minus
    // a margin: it passes while the database still holds the lease.
    const row = await validLease(key);
    expect(row?.runId).toBe(state.runId);
    expect(row?.valid).toBe(true);
    expect(device.note).toBe("Lease lost: no renewal was confirmed before the local deadline.");
    expect(state.signal.aborted).toBe(true);
  });
});
