// The expiry tracker (streams/expiry-tracker.ts) on the in-memory store and
// fake timers: a timer at each tracked deadline, and an end reported only
// once a reading of the database confirms it (S9). Over the wire and across
// instances it is tested in test/streams.test.ts and test/multi-instance.test.ts.

import { randomUUID } from "node:crypto";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { DatabaseUnavailableError } from "../../src/lease/errors.js";
import type { LeaseChange } from "../../src/lease/lease-change.js";
import type { LeaseStore, Scope, SessionKey } from "../../src/lease/types.js";
import {
  createExpiryTracker,
  type ExpiryTracker,
} from "../../src/server/streams/expiry-tracker.js";
import { type MemoryStreaming, memoryStreaming } from "../support/memory-streaming.js";

// The tracker reads a little after each deadline (its margin), never before,
// from a setImmediate that the fake clock runs one fake millisecond after
// the timer that scheduled it.
const marginMs = 2;
const readAfterMs = marginMs + 1;
let mem: MemoryStreaming;
let tracker: ExpiryTracker;
/** Scopes of every reading the tracker made (its start-up reading excluded). */
let readings: Scope[][];

async function startTracker(store?: LeaseStore) {
  let started = false;
  const base = store ?? mem.store;
  tracker = createExpiryTracker({
    store: {
      ...base,
      readScopes: (scopes, options) => {
        if (started) readings.push(scopes.map(scopeOf));
        return base.readScopes(scopes, options);
      },
    },
    feed: mem.feed,
    logger: mem.logger,
    marginMs,
  });
  await tracker.start();
  started = true;
}

/** Ends of leases on the change feed: the store's own, and those the tracker found. */
const ends = () => mem.changes.filter((c) => c.type !== "acquired" && c.type !== "renewed");

const scopeOf = (key: SessionKey): Scope => ({
  accountId: key.accountId,
  sessionId: key.sessionId,
});

beforeEach(() => {
  vi.useFakeTimers();
  mem = memoryStreaming();
  readings = [];
});
afterEach(() => {
  tracker?.close();
  vi.useRealTimers();
});

describe("expiry tracker", () => {
  it("S9, L1: a held key's expiry is reported only after its deadline, once a reading of the database confirms it", async () => {
    await startTracker();
    const lease = await mem.grant({ ttlMs: 1_000 });
    tracker.hold(scopeOf(lease));
    tracker.learn(lease);
    await vi.advanceTimersByTimeAsync(1_000);
    expect(readings).toEqual([]);
    expect(ends()).toEqual([]);
    await vi.advanceTimersByTimeAsync(readAfterMs);
    expect(readings).toEqual([[scopeOf(lease)]]);
    expect(ends()).toEqual([
      expect.objectContaining<Partial<LeaseChange>>({
        type: "expired",
        runId: lease.runId,
        fencingToken: lease.fencingToken,
        atUs: lease.expiresAtUs,
      }),
    ]);
  });

  it("S9: the timer only says when to look: a lease renewed unseen is not reported, and is followed to its new deadline", async () => {
    await startTracker();
    const lease = await mem.grant({ ttlMs: 1_000 });
    tracker.hold(scopeOf(lease));
    tracker.learn(lease);
    // Renewed where this instance does not hear of it.
    await mem.raw.renew(lease, lease.runId, 5_000);
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(readings).toHaveLength(1);
    expect(ends()).toEqual([]);
    await vi.advanceTimersByTimeAsync(4_000);
    expect(readings).toHaveLength(2);
    expect(ends().map((c) => c.type)).toEqual(["expired"]);
  });

  it("a release whose notification was lost is reported at the deadline, with its audit row", async () => {
    await startTracker();
    const lease = await mem.grant({ ttlMs: 1_000 });
    tracker.hold(scopeOf(lease));
    tracker.learn(lease);
    const released = await mem.raw.release(lease, lease.runId);
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(ends()).toEqual([
      expect.objectContaining<Partial<LeaseChange>>({
        type: "released",
        runId: lease.runId,
        eventId: released?.eventId,
      }),
    ]);
  });

  it("a key taken over by a grant this instance missed is stale: listeners re-read it, and the new grant is tracked", async () => {
    await startTracker();
    const stale: SessionKey[] = [];
    tracker.onStale((key) => stale.push(key));
    const lease = await mem.grant({ ttlMs: 1_000 });
    tracker.hold(scopeOf(lease));
    tracker.learn(lease);
    await mem.raw.release(lease, lease.runId);
    const next = await mem.raw.acquire({ ...lease, runId: randomUUID(), ttlMs: 3_000 });
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(stale.map(scopeOf)).toEqual([scopeOf(lease)]);
    expect(ends()).toEqual([]);
    await vi.advanceTimersByTimeAsync(3_000);
    expect(ends()).toEqual([
      expect.objectContaining({ type: "expired", runId: next.acquired && next.lease.runId }),
    ]);
  });

  it("grants and ends on the change feed arm and disarm the timer of a held key", async () => {
    await startTracker();
    const key = { accountId: "acct-feed", sessionId: "s" };
    tracker.hold({ accountId: key.accountId, sessionId: "" });
    const lease = await mem.grant({ key, ttlMs: 1_000 });
    await mem.store.release(lease, lease.runId);
    await vi.advanceTimersByTimeAsync(2_000);
    expect(readings).toEqual([]);

    const again = await mem.grant({ key, ttlMs: 1_000 });
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(readings).toEqual([[key]]);
    expect(ends().map((c) => [c.type, c.runId])).toEqual([
      ["released", lease.runId],
      ["expired", again.runId],
    ]);
  });

  it("a key nobody holds is not tracked, and releasing the last hold stops tracking", async () => {
    await startTracker();
    const untracked = await mem.grant({ ttlMs: 1_000 });
    tracker.learn(untracked);
    const dropped = await mem.grant({ ttlMs: 1_000 });
    const release = tracker.hold(scopeOf(dropped));
    const second = tracker.hold(scopeOf(dropped));
    tracker.learn(dropped);
    release();
    release();
    second();
    await vi.advanceTimersByTimeAsync(5_000);
    expect(readings).toEqual([]);
    expect(ends()).toEqual([]);
  });

  it("deadlines that fall due together are confirmed in one reading", async () => {
    await startTracker();
    const leases = [await mem.grant({ ttlMs: 1_000 }), await mem.grant({ ttlMs: 1_000 })];
    for (const lease of leases) {
      tracker.hold(scopeOf(lease));
      tracker.learn(lease);
    }
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(readings).toHaveLength(1);
    expect(readings[0]).toHaveLength(2);
    expect(ends().map((c) => c.runId)).toEqual(leases.map((l) => l.runId));
  });

  it("a reading that fails is tried again a second later", async () => {
    let failures = 1;
    await startTracker({
      ...mem.store,
      readScopes: async (scopes) => {
        if (scopes.length > 0 && failures-- > 0) throw new DatabaseUnavailableError("restarting");
        return mem.store.readScopes(scopes);
      },
    });
    const lease = await mem.grant({ ttlMs: 1_000 });
    tracker.hold(scopeOf(lease));
    tracker.learn(lease);
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(ends()).toEqual([]);
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(readings).toHaveLength(2);
    expect(ends().map((c) => c.type)).toEqual(["expired"]);
  });

  it("S9, S8: a row being written at its deadline is judged again later, sooner first, then less often", async () => {
    let writtenReadings = 3;
    await startTracker({
      ...mem.store,
      readScopes: async (scopes, options) => {
        const reading = await mem.store.readScopes(scopes, options);
        if (!options?.skipWritten || scopes.length === 0 || writtenReadings <= 0) return reading;
        writtenReadings -= 1;
        // A transaction holds the row: the reading leaves it out and names it.
        return { ...reading, rows: [], written: scopes.map(scopeOf) };
      },
    });
    const lease = await mem.grant({ ttlMs: 1_000 });
    tracker.hold(scopeOf(lease));
    tracker.learn(lease);
    await vi.advanceTimersByTimeAsync(1_000 + readAfterMs);
    expect(readings).toHaveLength(1);
    // Again after 20 ms, then 40, then 80 (each plus the margin): nothing
    // is reported while the row is being written.
    for (const [gapMs, count] of [
      [20, 2],
      [40, 3],
    ] as const) {
      await vi.advanceTimersByTimeAsync(gapMs + marginMs - 1);
      expect(readings).toHaveLength(count - 1);
      await vi.advanceTimersByTimeAsync(readAfterMs);
      expect(readings).toHaveLength(count);
      expect(ends()).toEqual([]);
    }
    await vi.advanceTimersByTimeAsync(80 + readAfterMs);
    expect(readings).toHaveLength(4);
    // The writer is gone: the fourth reading judges the row.
    expect(ends().map((c) => c.type)).toEqual(["expired"]);
  });

  it("S9: deadlines are kept on the database clock, however far this process's clock is from it", async () => {
    mem = memoryStreaming({ skewMs: 3_600_000 });
    await startTracker();
    expect(tracker.databaseNowUs()).toBe(mem.raw.clock.nowUs());
    const key = { accountId: "acct-skew", sessionId: "s" };
    tracker.hold(key);
    // Armed from the grant's deadline, a database time.
    await mem.grant({ key, ttlMs: 1_000 });
    await vi.advanceTimersByTimeAsync(1_000 - 1);
    expect(readings).toEqual([]);
    await vi.advanceTimersByTimeAsync(1 + readAfterMs);
    expect(ends().map((c) => c.type)).toEqual(["expired"]);
  });
});
