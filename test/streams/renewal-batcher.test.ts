// The renewal batcher (streams/renewal-batcher.ts) on the in-memory store
// and fake timers: batching by tick, one row per key and run per statement,
// busy rows retried alone, close. No PostgreSQL: the statement itself is
// tested in test/renew-many.test.ts.

import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { DatabaseTimeoutError, DatabaseUnavailableError } from "../../src/lease/errors.js";
import type { LeaseRecord, LeaseStore, RenewItem } from "../../src/lease/types.js";
import {
  createRenewalBatcher,
  RenewalUndecidedError,
} from "../../src/server/streams/renewal-batcher.js";
import { type MemoryStreaming, memoryStreaming, observe } from "../support/memory-streaming.js";

const tickMs = 20;
let mem: MemoryStreaming;
/** Every renewMany statement the batcher sent: its items and whether it waited on locks. */
let statements: { items: RenewItem[]; wait: boolean }[];

beforeEach(() => {
  vi.useFakeTimers();
  mem = memoryStreaming();
  statements = [];
});
afterEach(() => {
  vi.useRealTimers();
});

/** The memory store with every renewMany recorded; `renewMany` replaces the store's. */
function recording(renewMany: LeaseStore["renewMany"] = mem.raw.renewMany): LeaseStore {
  return {
    ...mem.raw,
    renewMany: (items, options) => {
      statements.push({ items: [...items], wait: options.wait });
      return renewMany(items, options);
    },
  };
}

const item = (lease: LeaseRecord, extra: Partial<RenewItem> = {}): RenewItem => ({
  accountId: lease.accountId,
  sessionId: lease.sessionId,
  runId: lease.runId,
  ttlMs: undefined,
  lookupHandoff: false,
  ...extra,
});

describe("renewal batcher", () => {
  it("S4: renewals that arrive together share one statement and keep their tokens", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs });
    const leases = [await mem.grant(), await mem.grant(), await mem.grant()];
    const answers = leases.map((l) => observe(batcher.renew(item(l))));
    // No statement went out in the last tick: only the gathering window (2 ms) is waited.
    await vi.advanceTimersByTimeAsync(1);
    expect(statements).toHaveLength(0);
    await vi.advanceTimersByTimeAsync(1);
    expect(statements).toHaveLength(1);
    expect(statements[0]?.items.map((i) => i.runId)).toEqual(leases.map((l) => l.runId));
    expect(statements[0]?.wait).toBe(false);
    const outcomes = await Promise.all(answers.map((a) => a.promise));
    outcomes.forEach((o, i) => {
      expect(o.renewed && o.lease.fencingToken).toBe(leases[i]?.fencingToken);
    });
    expect(batcher.stats).toMatchObject({ statements: 1, renewals: 3, pending: 0 });
  });

  it("at most one statement starts per tick: a renewal after a statement waits until a tick after its start", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs });
    const [a, b, c] = [await mem.grant(), await mem.grant(), await mem.grant()];
    const first = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(2);
    expect(statements).toHaveLength(1);
    expect(first.value?.renewed).toBe(true);
    // Started at 2 ms: the next statement may start at 22 ms, with both of these in it.
    const later = [observe(batcher.renew(item(b)))];
    await vi.advanceTimersByTimeAsync(10);
    later.push(observe(batcher.renew(item(c))));
    await vi.advanceTimersByTimeAsync(9);
    expect(statements).toHaveLength(1);
    await vi.advanceTimersByTimeAsync(1);
    expect(statements.map((s) => s.items.length)).toEqual([1, 2]);
    for (const l of later) expect(l.value?.renewed).toBe(true);
  });

  it("one row per key and run per statement: two requests for one lease share it, the later TTL wins, a handoff lookup asked by either is made", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs });
    const lease = await mem.grant();
    await mem.store.requestHandoff(lease, "browser", "continue here");
    const first = batcher.renew(item(lease, { ttlMs: 5_000, lookupHandoff: true }));
    const second = batcher.renew(item(lease, { ttlMs: 9_000 }));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(statements).toHaveLength(1);
    expect(statements[0]?.items).toEqual([item(lease, { ttlMs: 9_000, lookupHandoff: true })]);
    const [a, b] = await Promise.all([first, second]);
    expect(a).toEqual(b);
    expect(a.renewed && a.lease.ttlMs).toBe(9_000n);
    expect(a.renewed && a.handoff?.requesterHolder).toBe("browser");
  });

  it("a full batch goes at once, without waiting for the tick", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs, maxBatch: 2 });
    const [a, b] = [await mem.grant(), await mem.grant()];
    const renewals = [batcher.renew(item(a)), batcher.renew(item(b))];
    await vi.advanceTimersByTimeAsync(0);
    expect(statements).toHaveLength(1);
    expect(statements[0]?.items).toHaveLength(2);
    await Promise.all(renewals);
  });

  it("a batch of eagerBatch rows goes after the gathering window, even within a tick of the last statement, split into statements of half an eager batch or more; a smaller one keeps the pace", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs, eagerBatch: 4 });
    const [a, b, c, d, e, f] = [
      await mem.grant(),
      await mem.grant(),
      await mem.grant(),
      await mem.grant(),
      await mem.grant(),
      await mem.grant(),
    ];
    const first = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(2);
    expect(statements).toHaveLength(1);
    expect(first.value?.renewed).toBe(true);
    // Three renewals the pace would hold back until 22 ms; the fourth makes the batch eager.
    const eager = [b, c, d].map((l) => observe(batcher.renew(item(l))));
    await vi.advanceTimersByTimeAsync(3);
    expect(statements).toHaveLength(1);
    eager.push(observe(batcher.renew(item(e))));
    await vi.advanceTimersByTimeAsync(1);
    expect(statements).toHaveLength(1);
    await vi.advanceTimersByTimeAsync(1);
    // At 7 ms, as two statements side by side, two rows each.
    expect(statements.map((st) => st.items.length)).toEqual([1, 2, 2]);
    expect(statements.slice(1).flatMap((st) => st.items.map((i) => i.runId))).toEqual(
      [b, c, d, e].map((l) => l.runId),
    );
    for (const r of eager) expect(r.value?.renewed).toBe(true);
    // Below eagerBatch the pace holds again: a tick after the last start (7 ms).
    const paced = observe(batcher.renew(item(f)));
    await vi.advanceTimersByTimeAsync(tickMs - 1);
    expect(statements).toHaveLength(3);
    await vi.advanceTimersByTimeAsync(1);
    expect(statements.map((st) => st.items.length)).toEqual([1, 2, 2, 1]);
    expect(paced.value?.renewed).toBe(true);
  });

  it("S4: the store's loss causes are passed on; a lost lease is not renewed", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs });
    const expired = await mem.grant({ ttlMs: 100 });
    const released = await mem.grant();
    await mem.store.release(released, released.runId);
    await vi.advanceTimersByTimeAsync(100);
    const renewals = [batcher.renew(item(expired)), batcher.renew(item(released))];
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(await Promise.all(renewals)).toEqual([
      { renewed: false, cause: "expired" },
      { renewed: false, cause: "released" },
    ]);
    expect(await mem.store.get(expired)).toBeUndefined();
  });

  it("S8: a row locked by another transaction is retried alone, waiting; the rest of its batch is answered at once", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs });
    const [stuck, free] = [await mem.grant(), await mem.grant()];
    const unlock = mem.raw.lockRow(stuck);
    const stuckAnswer = observe(batcher.renew(item(stuck)));
    const freeAnswer = observe(batcher.renew(item(free)));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(freeAnswer.settled).toBe(true);
    expect(freeAnswer.value?.renewed).toBe(true);
    expect(stuckAnswer.settled).toBe(false);
    expect(statements.map((s) => [s.items.map((i) => i.runId), s.wait])).toEqual([
      [[stuck.runId, free.runId], false],
      [[stuck.runId], true],
    ]);
    unlock();
    await vi.advanceTimersByTimeAsync(0);
    expect(stuckAnswer.value).toMatchObject({ renewed: true, lease: { runId: stuck.runId } });
  });

  it("S8: a row still busy after three waiting retries is answered as a database that cannot decide", async () => {
    const busy: LeaseStore["renewMany"] = async (items) => items.map(() => ({ outcome: "busy" }));
    const batcher = createRenewalBatcher({ store: recording(busy), tickMs });
    const answer = observe(batcher.renew(item(await mem.grant())));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(answer.error).toBeInstanceOf(DatabaseUnavailableError);
    expect(statements.map((s) => s.wait)).toEqual([false, true, true, true]);
  });

  it("a statement that fails rejects every renewal of its batch, and the next batch goes on", async () => {
    let fail = true;
    const batcher = createRenewalBatcher({
      store: recording(async (items, options) => {
        if (fail) throw new DatabaseUnavailableError("the database is restarting");
        return mem.raw.renewMany(items, options);
      }),
      tickMs,
    });
    const [a, b] = [await mem.grant(), await mem.grant()];
    const failed = [observe(batcher.renew(item(a))), observe(batcher.renew(item(b)))];
    await vi.advanceTimersByTimeAsync(tickMs);
    for (const f of failed) expect(f.error).toBeInstanceOf(DatabaseUnavailableError);
    fail = false;
    const again = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(again.value?.renewed).toBe(true);
  });

  it("L2: a statement that timed out leaves every renewal of its batch undecided, not failed with the timeout; a lost connection still fails them", async () => {
    let failure: Error | undefined = new DatabaseTimeoutError("the database statement timed out");
    const batcher = createRenewalBatcher({
      store: recording(async (items, options) => {
        if (failure) throw failure;
        return mem.raw.renewMany(items, options);
      }),
      tickMs,
    });
    const [a, b] = [await mem.grant(), await mem.grant()];
    const timedOut = [observe(batcher.renew(item(a))), observe(batcher.renew(item(b)))];
    await vi.advanceTimersByTimeAsync(tickMs);
    for (const t of timedOut) {
      expect(t.error).toBeInstanceOf(RenewalUndecidedError);
      expect((t.error as RenewalUndecidedError).sqlState).toBe("57014");
    }
    failure = new DatabaseUnavailableError("the session's lease row is locked", "55P03");
    const lockTimedOut = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(lockTimedOut.error).toBeInstanceOf(RenewalUndecidedError);
    failure = new DatabaseUnavailableError("the database is unavailable (ECONNREFUSED)");
    const unreachable = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(unreachable.error).toBe(failure);
    failure = undefined;
    const again = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(again.value?.renewed).toBe(true);
  });

  it("at most maxInFlight statements at once; what queued meanwhile goes in the next batch", async () => {
    let finishFirst!: () => void;
    const firstDone = new Promise<void>((resolve) => {
      finishFirst = resolve;
    });
    const batcher = createRenewalBatcher({
      store: recording(async (items, options) => {
        if (statements.length === 1) await firstDone;
        return mem.raw.renewMany(items, options);
      }),
      tickMs,
      maxInFlight: 1,
    });
    const [a, b, c] = [await mem.grant(), await mem.grant(), await mem.grant()];
    const first = observe(batcher.renew(item(a)));
    await vi.advanceTimersByTimeAsync(tickMs);
    const later = [observe(batcher.renew(item(b))), observe(batcher.renew(item(c)))];
    await vi.advanceTimersByTimeAsync(10 * tickMs);
    expect(statements).toHaveLength(1);
    expect(batcher.stats.pending).toBe(2);
    finishFirst();
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(first.value?.renewed).toBe(true);
    expect(statements.map((s) => s.items.length)).toEqual([1, 2]);
    for (const l of later) expect(l.value?.renewed).toBe(true);
  });

  it("close rejects the renewals still waiting for their batch, and every later one", async () => {
    const batcher = createRenewalBatcher({ store: recording(), tickMs });
    const pending = observe(batcher.renew(item(await mem.grant())));
    batcher.close();
    await vi.advanceTimersByTimeAsync(tickMs);
    expect(pending.error).toBeInstanceOf(DatabaseUnavailableError);
    await expect(batcher.renew(item(await mem.grant()))).rejects.toBeInstanceOf(
      DatabaseUnavailableError,
    );
    expect(statements).toHaveLength(0);
  });
});
