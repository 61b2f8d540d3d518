// Expiry has no database event: a lease simply runs past its deadline. For
// the keys that have watchers or waiters on this instance, the tracker keeps
// a timer at each valid lease's deadline; when it fires, it reads the row
// (many due keys in one statement) and only then reports the end (S9: the
// database clock decides, the timer only says when to look). The same
// reading also catches a release or revoke whose notification was lost, so a
// lost notification delays a watcher by at most one TTL.

import { endsLease, keyString, type LeaseChange } from "../../lease/lease-change.js";
import type {
  LeaseRecord,
  LeaseStore,
  Scope,
  ScopeReading,
  SessionKey,
} from "../../lease/types.js";
import type { Logger } from "../../log/logger.js";
import type { ChangeFeed } from "./change-feed.js";

export interface ExpiryTracker {
  /** Tracks the deadlines of valid leases in `scope` until the returned function is called. */
  hold(scope: Scope): () => void;
  /** Learns deadlines from a reading of the database (a snapshot). */
  observe(reading: ScopeReading): void;
  /** Learns one lease's deadline from a statement's answer. */
  learn(lease: LeaseRecord): void;
  /**
   * Called with a key whose row no longer matches what this instance knew
   * (changes were missed): receivers re-read it.
   */
  onStale(listener: (key: SessionKey) => void): () => void;
  /** The database clock as estimated here, in microseconds since the epoch. */
  databaseNowUs(): bigint;
  start(): Promise<void>;
  close(): void;
}

export interface ExpiryTrackerOptions {
  store: LeaseStore;
  feed: ChangeFeed;
  logger: Logger;
  /** Waits this long past a deadline before reading, to absorb clock-estimate error. */
  marginMs?: number;
}

interface Entry {
  key: SessionKey;
  token: bigint;
  timer: NodeJS.Timeout;
}

// setTimeout's largest delay; longer deadlines are re-armed when reached.
const maxDelayMs = 2_147_483_647;
// How soon a key whose row was being written is read again: a statement's
// row lock lasts milliseconds; the wait doubles up to a second for a writer
// that stays, which is logged once it has been seen that many times.
const writtenRetryMs = 20;
const writtenRetryMaxMs = 1_000;
const writtenTriesBeforeWarning = 10;

function localNowUs(): bigint {
  return BigInt(Math.round((performance.timeOrigin + performance.now()) * 1000));
}

export function createExpiryTracker(options: ExpiryTrackerOptions): ExpiryTracker {
  const { store, feed, logger } = options;
  const marginMs = options.marginMs ?? 2;
  const holds = new Map<string, number>();
  const entries = new Map<string, Entry>();
  // Readings in a row that found a key's row being written.
  const writtenTries = new Map<string, number>();
  const staleListeners = new Set<(key: SessionKey) => void>();
  let due = new Map<string, SessionKey>();
  let confirming = false;
  let closed = false;
  // Database clock minus local clock, from the latest reading.
  let offsetUs = 0n;
  let unsubscribe: (() => void) | undefined;

  const accountScope = (accountId: string) => keyString({ accountId, sessionId: "" });
  const covered = (key: SessionKey) =>
    holds.has(keyString(key)) || holds.has(accountScope(key.accountId));

  /** `retry`: a reading found the row being written; any other arming starts the count again. */
  function arm(key: SessionKey, token: bigint, delayMs: number, retry = false) {
    const k = keyString(key);
    const existing = entries.get(k);
    if (existing) {
      if (existing.token > token) return;
      clearTimeout(existing.timer);
    }
    if (!retry) writtenTries.delete(k);
    const timer = setTimeout(
      () => {
        due.set(k, key);
        void confirm();
      },
      Math.min(maxDelayMs, Math.max(0, Math.ceil(delayMs) + marginMs)),
    );
    timer.unref();
    entries.set(k, { key, token, timer });
  }

  function forget(key: SessionKey, upToToken?: bigint) {
    const k = keyString(key);
    const existing = entries.get(k);
    if (!existing) return;
    if (upToToken !== undefined && existing.token > upToToken) return;
    clearTimeout(existing.timer);
    entries.delete(k);
    writtenTries.delete(k);
  }

  function setFromDatabaseTime(key: SessionKey, token: bigint, expiresAtUs: bigint) {
    arm(key, token, Number(expiresAtUs - (localNowUs() + offsetUs)) / 1000);
  }

  function onChange(change: LeaseChange) {
    if (!covered(change)) return;
    if (change.lease && (change.type === "acquired" || change.type === "renewed")) {
      setFromDatabaseTime(change, change.fencingToken, change.lease.expiresAtUs);
    } else if (endsLease(change.type)) {
      forget(change, change.fencingToken);
    }
  }

  function stale(key: SessionKey) {
    for (const listener of staleListeners) {
      try {
        listener(key);
      } catch (error) {
        logger.error({ err: error }, "a stale-key listener failed");
      }
    }
  }

  async function confirm(): Promise<void> {
    if (confirming || closed) return;
    confirming = true;
    try {
      // Let timers that fire together share one statement.
      await new Promise((resolve) => setImmediate(resolve));
      while (due.size > 0 && !closed) {
        const batch = due;
        due = new Map();
        let reading: ScopeReading;
        try {
          reading = await store.readScopes([...batch.values()], { skipWritten: true });
        } catch (error) {
          logger.warn({ err: error, keys: batch.size }, "confirming deadlines failed; retrying");
          for (const key of batch.values()) {
            const entry = entries.get(keyString(key));
            if (entry) arm(key, entry.token, 1_000);
          }
          continue;
        }
        noteClock(reading.observedAtUs);
        const rows = new Map(reading.rows.map((r) => [keyString(r), r]));
        const written = new Set((reading.written ?? []).map(keyString));
        for (const [k, key] of batch) {
          const entry = entries.get(k);
          if (!entry) continue;
          if (!covered(key)) {
            forget(key);
            continue;
          }
          // A transaction is writing the row (a renewal that may have beaten
          // the deadline): look again once it is done, judging nothing now;
          // sooner for a statement's row lock, later for a stuck writer.
          if (written.has(k)) {
            const tries = (writtenTries.get(k) ?? 0) + 1;
            writtenTries.set(k, tries);
            if (tries === writtenTriesBeforeWarning) {
              logger.warn(
                { accountId: key.accountId, sessionId: key.sessionId, tries },
                "a lease row due for its expiry check is held by a transaction; the check waits for it",
              );
            }
            arm(
              key,
              entry.token,
              Math.min(writtenRetryMaxMs, writtenRetryMs * 2 ** (tries - 1)),
              true,
            );
            continue;
          }
          writtenTries.delete(k);
          const row = rows.get(k);
          if (row && row.fencingToken === entry.token) {
            if (row.valid) {
              arm(key, entry.token, Number(row.remainingUs) / 1000);
              continue;
            }
            forget(key);
            feed.deliverLocal({
              type: row.ended ?? "expired",
              accountId: row.accountId,
              sessionId: row.sessionId,
              runId: row.runId,
              fencingToken: row.fencingToken,
              holder: row.holder,
              atUs: row.expiresAtUs,
              lease: undefined,
              reason: row.endReason ?? "",
              requesterHolder: "",
              eventId: row.endEventId ?? 0n,
            });
            continue;
          }
          // Another grant (or a garbage-collected row): changes were missed.
          forget(key);
          if (row?.valid) arm(key, row.fencingToken, Number(row.remainingUs) / 1000);
          stale(key);
        }
      }
    } finally {
      confirming = false;
    }
  }

  function noteClock(observedAtUs: bigint) {
    if (observedAtUs > 0n) offsetUs = observedAtUs - localNowUs();
  }

  return {
    hold(scope) {
      const k = keyString(scope);
      holds.set(k, (holds.get(k) ?? 0) + 1);
      let released = false;
      return () => {
        if (released) return;
        released = true;
        const n = (holds.get(k) ?? 1) - 1;
        if (n > 0) {
          holds.set(k, n);
          return;
        }
        holds.delete(k);
        for (const entry of [...entries.values()]) {
          if (!covered(entry.key)) forget(entry.key);
        }
      };
    },
    observe(reading) {
      noteClock(reading.observedAtUs);
      for (const row of reading.rows) {
        if (!covered(row)) continue;
        if (row.valid) arm(row, row.fencingToken, Number(row.remainingUs) / 1000);
        else forget(row, row.fencingToken);
      }
    },
    learn(lease) {
      if (covered(lease)) arm(lease, lease.fencingToken, Number(lease.remainingUs) / 1000);
    },
    onStale(listener) {
      staleListeners.add(listener);
      return () => staleListeners.delete(listener);
    },
    databaseNowUs: () => localNowUs() + offsetUs,
    async start() {
      unsubscribe = feed.subscribe(onChange);
      noteClock((await store.readScopes([])).observedAtUs);
    },
    close() {
      closed = true;
      unsubscribe?.();
      for (const entry of entries.values()) clearTimeout(entry.timer);
      entries.clear();
    },
  };
}
