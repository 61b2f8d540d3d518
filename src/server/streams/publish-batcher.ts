// The publishing side of the notification channel (DESIGN §3): committed
// lease changes and control messages are queued and go out together, one
// autocommit statement per instance per short tick, on a connection of its
// own.
//
// Never NOTIFY inside the transaction that writes a lease: a transaction that
// issued NOTIFY takes a database-wide lock at commit and keeps it until the
// commit is durable, so every notifying commit in the cluster would run one at
// a time and cap acquire throughput at the commit latency. Here a change is
// published only after its own statement committed and answered, by a
// separate autocommit statement that carries every change of the last tick.
// The cost: an instance that dies between the two loses what it had not yet
// published. The receivers bound that loss (expiry timers, periodic
// re-check); see docs/streams.md.

import postgres from "postgres";
import type { LeaseChange } from "../../lease/lease-change.js";
import type { Logger } from "../../log/logger.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";
import { reconnectDelaySeconds } from "../../postgres/pool.js";
import { encodeChanges, notificationChannel } from "./notify-codec.js";

export interface PublishStats {
  /** Changes queued for publishing (sent, unless later dropped). */
  published: number;
  publishStatements: number;
  dropped: number;
}

export interface PublishBatcherOptions {
  /** Connection URL for the publishing connection. */
  url: string;
  /** statement_timeout of the publishing connection. */
  statementTimeoutMs: number;
  /** The source written into every payload. */
  instanceId: string;
  /** Longest time a change waits before it is published. */
  tickMs: number;
  logger: Logger;
  /** Counts kept up to date here (the notifier's stats object). */
  stats: PublishStats;
}

export interface PublishBatcher {
  /** Queues a committed change for the next publishing statement. */
  publish(change: LeaseChange): void;
  /** Queues payloads already encoded (control messages). */
  enqueue(payloads: readonly string[]): void;
  /** Sends one payload now, outside the batches (the LISTEN check's ping). */
  notifyNow(payload: string): Promise<void>;
  /** Stops queueing and publishes what is queued. */
  drain(): Promise<void>;
  /** Closes the publishing connection (after drain). */
  close(): Promise<void>;
}

// Queued payloads kept across failed publishing statements. Past this the
// oldest are dropped: receivers recover through their timers and re-checks.
const maxQueuedPayloads = 10_000;

export function createPublishBatcher(options: PublishBatcherOptions): PublishBatcher {
  const { instanceId, logger, stats } = options;
  // Publishing has a connection of its own, with synchronous_commit off:
  // a notification is not durable anyway (the change it reports already
  // is), so its commit need not wait for a WAL flush, and the notify lock
  // it takes at commit is held for the shortest time. Nor does it take a
  // slot of the pool that serves the lease statements.
  // (It fetches types: postgres.js needs them to send the payloads as text[].)
  const sql = postgres(options.url, {
    max: 1,
    connect_timeout: 5,
    backoff: reconnectDelaySeconds,
    onnotice: () => {},
    connection: {
      application_name: "leasehold-publish",
      synchronous_commit: "off",
      statement_timeout: options.statementTimeoutMs,
    },
  });
  let changes: LeaseChange[] = [];
  let payloads: string[] = [];
  let timer: NodeJS.Timeout | undefined;
  let flushing: Promise<void> | undefined;
  let failures = 0;
  let closed = false;

  function schedule(delayMs: number) {
    if (timer || flushing || closed) return;
    timer = setTimeout(() => {
      timer = undefined;
      flushing = flush().finally(() => {
        flushing = undefined;
        if (changes.length > 0 || payloads.length > 0) {
          schedule(failures > 0 ? Math.min(5_000, options.tickMs * 2 ** failures) : options.tickMs);
        }
      });
    }, delayMs);
  }

  async function flush(): Promise<void> {
    if (changes.length > 0) {
      payloads.push(...encodeChanges(instanceId, changes));
      stats.published += changes.length;
      changes = [];
    }
    if (payloads.length > maxQueuedPayloads) {
      stats.dropped += payloads.length - maxQueuedPayloads;
      payloads = payloads.slice(-maxQueuedPayloads);
    }
    if (payloads.length === 0) return;
    const batch = payloads;
    payloads = [];
    try {
      // One autocommit statement, so one notifying commit, per tick.
      await sql`
        SELECT count(pg_notify(${notificationChannel}, payload))
        FROM unnest(${batch}::text[]) AS payload`;
      stats.publishStatements += 1;
      failures = 0;
    } catch (error) {
      failures += 1;
      payloads = [...batch, ...payloads];
      logger.warn({ err: classifyDatabaseError(error), failures }, "publishing changes failed");
    }
  }

  return {
    publish(change) {
      if (closed) return;
      changes.push(change);
      schedule(options.tickMs);
    },
    enqueue(encoded) {
      if (closed) return;
      payloads.push(...encoded);
      schedule(options.tickMs);
    },
    async notifyNow(payload) {
      await sql`SELECT pg_notify(${notificationChannel}, ${payload})`;
    },
    async drain() {
      closed = true;
      if (timer) {
        clearTimeout(timer);
        timer = undefined;
      }
      await flushing;
      await flush();
    },
    async close() {
      await sql.end({ timeout: 1 });
    },
  };
}
