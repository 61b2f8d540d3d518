// The notification channel between server instances (DESIGN §3): committed
// lease changes go out on one PostgreSQL channel, batched per instance per
// short tick (publish-batcher.ts, never inside a lease transaction), and come
// in on one dedicated LISTEN connection per instance that heals itself
// (listen-connection.ts); notify-codec.ts is what the payloads say. This
// module puts the three together for the change feed.

import type { LeaseChange } from "../../lease/lease-change.js";
import type { Logger } from "../../log/logger.js";
import { createListenConnection, type ListenStats } from "./listen-connection.js";
import {
  type ControlMessage,
  decodeMessage,
  encodeControl,
  encodePing,
  type NotifierMessage,
  notificationChannel,
  ownPayloadFilter,
} from "./notify-codec.js";
import { createPublishBatcher, type PublishStats } from "./publish-batcher.js";

export interface NotifierHandlers {
  onMessage(message: NotifierMessage): void;
  /** LISTEN is (again) in place. Every change before this may have been missed. */
  onListening(): void;
  /** The LISTEN connection is gone; changes are missed until onListening. */
  onConnectionLost(): void;
}

export interface NotifierOptions {
  /** Connection URL for the notifier's own connections (LISTEN, publishing). */
  url: string;
  /** statement_timeout of the publishing connection. */
  statementTimeoutMs: number;
  instanceId: string;
  /** Longest time a change waits before it is published. */
  tickMs: number;
  logger: Logger;
  /** How often the LISTEN connection is checked for life. */
  pingIntervalMs?: number;
}

export interface NotifierStats extends PublishStats, ListenStats {
  received: number;
}

export interface Notifier {
  /** Queues a committed change for the next publishing statement. */
  publish(change: LeaseChange): void;
  /** Queues an interest or hello message. */
  announce(message: ControlMessage): void;
  /** Starts listening; resolves once LISTEN is first in place. */
  start(handlers: NotifierHandlers): Promise<void>;
  readonly stats: NotifierStats;
  /** Publishes what is queued, then closes the LISTEN connection. */
  close(): Promise<void>;
}

export function createNotifier(options: NotifierOptions): Notifier {
  const { instanceId, logger } = options;
  const stats: NotifierStats = {
    published: 0,
    publishStatements: 0,
    received: 0,
    dropped: 0,
    reconnects: 0,
    listenFailures: 0,
    listening: false,
  };
  const batcher = createPublishBatcher({
    url: options.url,
    statementTimeoutMs: options.statementTimeoutMs,
    instanceId,
    tickMs: options.tickMs,
    logger,
    stats,
  });
  const listen = createListenConnection({
    url: options.url,
    channel: notificationChannel,
    logger,
    pingIntervalMs: options.pingIntervalMs ?? 15_000,
    pingPayload: (nonce) => encodePing(instanceId, nonce),
    // Through the publishing connection: the check covers the whole path.
    sendPing: (payload) => batcher.notifyNow(payload),
    stats,
  });
  const isOwn = ownPayloadFilter(instanceId);

  function onPayload(payload: string, handlers: NotifierHandlers) {
    // This instance's own changes were delivered here already.
    if (isOwn(payload)) return;
    const message = decodeMessage(payload);
    if (!message) {
      logger.warn({ bytes: payload.length }, "ignored a notification this version cannot read");
      return;
    }
    // Pings check the sender's own LISTEN connection (answered there);
    // another instance's, or a late echo of this one's, say nothing here.
    if (message.kind === "ping") return;
    if (message.source === instanceId) return;
    stats.received += message.kind === "changes" ? message.changes.length : 0;
    handlers.onMessage(message);
  }

  return {
    stats,
    publish(change) {
      batcher.publish(change);
    },
    announce(message) {
      batcher.enqueue(encodeControl(instanceId, message));
    },
    start(handlers) {
      return listen.start({
        onPayload: (payload) => onPayload(payload, handlers),
        onListening: () => handlers.onListening(),
        onConnectionLost: () => handlers.onConnectionLost(),
      });
    },
    async close() {
      listen.stop();
      await batcher.drain();
      await listen.close();
      await batcher.close();
    },
  };
}
