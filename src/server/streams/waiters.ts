// Acquire with `wait`: a caller that finds the session held waits here until
// the lease ends, then tries again. Nothing polls the database: an attempt is
// made when a release or revoke arrives from any instance, when the expiry
// tracker confirms the blocking lease's deadline passed, after a missed-change
// resync, and once more when the wait runs out (so the answer names the
// current holder as of then). A slow periodic re-check bounds the delay when
// a release notification was lost.
//
// Within this instance the waiters of one key queue in arrival order and
// only the first attempts; across instances the first waiters race and the
// conditional UPSERT picks exactly one winner per release (S2). Losers keep
// their place and wait for the next end of the lease.

import { KeeperNotHeldError, LeaseNotHeldError } from "../../lease/errors.js";
import { endsLease, keyString } from "../../lease/lease-change.js";
import type { AcquireInput, AcquireResult, LeaseRecord, LeaseStore } from "../../lease/types.js";
import type { Logger } from "../../log/logger.js";
import { outsideCalls } from "../observability/call-trace.js";
import type { ChangeFeed } from "./change-feed.js";
import type { ExpiryTracker } from "./expiry-tracker.js";

export interface Waiters {
  /**
   * Acquires, waiting up to `waitMs` while another run holds the session.
   * Rejects with `signal.reason` when the signal aborts first.
   */
  acquire(input: AcquireInput, waitMs: number, signal: AbortSignal): Promise<AcquireResult>;
  readonly stats: { waiting: number; attempts: number; granted: number };
  start(): void;
  close(): void;
}

export interface WaitersOptions {
  store: LeaseStore;
  feed: ChangeFeed;
  tracker: ExpiryTracker;
  logger: Logger;
  recheckIntervalMs: number;
}

interface Waiter {
  input: AcquireInput;
  resolve(result: AcquireResult): void;
  reject(error: unknown): void;
  /** The lease that blocked the last attempt. */
  current: LeaseRecord | undefined;
  done: boolean;
  /** An attempt for this waiter is in flight. */
  attempting: boolean;
  /** The wait ran out during an attempt: that attempt's answer is the final one. */
  waitOver: boolean;
  /**
   * Given up (its signal aborted) while an attempt for it was in flight:
   * that attempt answers it with this reason once decided, after ending a
   * grant it made, so the caller hears of the give-up only when no grant of
   * it remains.
   */
  givenUp?: { reason: unknown };
}

interface KeyQueue {
  waiters: Waiter[];
  attempting: boolean;
  /** A trigger arrived during an attempt: try again when it ends. */
  again: boolean;
  releaseHold: () => void;
}

export function createWaiters(options: WaitersOptions): Waiters {
  const { store, feed, tracker, logger } = options;
  const queues = new Map<string, KeyQueue>();
  const stats = { waiting: 0, attempts: 0, granted: 0 };
  const stops: (() => void)[] = [];
  let recheckTimer: NodeJS.Timeout | undefined;
  // K2: keys whose lease ended with a lock-delay, tried again when it is over.
  const delayTimers = new Map<string, NodeJS.Timeout>();

  /**
   * K2 (keepers): the key is free of any valid lease but not granted before
   * `untilUs`, a known database instant: the next attempt is made then, not
   * at once (that would spin for the whole delay).
   */
  function afterDelay(k: string, untilUs: bigint): void {
    if (delayTimers.has(k)) return;
    const waitMs = Math.max(1, Number(untilUs - tracker.databaseNowUs()) / 1_000 + 1);
    const timer = setTimeout(() => {
      delayTimers.delete(k);
      trigger(k);
    }, waitMs);
    timer.unref();
    delayTimers.set(k, timer);
  }

  async function releaseUnwanted(result: AcquireResult & { acquired: true }) {
    if (result.retried) return; // the caller's own earlier grant: theirs to release
    try {
      // Only this grant as answered: the caller may have retried with the
      // same run_id on another instance (failover) and been answered this
      // lease as its own, with a later deadline; that lease is theirs.
      const { lease } = result;
      await store.release(lease, lease.runId, {
        fencingToken: lease.fencingToken,
        expiresAtUs: lease.expiresAtUs,
      });
    } catch (error) {
      logger.warn(
        { err: error, keeperId: result.lease.keeperId },
        result.lease.keeperId
          ? "could not release a grant nobody waited for; it ends with its keeper, or when its run releases it"
          : "could not release a grant nobody waited for; it will expire",
      );
    }
  }

  function finish(k: string, w: Waiter) {
    if (w.done) return;
    w.done = true;
    stats.waiting -= 1;
    const q = queues.get(k);
    if (!q) return;
    q.waiters = q.waiters.filter((x) => x !== w);
    if (q.waiters.length === 0 && !q.attempting) {
      q.releaseHold();
      queues.delete(k);
    }
  }

  function trigger(k: string) {
    const q = queues.get(k);
    if (!q) return;
    if (q.attempting) {
      q.again = true;
      return;
    }
    // Outside whatever call's code runs now (a waiter's own call, or the
    // call that armed the expiry tracker's timer): the attempt is for the
    // queue's head, so its statement must not be linked to that call's span.
    outsideCalls(() => void attempt(k, q), undefined);
  }

  async function attempt(k: string, q: KeyQueue): Promise<void> {
    q.attempting = true;
    try {
      do {
        q.again = false;
        const head = q.waiters[0];
        if (!head) break;
        stats.attempts += 1;
        let result: AcquireResult;
        head.attempting = true;
        try {
          result = await store.acquire(head.input);
        } catch (error) {
          head.attempting = false;
          if (head.givenUp) {
            head.reject(head.givenUp.reason);
            q.again = true;
            continue;
          }
          // The waiter's own run had its lease end (S4), or the keeper it
          // asked for is over (K1: expired, closed, revoked): no later
          // attempt can grant it, so that is the answer now, and the next
          // waiter goes on. (A waiter whose keeper's stream stalled stays
          // queued until then: the server has not seen the stall.)
          if (
            head.waitOver ||
            error instanceof LeaseNotHeldError ||
            error instanceof KeeperNotHeldError
          ) {
            finish(k, head);
            head.reject(error);
            // The next waiter tries now (a bare `continue` would leave the
            // loop: `again` was cleared for this round).
            q.again = true;
            continue;
          }
          // The database could not decide; the next trigger (a change, the
          // deadline timer, the re-check or the end of the wait) tries again.
          logger.warn({ err: error }, "a waiting acquire attempt failed");
          break;
        }
        head.attempting = false;
        if (head.givenUp) {
          if (result.acquired) await releaseUnwanted(result);
          head.reject(head.givenUp.reason);
          q.again = true;
          continue;
        }
        if (result.acquired && head.done) {
          // The caller gave up while the grant was being made: nobody will
          // use or release this lease, so end it now and let the next go.
          await releaseUnwanted(result);
          q.again = true;
          continue;
        }
        if (result.acquired) {
          stats.granted += 1;
          head.resolve(result);
          finish(k, head);
          // The winner's lease now blocks the rest; its deadline is tracked.
          tracker.learn(result.lease);
          break;
        }
        if (head.waitOver) {
          // The wait ran out while this attempt was deciding: it is the answer.
          finish(k, head);
          head.resolve(result);
          if (result.current) tracker.learn(result.current);
          continue;
        }
        head.current = result.current;
        if (result.current) tracker.learn(result.current);
        else if (result.lockDelayUntilUs !== undefined) afterDelay(k, result.lockDelayUntilUs);
        else q.again = true; // ended between the UPSERT and the read: go again
      } while (q.again);
    } finally {
      q.attempting = false;
      if (q.waiters.length === 0) {
        q.releaseHold();
        queues.delete(k);
      }
    }
  }

  return {
    stats,
    async acquire(input, waitMs, signal) {
      const first = await store.acquire(input);
      if (first.acquired || waitMs <= 0) return first;
      signal.throwIfAborted();
      const k = keyString(input);
      return new Promise<AcquireResult>((resolve, reject) => {
        const w: Waiter = {
          input,
          current: first.current,
          done: false,
          attempting: false,
          waitOver: false,
          resolve,
          reject,
        };
        let q = queues.get(k);
        if (!q) {
          q = { waiters: [], attempting: false, again: false, releaseHold: tracker.hold(input) };
          queues.set(k, q);
        }
        q.waiters.push(w);
        stats.waiting += 1;
        logger.debug(
          { accountId: input.accountId, sessionId: input.sessionId, waitMs },
          "acquire waiting",
        );
        if (first.current) tracker.learn(first.current);
        else if (first.lockDelayUntilUs !== undefined) afterDelay(k, first.lockDelayUntilUs);
        else trigger(k);

        const onAbort = () => {
          clearTimeout(timer);
          if (w.done) return;
          finish(k, w);
          if (w.attempting) {
            w.givenUp = { reason: signal.reason };
            return;
          }
          reject(signal.reason);
        };
        signal.addEventListener("abort", onAbort, { once: true });
        const settle = (result: AcquireResult) => {
          signal.removeEventListener("abort", onAbort);
          clearTimeout(timer);
          resolve(result);
        };
        w.resolve = settle;
        w.reject = (error) => {
          signal.removeEventListener("abort", onAbort);
          clearTimeout(timer);
          reject(error);
        };
        // The wait ran out: one last attempt gives the authoritative answer.
        // When an attempt for this waiter is already deciding, its answer is
        // that last attempt: a second one could answer "not acquired" while
        // the first grants the session (and then, with nobody to take it,
        // would have to end it).
        const timer = setTimeout(() => {
          if (w.done) return;
          if (w.attempting) {
            w.waitOver = true;
            return;
          }
          finish(k, w);
          store.acquire(input).then(
            (result) => {
              // Given up while this attempt decided (the waiter left the
              // queue, so onAbort no longer answers): answered all the same,
              // once a grant nobody will use is ended.
              if (result.acquired && signal.aborted) {
                void releaseUnwanted(result).then(() => w.reject(signal.reason));
                return;
              }
              if (result.acquired) stats.granted += 1;
              w.resolve(result);
            },
            (error) => w.reject(error),
          );
        }, waitMs);
      });
    },
    start() {
      stops.push(
        feed.subscribe((change) => {
          if (endsLease(change.type)) trigger(keyString(change));
        }),
        feed.onResync(() => {
          for (const k of queues.keys()) trigger(k);
        }),
        tracker.onStale((key) => trigger(keyString(key))),
      );
      recheckTimer = setInterval(() => {
        for (const k of queues.keys()) trigger(k);
      }, options.recheckIntervalMs);
      recheckTimer.unref();
    },
    close() {
      if (recheckTimer) clearInterval(recheckTimer);
      for (const timer of delayTimers.values()) clearTimeout(timer);
      delayTimers.clear();
      for (const stop of stops) stop();
    },
  };
}
