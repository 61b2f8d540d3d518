// Waiting Acquire (streams/waiters.ts) on the in-memory store, the real
// change feed and expiry tracker, and fake timers: when a waiter tries
// again, who wins, and what happens to a grant nobody waits for any more.
// Over the wire and across instances: test/streams.test.ts and
// test/multi-instance.test.ts.

import { randomUUID } from "node:crypto";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { DatabaseUnavailableError } from "../../src/lease/errors.js";
import type { AcquireInput, AcquireResult, LeaseStore } from "../../src/lease/types.js";
import {
  createExpiryTracker,
  type ExpiryTracker,
} from "../../src/server/streams/expiry-tracker.js";
import { createWaiters, type Waiters } from "../../src/server/streams/waiters.js";
import { freshKey } from "../support/leases.js";
import {
  type MemoryStreaming,
  memoryStreaming,
  type Observed,
  observe,
} from "../support/memory-streaming.js";

const recheckIntervalMs = 30_000;
let mem: MemoryStreaming;
let tracker: ExpiryTracker;
let waiters: Waiters;
/** Acquire statements the waiters sent, by run. */
let attempts: string[];
/** How many of the next acquire statements fail as a database that cannot decide. */
let failing: number;
/** Runs before a release the waiters send reaches the store. */
let beforeRelease: (() => Promise<void>) | undefined;

async function start() {
  const store: LeaseStore = {
    ...mem.store,
    acquire: async (input) => {
      attempts.push(input.runId);
      if (failing > 0) {
        failing -= 1;
        throw new DatabaseUnavailableError("the database is restarting");
      }
      return mem.store.acquire(input);
    },
    release: async (key, runId, grant) => {
      await beforeRelease?.();
      return mem.store.release(key, runId, grant);
    },
  };
  tracker = createExpiryTracker({ store, feed: mem.feed, logger: mem.logger });
  await tracker.start();
  waiters = createWaiters({
    store,
    feed: mem.feed,
    tracker,
    logger: mem.logger,
    recheckIntervalMs,
  });
  waiters.start();
}

const input = (key: { accountId: string; sessionId: string }, holder = "waiter"): AcquireInput => ({
  ...key,
  runId: randomUUID(),
  ttlMs: 60_000,
  holder,
});

/** A waiting acquire whose outcome the test can read at any moment. */
function wait(
  request: AcquireInput,
  waitMs = 120_000,
  signal = new AbortController().signal,
): Observed<AcquireResult> {
  return observe(waiters.acquire(request, waitMs, signal));
}

/** Lets every change, timer due now and answer run. */
const settle = () => vi.advanceTimersByTimeAsync(0);

beforeEach(async () => {
  vi.useFakeTimers();
  mem = memoryStreaming();
  attempts = [];
  failing = 0;
  beforeRelease = undefined;
  await start();
});
afterEach(() => {
  waiters.close();
  tracker.close();
  vi.useRealTimers();
});

describe("waiting acquire", () => {
  it("S2: a free session is granted at once, without waiting", async () => {
    const result = await waiters.acquire(
      input(freshKey("w")),
      60_000,
      new AbortController().signal,
    );
    expect(result.acquired).toBe(true);
    expect(waiters.stats.waiting).toBe(0);
  });

  it("S3: a waiter is granted only once the holder releases, with a newer token", async () => {
    const holder = await mem.grant();
    const waiter = wait(input(holder));
    await vi.advanceTimersByTimeAsync(10_000);
    expect(waiter.settled).toBe(false);
    expect(waiters.stats.waiting).toBe(1);
    await mem.store.release(holder, holder.runId);
    await settle();
    expect(waiter.value?.acquired && waiter.value.lease.fencingToken).toBeGreaterThan(
      holder.fencingToken,
    );
    expect(waiters.stats).toMatchObject({ waiting: 0, granted: 1 });
  });

  it("L1, S9: a waiter is granted when the blocking lease's deadline passes, confirmed by a reading, with no attempts before it", async () => {
    const holder = await mem.grant({ ttlMs: 5_000 });
    const waiter = wait(input(holder));
    await settle();
    const before = attempts.length;
    await vi.advanceTimersByTimeAsync(4_999);
    expect(attempts).toHaveLength(before);
    expect(waiter.settled).toBe(false);
    await vi.advanceTimersByTimeAsync(10);
    expect(waiter.value?.acquired).toBe(true);
    // The takeover names the lease that expired.
    expect(waiter.value?.acquired && waiter.value.expired?.runId).toBe(holder.runId);
  });

  it("S1, S2: waiters of one key are served in arrival order, exactly one per release", async () => {
    let holder = await mem.grant();
    const queue = ["first", "second", "third"].map((name) => {
      const request = input(holder, name);
      return { request, answer: wait(request) };
    });
    await settle();
    for (const [i, { request, answer }] of queue.entries()) {
      await mem.store.release(holder, holder.runId);
      await settle();
      expect(answer.value?.acquired && answer.value.lease.runId).toBe(request.runId);
      expect(queue.filter((q) => q.answer.settled)).toHaveLength(i + 1);
      if (!answer.value?.acquired) throw new Error("not granted");
      holder = answer.value.lease;
    }
  });

  it("when the wait runs out, one last attempt answers not acquired and names the current holder", async () => {
    const holder = await mem.grant({ holder: "desktop" });
    const waiter = wait(input(holder), 2_000);
    await vi.advanceTimersByTimeAsync(1_999);
    expect(waiter.settled).toBe(false);
    await vi.advanceTimersByTimeAsync(1);
    expect(waiter.value).toMatchObject({
      acquired: false,
      current: { runId: holder.runId, holder: "desktop" },
    });
    expect(waiters.stats.waiting).toBe(0);
  });

  it("S3: a cancelled waiter rejects with its signal's reason and is never granted later", async () => {
    const holder = await mem.grant();
    const controller = new AbortController();
    const cancelled = input(holder, "cancelled");
    const waiter = wait(cancelled, 120_000, controller.signal);
    const next = input(holder, "next");
    const nextWaiter = wait(next);
    await settle();
    controller.abort(new Error("the caller went away"));
    await settle();
    expect(String(waiter.error)).toMatch(/the caller went away/);
    const tried = attempts.length;
    await mem.store.release(holder, holder.runId);
    await settle();
    expect(nextWaiter.value?.acquired).toBe(true);
    expect(attempts.slice(tried)).not.toContain(cancelled.runId);
    expect((await mem.store.get(holder))?.runId).toBe(next.runId);
  });

  it("S5: a grant made for a waiter that gave up meanwhile is released at once, on its run's behalf", async () => {
    const holder = await mem.grant({ ttlMs: 5_000 });
    const controller = new AbortController();
    const gone = input(holder, "gone");
    const waiter = wait(gone, 120_000, controller.signal);
    await settle();
    // The waiter's attempt, made at the deadline, waits on a row lock; the
    // caller gives up while it does.
    const unlock = mem.raw.lockRow(holder);
    await vi.advanceTimersByTimeAsync(5_010);
    expect(attempts.filter((runId) => runId === gone.runId)).toHaveLength(2);
    controller.abort(new Error("gone"));
    await settle();
    // Answered once its attempt is decided, after the grant is ended: a
    // caller that follows the give-up with a release finds nothing left.
    expect(waiter.settled).toBe(false);
    unlock();
    await settle();
    expect(String(waiter.error)).toMatch(/gone/);
    const trail = mem.raw.events.filter((e) => e.runId === gone.runId).map((e) => e.type);
    expect(trail).toEqual(["acquired", "released"]);
    expect(await mem.store.get(holder)).toBeUndefined();
  });

  it("L2, S5: the clean-up release of a grant nobody waited for leaves the lease once the same run re-acquired it elsewhere", async () => {
    const holder = await mem.grant({ ttlMs: 5_000 });
    const controller = new AbortController();
    const moved = input(holder, "moved");
    const waiter = wait(moved, 120_000, controller.signal);
    await settle();
    // The waiter's attempt at the deadline waits on a row lock; the caller's
    // connection drops meanwhile, and its client resends the Acquire, same
    // run_id, to another instance.
    const unlock = mem.raw.lockRow(holder);
    await vi.advanceTimersByTimeAsync(5_010);
    controller.abort(new Error("the connection dropped"));
    await settle();
    expect(waiter.settled).toBe(false);
    // Between this instance's grant and its clean-up release, the other
    // instance answers the resent Acquire: the same grant, a later deadline,
    // which the client now uses.
    let resent: AcquireResult | undefined;
    beforeRelease = async () => {
      beforeRelease = undefined;
      vi.advanceTimersByTime(5);
      resent = await mem.store.acquire(moved);
    };
    unlock();
    await settle();
    expect(String(waiter.error)).toMatch(/the connection dropped/);
    expect(resent).toMatchObject({ acquired: true, retried: true });
    // The clean-up release matched nothing: the lease the client holds stands.
    expect((await mem.store.get(holder))?.runId).toBe(moved.runId);
    const trail = mem.raw.events.filter((e) => e.runId === moved.runId).map((e) => e.type);
    expect(trail).toEqual(["acquired"]);
  });

  it("S5: when the wait runs out while an attempt is deciding, that attempt's grant is the answer; nothing is granted and then released", async () => {
    const holder = await mem.grant({ ttlMs: 5_000 });
    const late = input(holder, "late");
    const waiter = wait(late, 5_005);
    await settle();
    // The waiter's attempt at the deadline waits on a row lock; the wait
    // runs out meanwhile.
    const unlock = mem.raw.lockRow(holder);
    await vi.advanceTimersByTimeAsync(5_010);
    expect(waiter.settled).toBe(false);
    unlock();
    await settle();
    expect(waiter.value?.acquired && waiter.value.lease.runId).toBe(late.runId);
    // One attempt at first, one at the deadline: no second "last" attempt.
    expect(attempts.filter((runId) => runId === late.runId)).toHaveLength(2);
    const trail = mem.raw.events.filter((e) => e.runId === late.runId).map((e) => e.type);
    expect(trail).toEqual(["acquired"]);
  });

  it("a release this instance never heard of is found by the periodic re-check, and not before it", async () => {
    const holder = await mem.grant();
    const waiter = wait(input(holder));
    await settle();
    // Released where no notification reaches this instance.
    await mem.raw.release(holder, holder.runId);
    await vi.advanceTimersByTimeAsync(recheckIntervalMs - 1);
    expect(waiter.settled).toBe(false);
    await vi.advanceTimersByTimeAsync(1);
    expect(waiter.value?.acquired).toBe(true);
  });

  it("an attempt the database could not decide is made again on the next trigger", async () => {
    const holder = await mem.grant();
    const waiter = wait(input(holder));
    await settle();
    failing = 1;
    await mem.store.release(holder, holder.runId);
    await settle();
    expect(failing).toBe(0);
    expect(waiter.settled).toBe(false);
    await vi.advanceTimersByTimeAsync(recheckIntervalMs);
    expect(waiter.value?.acquired).toBe(true);
  });
});
