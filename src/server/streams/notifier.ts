// The notification channel between server instances (DESIGN §3): committed
// lease changes go out on one PostgreSQL channel, batched per instance per
// short tick, and come in on one dedicated LISTEN connection per instance.
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
import { classifyDatabaseError } from "../db/database-errors.js";
import { reconnectDelaySeconds } from "../db/pool.js";
import type { ChangeType, LeaseChange } from "../lease/lease-change.js";
import type { Scope } from "../lease/types.js";
import type { Logger } from "../observability/logger.js";

export const notificationChannel = "leasehold_changes";

// PostgreSQL refuses payloads of 8000 bytes or more; stay clear of it.
const maxPayloadBytes = 7_900;

export type NotifierMessage =
  | { kind: "changes"; source: string; changes: LeaseChange[] }
  /** `source` wants RENEWED changes of these scopes for `forMs` from now. */
  | { kind: "interest"; source: string; scopes: Scope[]; forMs: number }
  /** `source` (re)started listening: others should announce their interest. */
  | { kind: "hello"; source: string }
  /** `source` checks that its own LISTEN connection still receives. */
  | { kind: "ping"; source: string; nonce: string };

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

export interface NotifierStats {
  published: number;
  publishStatements: number;
  received: number;
  dropped: number;
  /** Times the LISTEN connection was lost (closed, or a ping did not come back). */
  reconnects: number;
  /** Attempts to LISTEN that failed (the database unreachable, say). */
  listenFailures: number;
  /** LISTEN is in place now. */
  listening: boolean;
}

export interface Notifier {
  /** Queues a committed change for the next publishing statement. */
  publish(change: LeaseChange): void;
  /** Queues an interest or hello message. */
  announce(message: Extract<NotifierMessage, { kind: "interest" | "hello" }>): void;
  /** Starts listening; resolves once LISTEN is first in place. */
  start(handlers: NotifierHandlers): Promise<void>;
  readonly stats: NotifierStats;
  /** Publishes what is queued, then closes the LISTEN connection. */
  close(): Promise<void>;
}

// Queued payloads kept across failed publishing statements. Past this the
// oldest are dropped: receivers recover through their timers and re-checks.
const maxQueuedPayloads = 10_000;

export function createNotifier(options: NotifierOptions): Notifier {
  const { instanceId, logger } = options;
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
  const pingIntervalMs = options.pingIntervalMs ?? 15_000;
  const pingTimeoutMs = 5_000;
  const stats: NotifierStats = {
    published: 0,
    publishStatements: 0,
    received: 0,
    dropped: 0,
    reconnects: 0,
    listenFailures: 0,
    listening: false,
  };
  let changes: LeaseChange[] = [];
  let payloads: string[] = [];
  let timer: NodeJS.Timeout | undefined;
  let flushing: Promise<void> | undefined;
  let failures = 0;
  let closed = false;

  let handlers: NotifierHandlers | undefined;
  let listenSql: postgres.Sql | undefined;
  let pendingPing: { nonce: string; resolve: (ok: boolean) => void } | undefined;
  let pingTimer: NodeJS.Timeout | undefined;
  let establishing: Promise<void> | undefined;
  let stopRetrying: (() => void) | undefined;

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

  // Every payload starts with its source; this instance's own changes
  // (delivered here already) are skipped without parsing them.
  const ownPrefix = `{"v":1,"s":${JSON.stringify(instanceId)},`;
  const ownPing = `${ownPrefix}"p":`;

  function onNotify(payload: string) {
    if (payload.startsWith(ownPrefix) && !payload.startsWith(ownPing)) return;
    const message = decodeMessage(payload);
    if (!message) {
      logger.warn({ bytes: payload.length }, "ignored a notification this version cannot read");
      return;
    }
    if (message.kind === "ping") {
      if (message.source === instanceId && message.nonce === pendingPing?.nonce) {
        pendingPing.resolve(true);
      }
      return;
    }
    if (message.source === instanceId) return;
    stats.received += message.kind === "changes" ? message.changes.length : 0;
    handlers?.onMessage(message);
  }

  // The dedicated LISTEN connection is a one-connection postgres.js pool of
  // its own that this module watches itself. postgres.js `listen()` would
  // listen again after a dropped connection, but only once: if the database
  // is still down at that moment (a restart), it gives up silently and the
  // instance goes deaf until something else notices. Here every close of the
  // connection (its `onclose`) replaces it, retrying with backoff until the
  // database answers; then onListening makes every receiver resynchronise.
  // A socket can also die without a close, so the whole path is checked end
  // to end as well: a ping published through the pool must come back on the
  // LISTEN connection, else the connection is replaced.
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
        onnotify: (channel: string, payload: string) => {
          if (channel === notificationChannel) onNotify(payload);
        },
      };
      const candidate = postgres(options.url, listenOptions as postgres.Options<never>);
      try {
        await candidate.unsafe(`LISTEN ${notificationChannel}`);
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
          // close() ends the wait: shutting down need not sit out a backoff.
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
    const nonce = `${Date.now()}-${Math.random()}`;
    // The echo may arrive before the publishing statement returns.
    let echoedEarly = false;
    let onEcho = (_ok: boolean) => {
      echoedEarly = true;
    };
    pendingPing = { nonce, resolve: (ok) => onEcho(ok) };
    try {
      await sql`SELECT pg_notify(${notificationChannel}, ${encodePing(instanceId, nonce)})`;
    } catch {
      // The pool cannot publish: that says nothing about the LISTEN connection.
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

  return {
    stats,
    publish(change) {
      if (closed) return;
      changes.push(change);
      schedule(options.tickMs);
    },
    announce(message) {
      if (closed) return;
      payloads.push(...encodeControl(instanceId, message));
      schedule(options.tickMs);
    },
    async start(h) {
      handlers = h;
      establishing = establish().finally(() => {
        establishing = undefined;
      });
      await establishing;
      pingTimer = setInterval(() => void ping(), pingIntervalMs);
      pingTimer.unref();
    },
    async close() {
      closed = true;
      stopRetrying?.();
      if (timer) {
        clearTimeout(timer);
        timer = undefined;
      }
      await flushing;
      await flush();
      if (pingTimer) clearInterval(pingTimer);
      const current = listenSql;
      listenSql = undefined;
      stats.listening = false;
      await current?.end({ timeout: 1 });
      await establishing;
      await sql.end({ timeout: 1 });
    },
  };
}

// Wire format (version 1): compact JSON arrays, so that one payload carries
// dozens of changes. bigints travel as decimal strings.
//   {"v":1,"s":source,"c":[[type,account,session,run,token,holder,at,reason,requester,event,lease]]}
//   lease: [ttlMs, acquiredAt, expiresAt, remaining] or 0
//   {"v":1,"s":source,"i":[[account,session],...],"f":forMs}
//   {"v":1,"s":source,"h":1}
//   {"v":1,"s":source,"p":nonce}
type WireLease = [string, string, string, string];
type WireChange = [
  ChangeType,
  string,
  string,
  string,
  string,
  string,
  string,
  string,
  string,
  string,
  WireLease | 0,
];

function wireChange(c: LeaseChange): WireChange {
  return [
    c.type,
    c.accountId,
    c.sessionId,
    c.runId,
    c.fencingToken.toString(),
    c.holder,
    c.atUs.toString(),
    c.reason,
    c.requesterHolder,
    c.eventId.toString(),
    c.lease
      ? [
          c.lease.ttlMs.toString(),
          c.lease.acquiredAtUs.toString(),
          c.lease.expiresAtUs.toString(),
          c.lease.remainingUs.toString(),
        ]
      : 0,
  ];
}

/** Packs changes into as few payloads as fit under PostgreSQL's limit. */
export function encodeChanges(source: string, changes: readonly LeaseChange[]): string[] {
  const head = `{"v":1,"s":${JSON.stringify(source)},"c":[`;
  const headBytes = Buffer.byteLength(head) + 2;
  const out: string[] = [];
  let parts: string[] = [];
  let bytes = headBytes;
  for (const change of changes) {
    const part = JSON.stringify(wireChange(change));
    const size = Buffer.byteLength(part) + 1;
    if (parts.length > 0 && bytes + size > maxPayloadBytes) {
      out.push(`${head}${parts.join(",")}]}`);
      parts = [];
      bytes = headBytes;
    }
    parts.push(part);
    bytes += size;
  }
  if (parts.length > 0) out.push(`${head}${parts.join(",")}]}`);
  return out;
}

function encodePing(source: string, nonce: string): string {
  return JSON.stringify({ v: 1, s: source, p: nonce });
}

function encodeControl(
  source: string,
  message: Extract<NotifierMessage, { kind: "interest" | "hello" }>,
): string[] {
  if (message.kind === "hello") return [JSON.stringify({ v: 1, s: source, h: 1 })];
  const out: string[] = [];
  let scopes: [string, string][] = [];
  const emit = () => {
    out.push(JSON.stringify({ v: 1, s: source, i: scopes, f: message.forMs }));
    scopes = [];
  };
  let bytes = 100;
  for (const s of message.scopes) {
    const size = Buffer.byteLength(JSON.stringify([s.accountId, s.sessionId])) + 1;
    if (scopes.length > 0 && bytes + size > maxPayloadBytes) {
      emit();
      bytes = 100;
    }
    scopes.push([s.accountId, s.sessionId]);
    bytes += size;
  }
  if (scopes.length > 0) emit();
  return out;
}

const changeTypes = new Set<string>([
  "acquired",
  "released",
  "expired",
  "revoked",
  "handoff_requested",
  "renewed",
]);

/** Reads a payload; undefined for anything this version does not understand. */
export function decodeMessage(payload: string): NotifierMessage | undefined {
  try {
    const m = JSON.parse(payload) as Record<string, unknown>;
    if (m.v !== 1 || typeof m.s !== "string") return undefined;
    if (m.h === 1) return { kind: "hello", source: m.s };
    if (typeof m.p === "string") return { kind: "ping", source: m.s, nonce: m.p };
    if (Array.isArray(m.i) && typeof m.f === "number") {
      const scopes = (m.i as unknown[]).map((x) => {
        const [accountId, sessionId] = x as [string, string];
        if (typeof accountId !== "string" || typeof sessionId !== "string") throw new Error();
        return { accountId, sessionId };
      });
      return { kind: "interest", source: m.s, scopes, forMs: m.f };
    }
    if (!Array.isArray(m.c)) return undefined;
    const changes = (m.c as WireChange[]).map((w): LeaseChange => {
      if (!changeTypes.has(w[0])) throw new Error(`unknown change ${w[0]}`);
      const lease = w[10];
      return {
        type: w[0],
        accountId: w[1],
        sessionId: w[2],
        runId: w[3],
        fencingToken: BigInt(w[4]),
        holder: w[5],
        atUs: BigInt(w[6]),
        reason: w[7],
        requesterHolder: w[8],
        eventId: BigInt(w[9]),
        lease: lease
          ? {
              accountId: w[1],
              sessionId: w[2],
              runId: w[3],
              fencingToken: BigInt(w[4]),
              holder: w[5],
              ttlMs: BigInt(lease[0]),
              acquiredAtUs: BigInt(lease[1]),
              expiresAtUs: BigInt(lease[2]),
              remainingUs: BigInt(lease[3]),
            }
          : undefined,
      };
    });
    return { kind: "changes", source: m.s, changes };
  } catch {
    return undefined;
  }
}
