// Builds the streaming side of a server instance: the change feed (with the
// notification channel unless it is turned off), the expiry tracker, the
// renewal batcher, and the hubs behind KeepAlive, Watch and waiting Acquire.
// Start and stop order matters: receivers subscribe before changes flow, and
// queued changes are published before the pool closes.

import { randomUUID } from "node:crypto";
import { type ChangeFeed, createChangeFeed } from "./change-feed.js";
import type { Sql } from "../db/pool.js";
import { createExpiryTracker, type ExpiryTracker } from "./expiry-tracker.js";
import { createKeepAliveHub, type KeepAliveHub } from "./keepalive.js";
import type { LeaseStore } from "../db/lease-store.js";
import type { Limits } from "../lease/limits.js";
import type { Logger } from "../observability/logger.js";
import { createNotifier, type Notifier } from "./notifier.js";
import { withPublishing } from "./publishing-store.js";
import { createRenewalBatcher, type RenewalBatcher } from "./renewal-batcher.js";
import type { StreamTuning } from "../config/stream-config.js";
import { createWaiters, type Waiters } from "./waiters.js";
import { createWatchHub, type WatchHub } from "./watch-hub.js";

export interface Streaming {
  /** The store the services use: every committed write is published. */
  readonly store: LeaseStore;
  readonly feed: ChangeFeed;
  readonly notifier: Notifier | undefined;
  readonly tracker: ExpiryTracker;
  readonly batcher: RenewalBatcher;
  readonly keepAlive: KeepAliveHub;
  readonly watch: WatchHub;
  readonly waiters: Waiters;
  /** Stops the hubs, then publishes what is queued and stops listening. */
  close(): Promise<void>;
}

export interface StreamingOptions {
  sql: Sql;
  databaseUrl: string;
  /** The plain store; changes are published after each write commits. */
  store: LeaseStore;
  /** Decorators around the publishing store (quota, metrics). */
  wrap?: (store: LeaseStore) => LeaseStore;
  tuning: StreamTuning;
  limits: Limits;
  logger: Logger;
  statementTimeoutMs: number;
  /** Seconds from a change's commit to its arrival from another instance. */
  onRemoteChangeLag?: (seconds: number) => void;
}

export async function startStreaming(options: StreamingOptions): Promise<Streaming> {
  const { tuning, limits, logger } = options;
  const notifier = tuning.notifications
    ? createNotifier({
        url: options.databaseUrl,
        statementTimeoutMs: options.statementTimeoutMs,
        instanceId: randomUUID(),
        tickMs: tuning.notifyTickMs,
        pingIntervalMs: tuning.listenCheckIntervalMs,
        logger,
      })
    : undefined;
  const feed = createChangeFeed({
    notifier,
    logger,
    onRemoteChange: (change) => {
      // An expiry carries its deadline, not a commit time.
      if (!options.onRemoteChangeLag || change.type === "expired") return;
      const lagUs = tracker.databaseNowUs() - change.atUs;
      options.onRemoteChangeLag(Math.max(0, Number(lagUs) / 1e6));
    },
  });
  const published = withPublishing(options.store, feed);
  const store = options.wrap ? options.wrap(published) : published;
  const tracker = createExpiryTracker({ store, feed, logger });
  const batcher = createRenewalBatcher({ store, tickMs: tuning.renewTickMs });
  const keepAlive = createKeepAliveHub({
    batcher,
    feed,
    maxLeasesPerStream: limits.maxLeasesPerStream,
    maxPendingAnswers: limits.maxStreamBacklog,
  });
  const watch = createWatchHub({
    store,
    feed,
    tracker,
    logger,
    bufferLength: limits.watchBufferLength,
    recheckIntervalMs: tuning.recheckIntervalMs,
  });
  const waiters = createWaiters({
    store,
    feed,
    tracker,
    logger,
    recheckIntervalMs: tuning.recheckIntervalMs,
  });
  await tracker.start();
  keepAlive.start();
  watch.start();
  waiters.start();
  try {
    await feed.start();
  } catch (error) {
    await feed.close();
    throw error;
  }
  return {
    store,
    feed,
    notifier,
    tracker,
    batcher,
    keepAlive,
    watch,
    waiters,
    close: async () => {
      keepAlive.close();
      watch.close();
      waiters.close();
      batcher.close();
      tracker.close();
      await feed.close();
    },
  };
}
