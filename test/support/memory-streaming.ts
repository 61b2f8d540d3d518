// The streaming side's foundation without PostgreSQL or sockets, for fast
// unit tests of streams/: the in-memory store on a clock that follows
// vitest's fake timers, the real change feed without a notifier (this
// instance sees its own changes only), and the publishing decorator the
// server puts between them. Call it after vi.useFakeTimers().

import { randomUUID } from "node:crypto";
import type { LeaseChange } from "../../src/lease/lease-change.js";
import type { LeaseRecord, LeaseStore, SessionKey } from "../../src/lease/types.js";
import { createLogger } from "../../src/log/logger.js";
import { type ChangeFeed, createChangeFeed } from "../../src/server/streams/change-feed.js";
import { withPublishing } from "../../src/server/streams/publishing-store.js";
import { freshKey } from "./leases.js";
import { createMemoryStore, type MemoryStore, timerClock } from "./memory-store.js";

export interface MemoryStreaming {
  /** The store itself: its writes reach no change feed, as a lost notification. */
  raw: MemoryStore;
  /** The store as the services use it: each write is published to `feed`. */
  store: LeaseStore;
  feed: ChangeFeed;
  /** Every change the feed delivered, in order. */
  changes: LeaseChange[];
  logger: ReturnType<typeof createLogger>;
  /** Acquires a fresh key for a new run through `store`; throws when not granted. */
  grant(options?: { key?: SessionKey; ttlMs?: number; holder?: string }): Promise<LeaseRecord>;
}

/** `skewMs`: how far the database clock runs ahead of this process's clock. */
export function memoryStreaming(options: { skewMs?: number } = {}): MemoryStreaming {
  const raw = createMemoryStore({ clock: timerClock(options.skewMs) });
  const logger = createLogger({ level: "silent" });
  const feed = createChangeFeed({ notifier: undefined, logger });
  const store = withPublishing(raw, feed);
  const changes: LeaseChange[] = [];
  feed.subscribe((change) => changes.push(change));
  return {
    raw,
    store,
    feed,
    changes,
    logger,
    async grant({ key = freshKey("mem"), ttlMs = 60_000, holder = "desktop" } = {}) {
      const result = await store.acquire({ ...key, runId: randomUUID(), ttlMs, holder });
      if (!result.acquired) throw new Error(`${key.sessionId} is held by another run`);
      return result.lease;
    },
  };
}

/** A promise's state, readable at any moment without awaiting it. */
export interface Observed<T> {
  readonly settled: boolean;
  readonly value: T | undefined;
  readonly error: unknown;
  readonly promise: Promise<T>;
}

export function observe<T>(promise: Promise<T>): Observed<T> {
  const state = {
    settled: false,
    value: undefined as T | undefined,
    error: undefined as unknown,
    promise,
  };
  promise.then(
    (value) => {
      state.settled = true;
      state.value = value;
    },
    (error: unknown) => {
      state.settled = true;
      state.error = error;
    },
  );
  return state;
}
