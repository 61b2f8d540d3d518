// Renewals from every KeepAlive stream of this instance, gathered and sent
// as one multi-row statement (DESIGN §3). A commit per renewal would cap
// throughput at the commit rate (a few thousand per second on a small
// machine); one UPDATE over a few hundred rows costs about as much as one
// single-row UPDATE.
//
// Statements are paced, not delayed: at most one starts per tick, and a
// renewal that arrives when the last one started a tick ago or more waits
// only for a short gathering window (what arrives with it, e.g. the next
// wave of a stream's renewals read from one socket). So the statement rate
// stays bounded by the tick while a renewal waits for the tick only when
// a statement went out less than a tick ago.
//
// The pace bounds statements per second where they are many and small; a
// batch of `eagerBatch` rows or more is not small, and goes after the
// gathering window whatever the pace, split over the free statement slots
// (half an eager batch at least each) so that PostgreSQL runs them on
// several cores. Beyond eagerBatch × 1000/tick renewals a second (21,000 at
// the defaults) the statement rate grows with the load; below it nothing
// changes. Without this, a saturated instance answered no faster than one
// statement per tick however many renewals waited: throughput was the
// renewals in flight divided by the tick, with the CPU half idle.
//
// The batch never waits on a row lock (SKIP LOCKED): a row held by another
// transaction is retried alone with an ordinary lock wait, so a stuck
// transaction on one key delays that key only (S8) and fails it fast with
// lock_timeout rather than the whole batch. A renewal still undecided then
// fails with RenewalUndecidedError: a KeepAlive stream answers that one
// renewal `undecided` (the client's next renewal tries again, its local
// deadline covers a lock that persists) and the others as usual.
//
// A batch statement that timed out (statement_timeout, or lock_timeout on
// the table) decided nothing, but the database is there: every renewal it
// carried fails with RenewalUndecidedError too, so a slow statement ends no
// stream (a slow database is as slow from any other instance) and each of
// its leases is renewed by the client's next renewal or lost at its local
// deadline (L2). A statement that fails otherwise (the database
// unreachable), the batch or a locked row's retry, rejects its renewals
// with that error, and their streams end.
//
// With tracing on (`tracer`), each batch statement is a span linked to the
// KeepAlive streams (and Renew calls) whose renewals it decides; the trace
// context is taken when a renewal is submitted. Off, `tracer` is undefined.

import { DatabaseTimeoutError, DatabaseUnavailableError } from "../../lease/errors.js";
import { runKey } from "../../lease/lease-change.js";
import type { HandoffRecord, LeaseRecord, LeaseStore, RenewItem } from "../../lease/types.js";
import type { LossCause } from "../../protocol/errors.js";
import { runTraced, type StatementTracer } from "../db/statement-tracer.js";

/**
 * One renewal was not decided, with the database there: its statement ran
 * past statement_timeout (`sqlState` 57014), or its row stayed locked by
 * another transaction past lock_timeout (55P03). The lease is unchanged.
 */
export class RenewalUndecidedError extends DatabaseUnavailableError {}

export type RenewalOutcome =
  | { renewed: true; lease: LeaseRecord; handoff: HandoffRecord | undefined }
  | { renewed: false; cause: LossCause };

/** Called once with (null, outcome), or with the error when the database could not decide. */
export type RenewalCallback = (error: unknown, outcome: RenewalOutcome | undefined) => void;

export interface RenewalBatcher {
  /** Renews one lease in the next batch. Rejects only when the database cannot decide. */
  renew(item: RenewItem): Promise<RenewalOutcome>;
  /**
   * `renew` without a promise: what a KeepAlive stream uses, thousands of
   * times a second, so that a renewal costs no promise and no microtask.
   * `key` is runKey of the item, which the stream has made already.
   */
  submit(item: RenewItem, key: string, done: RenewalCallback): void;
  readonly stats: { statements: number; renewals: number; pending: number };
  close(): void;
}

export interface RenewalBatcherOptions {
  store: LeaseStore;
  /** Least time between the starts of two statements; the longest a renewal waits for its batch. */
  tickMs: number;
  /** Rows per statement; a fuller batch goes at once. */
  maxBatch?: number;
  /** A batch this full goes after the gathering window, without waiting for the pace. */
  eagerBatch?: number;
  /** Statements in flight at once. */
  maxInFlight?: number;
  /** Traces each batch statement, linked to the calls it decides (unset: tracing off). */
  tracer?: StatementTracer;
}

interface Pending {
  item: RenewItem;
  waiters: RenewalCallback[];
  /** The trace contexts of the calls that submitted it (tracing on). */
  links?: object[];
}

// Raised outside the batch's own flow, as an unhandled rejection would be.
const reportUncaught = (error: unknown) =>
  queueMicrotask(() => {
    throw error;
  });

/** A statement that ran out of time (statement_timeout, lock_timeout), with the database there. */
function timedOut(error: unknown): error is Error {
  return (
    error instanceof DatabaseTimeoutError ||
    (error instanceof DatabaseUnavailableError && error.sqlState === "55P03")
  );
}

/** A statement's error as its renewals' failure: undecided when it timed out, else as it is. */
function undecided(error: unknown): unknown {
  if (!timedOut(error)) return error;
  return new RenewalUndecidedError(
    `the renewal was not decided (${error.message})`,
    error instanceof DatabaseUnavailableError ? error.sqlState : "57014",
    { cause: error },
  );
}

// A row that stays locked through this many waiting retries is reported as
// the database being unable to decide.
const maxLockedRetries = 3;

export function createRenewalBatcher(options: RenewalBatcherOptions): RenewalBatcher {
  const { store, tickMs, tracer } = options;
  const maxBatch = options.maxBatch ?? 2_000;
  const maxInFlight = options.maxInFlight ?? 4;
  const eagerBatch = Math.min(options.eagerBatch ?? 256, maxBatch);
  // Keyed by key and run: two requests for one lease in one tick share a row
  // (an UPDATE … FROM must not meet the same target row twice).
  let pending = new Map<string, Pending>();
  let timer: NodeJS.Timeout | undefined;
  let timerAt = Number.POSITIVE_INFINITY;
  let lastStartedAt = Number.NEGATIVE_INFINITY;
  // Long enough to take in the renewals that arrive together (one socket
  // read, one wave of answers), short next to the tick.
  const gatherMs = Math.min(2, tickMs);
  let inFlight = 0;
  let closed = false;
  const stats = { statements: 0, renewals: 0, pending: 0 };

  function schedule() {
    if (closed || pending.size === 0 || inFlight >= maxInFlight) return;
    if (pending.size >= maxBatch) {
      if (timer) clearTimeout(timer);
      timer = undefined;
      timerAt = Number.POSITIVE_INFINITY;
      void flush();
      return;
    }
    const now = performance.now();
    const wait =
      pending.size >= eagerBatch ? gatherMs : Math.max(gatherMs, lastStartedAt + tickMs - now);
    // A timer already due sooner stands; one due later (the pace) gives way.
    if (now + wait >= timerAt) return;
    if (timer) clearTimeout(timer);
    timerAt = now + wait;
    timer = setTimeout(() => {
      timer = undefined;
      timerAt = Number.POSITIVE_INFINITY;
      if (pending.size < eagerBatch) {
        void flush();
        return;
      }
      // An eager batch is split over the free statement slots, half an eager
      // batch at least each: the statements run side by side on their own
      // connections (PostgreSQL on every core) and answer sooner.
      const parts = Math.max(
        1,
        Math.min(maxInFlight - inFlight, Math.floor(pending.size / (eagerBatch / 2))),
      );
      const size = Math.ceil(pending.size / parts);
      for (let part = 0; part < parts; part++) void flush(size);
    }, wait);
  }

  async function flush(limit = maxBatch): Promise<void> {
    if (pending.size === 0 || inFlight >= maxInFlight) return;
    let batch: Pending[];
    if (pending.size <= limit) {
      batch = [...pending.values()];
      pending = new Map();
    } else {
      batch = [];
      for (const [k, p] of pending) {
        if (batch.length === limit) break;
        batch.push(p);
        pending.delete(k);
      }
    }
    stats.pending = pending.size;
    lastStartedAt = performance.now();
    inFlight += 1;
    try {
      stats.statements += 1;
      const items = batch.map((p) => p.item);
      const results = await runTraced(
        tracer,
        "keepalive renew",
        items.length,
        () => batch.flatMap((p) => p.links ?? []),
        () => store.renewMany(items, { wait: false }),
      );
      stats.renewals += batch.length;
      const locked: Pending[] = [];
      results.forEach((r, i) => {
        const p = batch[i];
        if (!p) return;
        if (r.outcome === "busy") locked.push(p);
        else if (r.outcome === "renewed")
          settle(p, { renewed: true, lease: r.lease, handoff: r.handoff });
        else settle(p, { renewed: false, cause: r.cause });
      });
      for (const p of locked) void renewLocked(p);
    } catch (error) {
      const failure = undecided(error);
      for (const p of batch) fail(p, failure);
    } finally {
      inFlight -= 1;
      schedule();
    }
  }

  async function renewLocked(p: Pending): Promise<void> {
    try {
      for (let attempt = 0; attempt < maxLockedRetries; attempt++) {
        stats.statements += 1;
        const [r] = await store.renewMany([p.item], { wait: true });
        if (r?.outcome === "renewed") {
          settle(p, { renewed: true, lease: r.lease, handoff: r.handoff });
          return;
        }
        if (r?.outcome === "lost") {
          settle(p, { renewed: false, cause: r.cause });
          return;
        }
      }
      throw new RenewalUndecidedError(
        "the renewal was not decided (the session's lease row stayed locked by other transactions)",
        "55P03",
      );
    } catch (error) {
      fail(p, error instanceof RenewalUndecidedError ? error : undecided(error));
    }
  }

  // Every waiter of `p` hears the same answer; one that throws must not
  // keep the rest of the batch unanswered.
  function answer(p: Pending, error: unknown, outcome: RenewalOutcome | undefined) {
    for (const w of p.waiters) {
      try {
        w(error, outcome);
      } catch (thrown) {
        reportUncaught(thrown);
      }
    }
  }
  const settle = (p: Pending, outcome: RenewalOutcome) => answer(p, null, outcome);
  const fail = (p: Pending, error: unknown) => answer(p, error, undefined);

  function submit(item: RenewItem, k: string, done: RenewalCallback) {
    if (closed) {
      done(new DatabaseUnavailableError("the server is shutting down"), undefined);
      return;
    }
    let existing = pending.get(k);
    if (existing) {
      // The later request's TTL wins; a handoff lookup asked by either is made.
      existing.item = {
        ...item,
        lookupHandoff: existing.item.lookupHandoff || item.lookupHandoff,
      };
      existing.waiters.push(done);
    } else {
      existing = { item, waiters: [done] };
      pending.set(k, existing);
    }
    if (tracer !== undefined) {
      const link = tracer.link();
      if (link) {
        if (existing.links) existing.links.push(link);
        else existing.links = [link];
      }
    }
    stats.pending = pending.size;
    schedule();
  }

  return {
    stats,
    submit,
    renew(item) {
      return new Promise((resolve, reject) => {
        submit(item, runKey(item, item.runId), (error, outcome) => {
          if (outcome) resolve(outcome);
          else reject(error);
        });
      });
    },
    close() {
      closed = true;
      if (timer) clearTimeout(timer);
      const error = new DatabaseUnavailableError("the server is shutting down");
      for (const p of pending.values()) fail(p, error);
      pending.clear();
    },
  };
}
