// The Watch hub (streams/watch-hub.ts) on the in-memory store, the real
// change feed and expiry tracker, and fake timers: snapshot first, then
// changes in grant order (its OrderGuard), a fresh snapshot instead of an
// unbounded buffer, and the re-check that catches what was never
// published. Over the wire: test/streams.test.ts; the guard's property
// test: test/change-order.test.ts.

import { randomUUID } from "node:crypto";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { DatabaseUnavailableError } from "../../src/lease/errors.js";
import { changeFromLease, type LeaseChange } from "../../src/lease/lease-change.js";
import type { LeaseRecord, Scope } from "../../src/lease/types.js";
import {
  createExpiryTracker,
  type ExpiryTracker,
} from "../../src/server/streams/expiry-tracker.js";
import {
  createWatchHub,
  OrderGuard,
  type WatchHub,
  type WatchMessage,
} from "../../src/server/streams/watch-hub.js";
import { freshKey } from "../support/leases.js";
import { type MemoryStreaming, memoryStreaming } from "../support/memory-streaming.js";

const recheckIntervalMs = 30_000;
const recheckGraceMs = 1_000;
const bufferLength = 4;
let mem: MemoryStreaming;
let tracker: ExpiryTracker;
let hub: WatchHub;

beforeEach(async () => {
  vi.useFakeTimers();
  mem = memoryStreaming();
  tracker = createExpiryTracker({ store: mem.store, feed: mem.feed, logger: mem.logger });
  await tracker.start();
  hub = createWatchHub({
    store: mem.store,
    feed: mem.feed,
    tracker,
    logger: mem.logger,
    bufferLength,
    recheckIntervalMs,
    recheckGraceMs,
  });
  hub.start();
});
afterEach(() => {
  hub.close(new Error("the test is over"));
  tracker.close();
  vi.useRealTimers();
});

/** Lets every change, timer due now and reading run. */
const settle = () => vi.advanceTimersByTimeAsync(0);

/**
 * A watcher piped into an outlet that collects its messages. `reading:
 * false` plays a client that stops reading: each write fills its buffer,
 * and `readMore` drains it once.
 */
function watch(scope: Scope, options: { includeRenewals?: boolean; reading?: boolean } = {}) {
  const watcher = hub.open(scope, { includeRenewals: options.includeRenewals ?? false });
  const messages: WatchMessage[] = [];
  let drain: (() => void) | undefined;
  const outcome: { ended?: { error: unknown } } = {};
  watcher.pipe({
    write: (batch) => {
      messages.push(...batch);
      return options.reading ?? true;
    },
    onDrain: (listener) => {
      drain = listener;
    },
    end: (error) => {
      outcome.ended = { error };
    },
  });
  const readMore = async () => {
    const d = drain;
    drain = undefined;
    d?.();
    await settle();
  };
  return { watcher, messages, readMore, outcome };
}

const shown = (messages: WatchMessage[]) =>
  messages.map((m) =>
    m.kind === "snapshot"
      ? `snapshot:${m.leases.map((l) => l.fencingToken).join(",")}`
      : `${m.change.type}:${m.change.fencingToken}`,
  );

describe("Watch hub", () => {
  it("L1: a watcher gets a snapshot of the valid leases in scope first, then every change to them", async () => {
    const accountId = `acct-${randomUUID()}`;
    const held = await mem.grant({ key: { accountId, sessionId: "a" } });
    const released = await mem.grant({ key: { accountId, sessionId: "b" } });
    await mem.store.release(released, released.runId);
    const { messages } = watch({ accountId, sessionId: "" });
    await settle();
    expect(shown(messages)).toEqual([`snapshot:${held.fencingToken}`]);

    const other = await mem.grant({ key: { accountId, sessionId: "c" } });
    await mem.grant({ key: { accountId: `elsewhere-${randomUUID()}`, sessionId: "c" } });
    await mem.store.release(held, held.runId);
    await settle();
    expect(shown(messages).slice(1)).toEqual([
      `acquired:${other.fencingToken}`,
      `released:${held.fencingToken}`,
    ]);
    expect(hub.stats.watchers).toBe(1);
  });

  it("S6: what is older than what the watcher was shown is dropped: changes about an earlier grant, repeats, anything about a grant after its end", async () => {
    const key = freshKey("order");
    const first = await mem.grant({ key, ttlMs: 1_000 });
    await mem.store.release(first, first.runId);
    const second = await mem.grant({ key });
    const { messages } = watch(key);
    await settle();
    expect(shown(messages)).toEqual([`snapshot:${second.fencingToken}`]);

    // Deliveries from other instances, late and twice.
    for (const [type, lease] of [
      ["acquired", first],
      ["released", first],
      ["acquired", second],
      ["expired", second],
      ["expired", second],
      ["released", second],
    ] as const) {
      mem.feed.deliverLocal(changeFromLease(type, lease));
      await settle();
    }
    expect(shown(messages).slice(1)).toEqual([`expired:${second.fencingToken}`]);
  });

  it("S6: the order guard shows one handoff request per audit row, only for the grant it asked", () => {
    const key = freshKey("guard");
    const lease = (token: bigint): LeaseRecord => ({
      ...key,
      runId: `run-${token}`,
      fencingToken: token,
      holder: "desktop",
      ttlMs: 1_000n,
      acquiredAtUs: 0n,
      expiresAtUs: 1_000_000n,
      remainingUs: 1_000_000n,
    });
    const handoff = (token: bigint, eventId: bigint): LeaseChange =>
      changeFromLease("handoff_requested", lease(token), { eventId, requesterHolder: "browser" });
    const guard = new OrderGuard();
    guard.seed([{ ...key, fencingToken: 7n, valid: true }]);
    expect(guard.accept(handoff(7n, 10n))).toBe(true);
    expect(guard.accept(handoff(7n, 10n))).toBe(false);
    expect(guard.accept(handoff(7n, 9n))).toBe(false);
    expect(guard.accept(handoff(7n, 11n))).toBe(true);
    expect(guard.accept(handoff(6n, 12n))).toBe(false);
    expect(guard.accept(changeFromLease("released", lease(7n)))).toBe(true);
    expect(guard.accept(handoff(7n, 13n))).toBe(false);
  });

  it("a consumer that falls behind gets, once its buffer is full, a fresh snapshot instead of the changes it missed", async () => {
    const accountId = `acct-${randomUUID()}`;
    const { messages, readMore } = watch({ accountId, sessionId: "" }, { reading: false });
    await settle();
    expect(shown(messages)).toEqual(["snapshot:"]);
    const leases: LeaseRecord[] = [];
    for (let i = 0; i <= bufferLength; i++) {
      leases.push(await mem.grant({ key: { accountId, sessionId: `s${i}` } }));
    }
    await settle();
    expect(hub.stats.overflows).toBe(1);
    expect(shown(messages)).toEqual(["snapshot:"]);
    await readMore();
    expect(shown(messages)).toEqual([
      "snapshot:",
      `snapshot:${leases.map((l) => l.fencingToken).join(",")}`,
    ]);
    // After the snapshot, changes flow again.
    await mem.store.release(leases[0] as LeaseRecord, leases[0]?.runId ?? "");
    await readMore();
    expect(shown(messages)[2]).toBe(`released:${leases[0]?.fencingToken}`);
  });

  it("renewals reach only watchers that asked for them", async () => {
    const key = freshKey("renewals");
    const lease = await mem.grant({ key });
    const plain = watch(key);
    const renewals = watch(key, { includeRenewals: true });
    await settle();
    await mem.store.renew(key, lease.runId, 30_000);
    await settle();
    expect(shown(plain.messages)).toEqual([`snapshot:${lease.fencingToken}`]);
    expect(shown(renewals.messages)).toEqual([
      `snapshot:${lease.fencingToken}`,
      `renewed:${lease.fencingToken}`,
    ]);
  });

  it("L1: the watcher learns of an expiry at the deadline, once the database confirms it", async () => {
    const key = freshKey("expiry");
    const lease = await mem.grant({ key, ttlMs: 5_000 });
    const { messages } = watch(key);
    await settle();
    await vi.advanceTimersByTimeAsync(4_999);
    expect(shown(messages)).toEqual([`snapshot:${lease.fencingToken}`]);
    await vi.advanceTimersByTimeAsync(10);
    expect(shown(messages)).toEqual([
      `snapshot:${lease.fencingToken}`,
      `expired:${lease.fencingToken}`,
    ]);
  });

  it("a change that was never published is caught by the periodic re-check: a fresh snapshot, after the grace period", async () => {
    const key = freshKey("recheck");
    const { messages } = watch(key);
    await settle();
    // Granted where no notification reaches this instance.
    const lost = await mem.raw.acquire({ ...key, runId: randomUUID(), ttlMs: 60_000, holder: "x" });
    if (!lost.acquired) throw new Error("the key must be free");
    await vi.advanceTimersByTimeAsync(recheckIntervalMs + recheckGraceMs - 1);
    expect(shown(messages)).toEqual(["snapshot:"]);
    await vi.advanceTimersByTimeAsync(1);
    expect(shown(messages)).toEqual(["snapshot:", `snapshot:${lost.lease.fencingToken}`]);
    expect(hub.stats.resnapshots).toBe(2);
  });

  it("the re-check reaches every watcher of a large account, in slices that let the event loop turn", async () => {
    // A hub that writes to every ready watcher in one turn: what spreads
    // the writes over turns here is the re-check's own slicing.
    const wide = createWatchHub({
      store: mem.store,
      feed: mem.feed,
      tracker,
      logger: mem.logger,
      bufferLength,
      recheckIntervalMs,
      recheckGraceMs,
      watchersPerTurn: Number.POSITIVE_INFINITY,
    });
    wide.start();
    try {
      const account = `acct-${randomUUID()}`;
      // Rows already there, and seen by every watcher's first snapshot.
      for (let i = 0; i < 4; i++) {
        await mem.raw.acquire({
          accountId: account,
          sessionId: `seen-${i}`,
          runId: randomUUID(),
          ttlMs: 600_000,
          holder: "x",
        });
      }
      // 3,000 watchers × 5 rows is more than one slice of the comparison.
      // Each notes the turn of the event loop in which it was written to.
      let turn = 0;
      const wroteAt: (number | undefined)[] = [];
      const last: (WatchMessage | undefined)[] = [];
      for (let i = 0; i < 3_000; i++) {
        wide.open({ accountId: account, sessionId: "" }, { includeRenewals: false }).pipe({
          write: (batch) => {
            wroteAt[i] = turn;
            last[i] = batch.at(-1);
            return true;
          },
          onDrain: () => {},
          end: () => {},
        });
      }
      const written = () => wroteAt.filter((t) => t !== undefined).length;
      await settle();
      expect(written()).toBe(3_000);
      wroteAt.length = 0;
      const lost = await mem.raw.acquire({
        accountId: account,
        sessionId: "missed",
        runId: randomUUID(),
        ttlMs: 600_000,
        holder: "x",
      });
      if (!lost.acquired) throw new Error("the key must be free");
      await vi.advanceTimersByTimeAsync(recheckIntervalMs + recheckGraceMs - 1);
      const nextTurn = () => {
        turn++;
        if (written() < 3_000) setImmediate(nextTurn);
      };
      setImmediate(nextTurn);
      await vi.advanceTimersByTimeAsync(1);
      await vi.waitFor(() => expect(written()).toBe(3_000));
      // The last watcher was written to turns after the first.
      const turns = wroteAt as number[];
      expect(Math.max(...turns)).toBeGreaterThan(Math.min(...turns));
      // And each was sent a fresh snapshot with the grant it missed.
      for (const m of last) {
        expect(m?.kind === "snapshot" && m.leases.map((l) => l.sessionId)).toContain("missed");
      }
    } finally {
      wide.close(new Error("the test is over"));
    }
  });

  it("closing a watcher (its call ended) tells its outlet nothing, stops its messages and gives back what it held", async () => {
    const key = freshKey("close");
    const { watcher, messages, outcome } = watch(key, { includeRenewals: true });
    await settle();
    expect(shown(messages)).toEqual(["snapshot:"]);
    expect(mem.feed.renewalsWanted(key)).toBe(true);
    watcher.close();
    await mem.grant({ key });
    await settle();
    expect(shown(messages)).toEqual(["snapshot:"]);
    expect(outcome.ended).toBeUndefined();
    expect(hub.stats.watchers).toBe(0);
    expect(mem.feed.renewalsWanted(key)).toBe(false);
  });

  it("the hub's close ends every watcher with its reason, one not yet piped as soon as it is", async () => {
    const key = freshKey("hub-close");
    const { outcome } = watch(key);
    await settle();
    const unpiped = hub.open(key, { includeRenewals: false });
    const reason = new Error("the server is shutting down");
    hub.close(reason);
    expect(outcome.ended?.error).toBe(reason);
    expect(hub.stats.watchers).toBe(0);
    let late: unknown;
    unpiped.pipe({
      write: () => true,
      onDrain: () => {},
      end: (error) => {
        late = error;
      },
    });
    expect(late).toBe(reason);
  });

  it("a snapshot that cannot be read ends the watcher with the database's error", async () => {
    const down = new DatabaseUnavailableError("the database is restarting");
    const broken = createWatchHub({
      store: {
        ...mem.store,
        readScopes: async () => {
          throw down;
        },
      },
      feed: mem.feed,
      tracker,
      logger: mem.logger,
      bufferLength,
      recheckIntervalMs,
    });
    let ended: { error: unknown } | undefined;
    broken.open(freshKey("broken"), { includeRenewals: false }).pipe({
      write: () => true,
      onDrain: () => {},
      end: (error) => {
        ended = { error };
      },
    });
    await settle();
    expect(ended?.error).toBe(down);
    expect(broken.stats.watchers).toBe(0);
    broken.close(new Error("the test is over"));
  });
});
