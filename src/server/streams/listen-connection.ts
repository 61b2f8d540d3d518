// The receiving side of the notification channel (DESIGN §3, L1): one
// dedicated LISTEN connection per instance that heals itself. It hands on
// payloads as text; what they say is the payload codec's business.
//
// The connection is a one-connection postgres.js pool of its own that this
// module watches itself. postgres.js `listen()` would listen again after a
// dropped connection, but only once: if the database is still down at that
// moment (a restart), it gives up silently and the instance goes deaf until
// something else notices. Here every close of the connection (its `onclose`)
// replaces it, retrying with backoff until the database answers; then
// onListening makes every receiver resynchronise. A socket can also die
// without a close, so the whole path is checked end to end as well: a ping
// published through another connection must come back on this one, else the
// connection is replaced.

import postgres from "postgres";
import type { Logger } from "../../log/logger.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";

export interface ListenStats {
  /** Times the LISTEN connection was lost (closed, or a ping did not come back). */
  reconnects: number;
  /** Attempts to LISTEN that failed (the database unreachable, say). */
  listenFailures: number;
  /** LISTEN is in place now. */
  listening: boolean;
}

export interface ListenConnectionOptions {
  /** Connection URL for the LISTEN connection. */
  url: string;
  channel: string;
  logger: Logger;
  /** How often the connection is checked for life. */
  pingIntervalMs: number;
  /** The ping payload carrying `nonce`; it must differ for each nonce. */
  pingPayload(nonce: string): string;
  /** Publishes a payload on the channel through another connection. */
  sendPing(payload: string): Promise<void>;
  /** Counts kept up to date here (the notifier's stats object). */
  stats: ListenStats;
}

export interface ListenHandlers {
  /** A payload on the channel, other than the echo of this connection's own ping. */
  onPayload(payload: string): void;
  /** LISTEN is (again) in place. Every payload before this may have been missed. */
  onListening(): void;
  /** The connection is gone; payloads are missed until onListening. */
  onConnectionLost(): void;
}

export interface ListenConnection {
  /** Starts listening; resolves once LISTEN is first in place. */
  start(handlers: ListenHandlers): Promise<void>;
  /** Stops retrying and checking at once; close() then ends the connection. */
  stop(): void;
  /** Ends the connection, and waits for an attempt to LISTEN under way. */
  close(): Promise<void>;
}

const pingTimeoutMs = 5_000;

export function createListenConnection(options: ListenConnectionOptions): ListenConnection {
  const { channel, logger, stats } = options;
  let handlers: ListenHandlers | undefined;
  let listenSql: postgres.Sql | undefined;
  let pendingPing: { payload: string; resolve: (ok: boolean) => void } | undefined;
  let pingTimer: NodeJS.Timeout | undefined;
  let establishing: Promise<void> | undefined;
  let stopRetrying: (() => void) | undefined;
  let closed = false;

  function onNotify(payload: string) {
    if (payload === pendingPing?.payload) {
      pendingPing.resolve(true);
      return;
    }
    handlers?.onPayload(payload);
  }

  async function establish(): Promise<void> {
    for (let attempt = 0; !closed; attempt++) {
      let lost = false;
      const listenOptions = {
        max: 1,
        // Never closed for idleness or age (whatever PGIDLE_TIMEOUT says):
        // each close would resynchronise every watcher of the instance.
        idle_timeout: 0,
        max_lifetime: null,
        fetch_types: false,
        connect_timeout: 5,
        onnotice: () => {},
        connection: { application_name: "leasehold-listen" },
        onclose: () => {
          lost = true;
          replace(candidate);
        },
        // postgres.js hands every NotificationResponse to this option (its own
        // listen() is built on it); the package's types do not declare it.
        onnotify: (notified: string, payload: string) => {
          if (notified === channel) onNotify(payload);
        },
      };
      const candidate = postgres(options.url, listenOptions as postgres.Options<never>);
      try {
        await candidate.unsafe(`LISTEN ${channel}`);
        if (closed) {
          await candidate.end({ timeout: 0 });
          return;
        }
        if (lost) throw new Error("the notification connection closed as LISTEN completed");
        listenSql = candidate;
        stats.listening = true;
        handlers?.onListening();
        return;
      } catch (error) {
        await candidate.end({ timeout: 0 }).catch(() => {});
        if (closed) return;
        stats.listenFailures += 1;
        const delay = Math.min(5_000, 100 * 2 ** Math.min(attempt, 6));
        logger.warn({ err: classifyDatabaseError(error), delay }, "LISTEN failed; retrying");
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, delay);
          // stop() ends the wait: shutting down need not sit out a backoff.
          stopRetrying = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        stopRetrying = undefined;
      }
    }
  }

  function replace(current: postgres.Sql) {
    if (current !== listenSql || closed) return;
    listenSql = undefined;
    stats.listening = false;
    stats.reconnects += 1;
    current.end({ timeout: 0 }).catch(() => {});
    logger.warn("notification connection lost; listening again");
    handlers?.onConnectionLost();
    establishing ??= establish().finally(() => {
      establishing = undefined;
    });
  }

  async function ping() {
    const current = listenSql;
    // One ping at a time: a slow echo must not be mistaken for a lost one.
    if (!current || closed || pendingPing) return;
    const payload = options.pingPayload(`${Date.now()}-${Math.random()}`);
    // The echo may arrive before the publishing statement returns.
    let echoedEarly = false;
    let onEcho = (_ok: boolean) => {
      echoedEarly = true;
    };
    pendingPing = { payload, resolve: (ok) => onEcho(ok) };
    try {
      await options.sendPing(payload);
    } catch {
      // The other connection cannot publish: that says nothing about this one.
      pendingPing = undefined;
      return;
    }
    // The wait for the echo starts once the ping is published, so a slow
    // publishing connection does not count against the LISTEN connection.
    const ok =
      echoedEarly ||
      (await new Promise<boolean>((resolve) => {
        onEcho = resolve;
        setTimeout(() => resolve(false), pingTimeoutMs).unref();
      }));
    pendingPing = undefined;
    if (!ok) replace(current);
  }

  function stop() {
    closed = true;
    stopRetrying?.();
    if (pingTimer) clearInterval(pingTimer);
  }

  return {
    async start(h) {
      handlers = h;
      establishing = establish().finally(() => {
        establishing = undefined;
      });
      await establishing;
      pingTimer = setInterval(() => void ping(), options.pingIntervalMs);
      pingTimer.unref();
    },
    stop,
    async close() {
      stop();
      const current = listenSql;
      listenSql = undefined;
      stats.listening = false;
      await current?.end({ timeout: 1 });
      await establishing;
    },
  };
}
