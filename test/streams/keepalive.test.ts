// The KeepAlive hub (streams/keepalive.ts) over the real renewal batcher
// and change feed, on the in-memory store and fake timers: what one stream
// answers, what it learns from the feed, and how it bounds what a client
// that stops reading can cost. test/streams.test.ts runs it over the wire.

import { randomUUID } from "node:crypto";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { DatabaseUnavailableError, ResourceExhaustedError } from "../../src/lease/errors.js";
import { changeFromLease } from "../../src/lease/lease-change.js";
import type { LeaseRecord, LeaseStore } from "../../src/lease/types.js";
import {
  createKeepAliveHub,
  type KeepAliveAnswer,
  type KeepAliveHub,
  type KeepAliveSession,
} from "../../src/server/streams/keepalive.js";
import { createRenewalBatcher } from "../../src/server/streams/renewal-batcher.js";
import { type MemoryStreaming, memoryStreaming } from "../support/memory-streaming.js";

const tickMs = 20;
let mem: MemoryStreaming;
let hub: KeepAliveHub;
/** Items the store was asked to renew, over all statements. */
let renewedRuns: string[];

function startHub(
  options: { maxLeasesPerStream?: number; maxPendingAnswers?: number; store?: LeaseStore } = {},
) {
  const store: LeaseStore = options.store ?? {
    ...mem.store,
    renewMany: (items, o) => {
      renewedRuns.push(...items.map((i) => i.runId));
      return mem.store.renewMany(items, o);
    },
  };
  hub = createKeepAliveHub({
    batcher: createRenewalBatcher({ store, tickMs }),
    feed: mem.feed,
    maxLeasesPerStream: options.maxLeasesPerStream ?? 100,
    maxPendingAnswers: options.maxPendingAnswers ?? 100,
  });
  hub.start();
  return hub;
}

/**
 * A session piped into an outlet that collects its answers, and how it
 * ended. `reading: false` plays a client that stops reading: each write
 * fills its buffer, and `readMore` drains it once.
 */
function openSession(options: { reading?: boolean } = {}) {
  const session = hub.open();
  const answers: KeepAliveAnswer[] = [];
  let drain: (() => void) | undefined;
  let ended: (outcome: { ended: true; error: unknown }) => void = () => {};
  const outcome = new Promise<{ ended: true; error: unknown }>((resolve) => {
    ended = resolve;
  });
  session.pipe({
    write: (batch) => {
      answers.push(...batch);
      return options.reading ?? true;
    },
    onDrain: (listener) => {
      drain = listener;
    },
    end: (error) => ended({ ended: true, error }),
  });
  const readMore = () => {
    const d = drain;
    drain = undefined;
    d?.();
  };
  return { session, answers, outcome, readMore };
}

const request = (lease: LeaseRecord, ttlMs?: number) => ({
  key: { accountId: lease.accountId, sessionId: lease.sessionId },
  runId: lease.runId,
  ttlMs,
});

/** Submits and lets the batch tick pass. */
async function renew(session: KeepAliveSession, lease: LeaseRecord, ttlMs?: number) {
  session.submit(request(lease, ttlMs));
  await vi.advanceTimersByTimeAsync(tickMs);
}

/** Lets the session's reader take what was queued. */
const delivered = () => vi.advanceTimersByTimeAsync(0);

const kinds = (answers: KeepAliveAnswer[]) =>
  answers.map((a) => (a.kind === "lost" ? `lost:${a.cause}` : a.kind));

beforeEach(() => {
  vi.useFakeTimers();
  mem = memoryStreaming();
  renewedRuns = [];
});
afterEach(() => {
  hub?.close(new Error("the test is over"));
  vi.useRealTimers();
});

describe("KeepAlive hub", () => {
  it("S4, S6: a renewal is answered with the renewed lease, same token, the requested TTL", async () => {
    startHub();
    const { session, answers } = openSession();
    const lease = await mem.grant({ ttlMs: 5_000 });
    await renew(session, lease, 9_000);
    expect(answers).toHaveLength(1);
    const [answer] = answers;
    expect(answer?.kind === "lease" && answer.lease).toMatchObject({
      runId: lease.runId,
      fencingToken: lease.fencingToken,
      ttlMs: 9_000n,
    });
    expect(hub.stats.streams).toBe(1);
  });

  it("S4: a renewal of a run answered lost is never sent to the store again", async () => {
    startHub();
    const { session, answers } = openSession();
    const lease = await mem.grant({ ttlMs: 100 });
    await vi.advanceTimersByTimeAsync(100);
    await renew(session, lease);
    await renew(session, lease);
    await renew(session, lease);
    expect(kinds(answers)).toEqual(["lost:expired", "lost:expired", "lost:expired"]);
    expect(renewedRuns).toEqual([lease.runId]);
  });

  it("S4: a run released, revoked, expired or taken over is answered lost as soon as the change feed says so, and never renewed again", async () => {
    startHub();
    const { session, answers } = openSession();
    const released = await mem.grant();
    const revoked = await mem.grant();
    const expired = await mem.grant({ ttlMs: 500 });
    const taken = await mem.grant({ ttlMs: 500 });
    const leases = [released, revoked, expired, taken];
    for (const lease of leases) await renew(session, lease);
    expect(kinds(answers)).toEqual(["lease", "lease", "lease", "lease"]);

    await mem.store.release(released, released.runId);
    await mem.store.revoke(revoked, "maintenance");
    await vi.advanceTimersByTimeAsync(600);
    // A takeover through this instance reports the expiry first.
    await mem.grant({ key: expired });
    // Another instance's grant whose expiry notice never arrived.
    const next = await mem.raw.acquire({ ...taken, runId: randomUUID(), ttlMs: 60_000 });
    if (!next.acquired) throw new Error("the expired lease must be free to take");
    mem.feed.deliverLocal(changeFromLease("acquired", next.lease, { eventId: next.eventId }));
    await delivered();
    const lost = ["lost:released", "lost:revoked", "lost:expired", "lost:taken_over"];
    expect(kinds(answers.slice(4))).toEqual(lost);

    const asked = renewedRuns.length;
    for (const lease of leases) await renew(session, lease);
    expect(kinds(answers.slice(8))).toEqual(lost);
    expect(renewedRuns).toHaveLength(asked);
  });

  it("S4: after `lost`, a renewal of that run already in flight is answered lost too, even when the store renewed it", async () => {
    startHub();
    const { session, answers } = openSession();
    const lease = await mem.grant();
    await renew(session, lease);
    session.submit(request(lease));
    // Another instance released it; this store has not seen it yet.
    mem.feed.deliverLocal(changeFromLease("released", lease));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(renewedRuns).toEqual([lease.runId, lease.runId]);
    expect(kinds(answers)).toEqual(["lease", "lost:released", "lost:released"]);
  });

  it("a handoff requested before the stream first renews the run comes with that renewal; a later one arrives as it is asked", async () => {
    startHub();
    const { session, answers } = openSession();
    const lease = await mem.grant();
    await mem.store.requestHandoff(lease, "browser", "continue on this device");
    await renew(session, lease);
    expect(answers.map((a) => a.kind)).toEqual(["lease", "handoff"]);
    expect(answers[1]).toMatchObject({
      runId: lease.runId,
      requesterHolder: "browser",
      reason: "continue on this device",
    });

    await renew(session, lease);
    expect(answers.map((a) => a.kind)).toEqual(["lease", "handoff", "lease"]);
    await mem.store.requestHandoff(lease, "phone", "over here");
    await delivered();
    expect(answers.at(-1)).toMatchObject({ kind: "handoff", requesterHolder: "phone" });
  });

  it("another run's handoff request is not delivered to this run", async () => {
    startHub();
    const { session, answers } = openSession();
    const mine = await mem.grant({ ttlMs: 500 });
    await renew(session, mine);
    await vi.advanceTimersByTimeAsync(600);
    const next = await mem.grant({ key: mine });
    await mem.store.requestHandoff(next, "browser", "for the new run");
    await delivered();
    expect(kinds(answers)).toEqual(["lease", "lost:expired"]);
  });

  it("bounded backlog: a client that stops reading is cut off with RESOURCE_EXHAUSTED, told when it reads again", async () => {
    startHub({ maxPendingAnswers: 3 });
    const { session, answers, outcome, readMore } = openSession({ reading: false });
    const leases = [];
    for (let i = 0; i < 5; i++) leases.push(await mem.grant());
    for (const lease of leases) await renew(session, lease);
    expect(hub.stats.overflows).toBe(1);
    // The first answer was written before the client stopped reading.
    expect(kinds(answers)).toEqual(["lease"]);
    const ended = await Promise.race([outcome, Promise.resolve("not yet")]);
    expect(ended).toBe("not yet");
    readMore();
    const { error } = await outcome;
    expect(error).toBeInstanceOf(ResourceExhaustedError);
    expect(String(error)).toMatch(/3 answers its client has not read/);
    // What was queued was dropped, not written.
    expect(kinds(answers)).toEqual(["lease"]);
    expect(hub.stats.streams).toBe(0);
    // Its leases are not released: they run to their deadlines.
    for (const lease of leases) expect(await mem.store.get(lease)).toBeDefined();
  });

  it("a stream carries a bounded number of distinct leases (RESOURCE_EXHAUSTED naming the flag)", async () => {
    startHub({ maxLeasesPerStream: 2 });
    const { session, answers, outcome } = openSession();
    const [a, b, c] = [await mem.grant(), await mem.grant(), await mem.grant()];
    await renew(session, a);
    await renew(session, a);
    await renew(session, b);
    await renew(session, c);
    const { error } = await outcome;
    expect(error).toBeInstanceOf(ResourceExhaustedError);
    expect(String(error)).toMatch(/--max-leases-per-stream/);
    expect(kinds(answers)).toEqual(["lease", "lease", "lease"]);
  });

  it("a lost run no longer counts against the stream's lease limit", async () => {
    startHub({ maxLeasesPerStream: 1 });
    const { session, answers, outcome } = openSession();
    const first = await mem.grant();
    await renew(session, first);
    await mem.store.release(first, first.runId);
    const second = await mem.grant();
    await renew(session, second);
    expect(kinds(answers)).toEqual(["lease", "lost:released", "lease"]);
    session.endRequests();
    expect((await outcome).error).toBeUndefined();
  });

  it("after its last request the stream ends once the outstanding answers are out", async () => {
    startHub();
    const { session, answers, outcome } = openSession();
    const lease = await mem.grant();
    session.submit(request(lease));
    session.endRequests();
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(await outcome).toEqual({ ended: true, error: undefined });
    expect(kinds(answers)).toEqual(["lease"]);
  });

  it("the hub's close ends every stream with its reason, one not yet piped as soon as it is; nothing is released", async () => {
    startHub();
    const { session, outcome } = openSession();
    const lease = await mem.grant();
    await renew(session, lease);
    const unpiped = hub.open();
    const reason = new Error("the server is shutting down");
    hub.close(reason);
    expect((await outcome).error).toBe(reason);
    expect(hub.stats.streams).toBe(0);
    const late = new Promise<unknown>((resolve) =>
      unpiped.pipe({ write: () => true, onDrain: () => {}, end: resolve }),
    );
    expect(await late).toBe(reason);
    expect((await mem.store.get(lease))?.runId).toBe(lease.runId);
  });

  it("closing a stream (its call ended) tells its outlet nothing and stops its answers", async () => {
    startHub();
    const { session, answers, outcome } = openSession();
    const lease = await mem.grant();
    await renew(session, lease);
    session.submit(request(lease));
    session.close();
    await vi.advanceTimersByTimeAsync(tickMs);
    mem.feed.deliverLocal(changeFromLease("released", lease));
    await delivered();
    expect(kinds(answers)).toEqual(["lease"]);
    expect(hub.stats.streams).toBe(0);
    const ended = await Promise.race([outcome, Promise.resolve("still open")]);
    expect(ended).toBe("still open");
  });

  it("a database that cannot decide fails the stream; closing a stream releases nothing", async () => {
    const lease = await mem.grant();
    startHub({
      store: {
        ...mem.store,
        renewMany: async () => {
          throw new DatabaseUnavailableError("the database is restarting");
        },
      },
    });
    const { session, outcome } = openSession();
    await renew(session, lease);
    expect((await outcome).error).toBeInstanceOf(DatabaseUnavailableError);
    session.close();
    expect(hub.stats.streams).toBe(0);
    expect((await mem.store.get(lease))?.runId).toBe(lease.runId);
  });
});
