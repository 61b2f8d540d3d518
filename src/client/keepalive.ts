// One KeepAlive stream per client, shared by every lease the client keeps
// alive (DESIGN §6), and one more per `maxLeasesPerStream` leases beyond the
// first stream's share (a server bounds the leases of one stream). A stream
// opens when its first lease registers and closes when its last one leaves. When it fails — an error, an end, or a
// renewal left unanswered (a stalled connection) — it reconnects over a fresh
// connection to the next configured instance, after a backoff with full
// jitter, and re-sends a renewal for every lease (same run_id: renewals are
// idempotent). A stream the server ended because its token expired is
// reopened the same way when the client has a token function (the reopened
// stream carries a fresh token); with a fixed token its leases are lost,
// and the loss says why. One ended because its connection's client
// certificate expired is reopened too: the fresh connection presents the
// certificate files as they are now.
//
// The channel never decides that a lease is still held: it reports each
// answer with the monotonic time its request was pushed, and the lease's
// owner (runExclusive) sets its local deadline from that.
//
// A renewal the server answers `undecided` (the database did not decide it:
// a statement or lock timeout) answers that request: the stream is alive,
// so the stall watch lets it be and nothing reconnects (a slow database is
// as slow from every instance). The lease's owner is not told of it, so its
// local deadline stays where the last renewal put it; its next renewal goes
// at its usual interval, and the deadline ends the lease if the database
// stays slow (L2). The `keepalive-renewal-undecided` event says it happened.
//
// Per renewal the channel does constant work with no promise or timer of
// its own: a request is a push onto the stream's queue and one entry in
// the stall watch (one timer per stream, whatever the number of leases);
// the answers are read in one loop straight off the transport's stream,
// without connect's client wrappers (an async generator per stream that
// costs a few promises per message).

import type {
  DescMessage,
  DescMethodBiDiStreaming,
  MessageInitShape,
  MessageShape,
} from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import {
  type HandoffRequested,
  type KeepAliveRequestSchema,
  type KeepAliveResponse,
  type Lease,
  LeaseService,
} from "../gen/leasehold/v1/lease_pb.js";
import { ErrorMetadata, ErrorReason, LimitName } from "../protocol/errors.js";
import { lossCauseFromReason } from "../protocol/loss-reason.js";
import {
  errorOfStatus,
  type LeaseholdError,
  type LossCause,
  toLeaseholdError,
  UnauthenticatedError,
  UnavailableError,
} from "./errors.js";
import { RequestQueue } from "./request-queue.js";
import { createEndpoint, type Endpoint, type TransportOptions } from "./transport.js";

/** Something that happened to the client's shared KeepAlive stream (for logs and tests). */
export type KeepAliveEvent =
  | { type: "keepalive-open"; baseUrl: string }
  | {
      type: "keepalive-failed";
      baseUrl: string;
      error: LeaseholdError;
      /** Delay before the next attempt; undefined when the failure is final. */
      retryInMs: number | undefined;
    }
  | { type: "keepalive-closed"; baseUrl: string }
  | {
      /** The server did not decide one renewal (its database timed out); the stream goes on. */
      type: "keepalive-renewal-undecided";
      baseUrl: string;
      key: { accountId: string; sessionId: string };
      runId: string;
      /** The answer's status as an error: UNAVAILABLE, reason DATABASE_UNAVAILABLE, its `sql_state`. */
      error: LeaseholdError;
    };

/** A lease kept alive on the shared stream, and where its answers go. */
export interface KeepAliveTarget {
  readonly key: { readonly accountId: string; readonly sessionId: string };
  readonly runId: string;
  /** A renewal unanswered for this long means the stream is stalled. */
  readonly responseTimeoutMs: number;
  /** A renewal succeeded. `sentAt` is the monotonic time its request was pushed (undefined for an unsolicited answer). */
  onRenewed(lease: Lease, sentAt: number | undefined): void;
  /** The server will never renew this run again. */
  onLost(cause: LossCause | undefined): void;
  /** Someone asked this run to finish and release. */
  onHandoffRequested(request: HandoffRequested): void;
  /**
   * The stream failed in a way retrying cannot fix: `token_expired` when the
   * server ended it because the client's fixed token expired (a fixed token
   * cannot be renewed), `renewal_failed` otherwise (e.g. PERMISSION_DENIED).
   */
  onFailed(error: LeaseholdError, reason: "token_expired" | "renewal_failed"): void;
}

/** The handle of a registered lease. */
export interface KeepAliveRegistration {
  /** Sends a renewal now (queued until the stream is back if it is reconnecting). */
  renew(): void;
  /** Stops keeping the lease alive. */
  remove(): void;
  /**
   * Resolves once no renewal of this lease is unanswered: its answers came,
   * it was lost, or its stream failed (the stall watch bounds the wait by
   * the response timeout). A run waits for it before its Release, so that
   * its own renewal, still on the way, is never refused as "released" and
   * counted by the server as a lost lease.
   */
  settled(): Promise<void>;
}

/** Where and how the channel connects, and how it backs off. */
export interface KeepAliveChannelOptions {
  /** Instances to connect to, in turn: each reconnect moves to the next one. */
  baseUrls: readonly string[];
  /** Protocol, token and interceptors, as for the client's other calls. */
  transport: TransportOptions;
  /** First reconnect delay bound, in ms; default 100. */
  backoffInitialMs?: number;
  /** Largest reconnect delay bound, in ms; default 2 000. */
  backoffMaxMs?: number;
  /** The monotonic clock; default performance.now. */
  now?: () => number;
  /** Told when the stream opens, fails or closes. */
  onEvent?: (event: KeepAliveEvent) => void;
  /**
   * Leases one stream carries; the channel opens another stream for the
   * ones beyond. Default 1,000, the server's default --max-leases-per-stream;
   * a server's lower bound, met once, lowers it.
   */
  maxLeasesPerStream?: number;
}

interface Entry {
  target: KeepAliveTarget;
  /** Push times of renewals not yet answered on the current stream, oldest first. */
  outstanding: number[];
  /**
   * Renewals sent on the current stream. Answers take push times off
   * `outstanding` oldest first, so request n is answered once
   * sent − outstanding.length ≥ n.
   */
  sent: number;
  /** False once the entry left the channel: its requests no longer count as stalled. */
  active: boolean;
  /** Waiting for `outstanding` to empty (settled()). */
  onSettled: (() => void)[];
}

/** Tells whoever waits on settled() that no renewal of the entry is on the way any more. */
function settle(entry: Entry): void {
  if (entry.onSettled.length === 0) return;
  const waiting = entry.onSettled;
  entry.onSettled = [];
  for (const resolve of waiting) resolve();
}

interface OpenStream {
  generation: number;
  endpoint: Endpoint;
  queue: RequestQueue<MessageInitShape<typeof KeepAliveRequestSchema>>;
  abort: AbortController;
  stalls: StallWatch;
}

/** A renewal request waiting for its answer. */
interface Sent {
  entry: Entry;
  /** Its number among the entry's requests on this stream. */
  n: number;
  dueAt: number;
}

/**
 * The renewals of one stream still unanswered, and one timer for the
 * earliest due. Requests are kept in the order sent, one FIFO per response
 * timeout (leases share one in practice), so each FIFO's head is its
 * earliest due; an answered request leaves when it reaches a head.
 */
class StallWatch {
  private readonly byTimeout = new Map<number, { items: (Sent | undefined)[]; head: number }>();
  private timer: NodeJS.Timeout | undefined;
  private timerAt = Number.POSITIVE_INFINITY;

  constructor(
    private readonly now: () => number,
    private readonly onStalled: (sent: Sent) => void,
  ) {}

  add(entry: Entry, n: number, sentAt: number): void {
    const timeoutMs = entry.target.responseTimeoutMs;
    let fifo = this.byTimeout.get(timeoutMs);
    if (!fifo) {
      fifo = { items: [], head: 0 };
      this.byTimeout.set(timeoutMs, fifo);
    }
    const dueAt = sentAt + timeoutMs;
    fifo.items.push({ entry, n, dueAt });
    if (dueAt < this.timerAt) this.arm(dueAt);
  }

  stop(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    this.timerAt = Number.POSITIVE_INFINITY;
    this.byTimeout.clear();
  }

  private arm(at: number): void {
    clearTimeout(this.timer);
    this.timerAt = at;
    this.timer = setTimeout(() => this.check(), Math.max(0, at - this.now()));
    this.timer.unref();
  }

  private check(): void {
    this.timer = undefined;
    this.timerAt = Number.POSITIVE_INFINITY;
    const now = this.now();
    let next = Number.POSITIVE_INFINITY;
    for (const fifo of this.byTimeout.values()) {
      while (fifo.head < fifo.items.length) {
        const sent = fifo.items[fifo.head] as Sent;
        const { entry } = sent;
        if (!entry.active || entry.sent - entry.outstanding.length >= sent.n) {
          fifo.items[fifo.head] = undefined;
          fifo.head += 1;
          continue;
        }
        if (sent.dueAt <= now) {
          this.onStalled(sent);
          return;
        }
        next = Math.min(next, sent.dueAt);
        break;
      }
      if (fifo.head === fifo.items.length) {
        fifo.items.length = 0;
        fifo.head = 0;
      } else if (fifo.head >= 1024 && fifo.head * 2 >= fifo.items.length) {
        fifo.items.splice(0, fifo.head);
        fifo.head = 0;
      }
    }
    if (next !== Number.POSITIVE_INFINITY) this.arm(next);
  }
}

// Codes after which sending the same renewals again cannot succeed.
const definitiveCodes = new Set<Code>([
  Code.InvalidArgument,
  Code.Unauthenticated,
  Code.PermissionDenied,
  Code.Unimplemented,
  Code.FailedPrecondition,
]);

function entryId(key: { accountId: string; sessionId: string }, runId: string): string {
  return JSON.stringify([key.accountId, key.sessionId, runId]);
}

/**
 * The server's --max-leases-per-stream when `error` is the RESOURCE_EXHAUSTED
 * of a stream that carried more (its LIMIT_EXCEEDED detail); else undefined.
 */
function leasesPerStreamLimit(error: LeaseholdError): number | undefined {
  if (error.code !== Code.ResourceExhausted || error.reason !== ErrorReason.limitExceeded) {
    return undefined;
  }
  if (error.metadata[ErrorMetadata.limit] !== LimitName.leasesPerStream) return undefined;
  const max = Number(error.metadata[ErrorMetadata.max]);
  return Number.isInteger(max) && max >= 1 ? max : undefined;
}

/**
 * The error that ends every lease of a stream (a KeepAlive lane, a
 * keeper's Keep stream), or undefined when the stream is worth reopening.
 * The server ends a stream when its token expires: with a token function
 * the reopened stream carries a fresh token, and the leases go on; a fixed
 * token cannot be renewed, so they are lost, with the reason
 * `token_expired` and an error that says why.
 */
export function finalStreamError(
  error: LeaseholdError,
  transport: TransportOptions,
): { error: LeaseholdError; reason: "token_expired" | "renewal_failed" } | undefined {
  if (!definitiveCodes.has(error.code)) return undefined;
  // The connection's client certificate expired: the stream reopens over
  // a fresh connection, which presents the certificate files as they are
  // now (a rotation tool has written the next one by then).
  if (
    error instanceof UnauthenticatedError &&
    error.failure === "certificate_expired" &&
    transport.tls?.certFile !== undefined
  ) {
    return undefined;
  }
  if (!(error instanceof UnauthenticatedError) || error.failure !== "expired") {
    return { error, reason: "renewal_failed" };
  }
  if (typeof transport.token === "function") return undefined;
  return {
    error: new UnauthenticatedError(
      "the token expired, and a fixed token cannot be renewed: pass a token function (token: () => …) to keep leases past a token's expiry",
      error.code,
      { cause: error, reason: error.reason, metadata: { ...error.metadata } },
    ),
    reason: "token_expired",
  };
}

/**
 * The delay before reconnecting after `failures` failures in a row: full
 * jitter under an exponential bound, so that many clients cut off by one
 * instance's death do not all land on the next instance at the same instant.
 */
export function reconnectDelay(
  failures: number,
  options: { backoffInitialMs?: number | undefined; backoffMaxMs?: number | undefined },
): number {
  const initial = options.backoffInitialMs ?? 100;
  const max = options.backoffMaxMs ?? 2_000;
  return Math.random() * Math.min(max, initial * 2 ** Math.min(failures, 20));
}

/**
 * Reads one bidirectional stream's answers in one loop, straight off the
 * transport. `current` says whether the stream is still the owner's (a
 * stream replaced by a reconnect is read no more); an error or an end of
 * the current stream is reported to `fail`, an end as UNAVAILABLE.
 */
export function readStream<I extends DescMessage, O extends DescMessage>(
  endpoint: Endpoint,
  method: DescMethodBiDiStreaming<I, O>,
  signal: AbortSignal,
  requests: AsyncIterable<MessageInitShape<I>>,
  handlers: {
    current(): boolean;
    message(message: MessageShape<O>): void;
    fail(error: LeaseholdError): void;
  },
): void {
  void (async () => {
    try {
      const response = await endpoint.transport.stream(method, signal, 0, undefined, requests);
      for await (const message of response.message) {
        if (!handlers.current()) return;
        handlers.message(message);
      }
      if (handlers.current()) {
        handlers.fail(
          new UnavailableError(`the server ended the ${method.name} stream`, Code.Unavailable),
        );
      }
    } catch (error) {
      if (handlers.current()) handlers.fail(toLeaseholdError(error));
    } finally {
      endpoint.close();
    }
  })();
}

/** One self-reconnecting KeepAlive stream and the leases it carries. */
class KeepAliveLane {
  private readonly entries = new Map<string, Entry>();
  private readonly now: () => number;
  private stream: OpenStream | undefined;
  private generation = 0;
  private urlIndex = 0;
  private failures = 0;
  private reconnectTimer: NodeJS.Timeout | undefined;
  private closed = false;

  constructor(
    private readonly options: KeepAliveChannelOptions,
    /** Told, before the lane reconnects, that the server carries at most `max` leases per stream. */
    private readonly onStreamLimit: (lane: KeepAliveLane, max: number) => void,
  ) {
    if (options.baseUrls.length === 0) throw new RangeError("at least one base URL is required");
    this.now = options.now ?? (() => performance.now());
  }

  /** Leases on this lane. */
  get size(): number {
    return this.entries.size;
  }

  has(id: string): boolean {
    return this.entries.has(id);
  }

  /** Whether a stream is open (not closed, not waiting to reconnect). */
  get connected(): boolean {
    return this.stream !== undefined;
  }

  /** The ids of the leases on this lane, in the order they registered. */
  ids(): string[] {
    return [...this.entries.keys()];
  }

  /**
   * Takes a lease off this lane (to be registered on another) without
   * telling its owner; its requests no longer count as stalled here.
   */
  detach(id: string): void {
    const entry = this.entries.get(id);
    if (!entry) return;
    entry.active = false;
    this.entries.delete(id);
    settle(entry);
    if (this.entries.size === 0) this.shutdown();
  }

  /** Starts keeping a lease alive; the first renewal is sent when the stream (re)opens or on `renew()`. */
  register(target: KeepAliveTarget): KeepAliveRegistration {
    if (this.closed) throw new Error("the client is closed");
    const id = entryId(target.key, target.runId);
    const replaced = this.entries.get(id);
    if (replaced) replaced.active = false;
    const entry: Entry = { target, outstanding: [], sent: 0, active: true, onSettled: [] };
    this.entries.set(id, entry);
    if (!this.stream && !this.reconnectTimer) this.open();
    return {
      renew: () => {
        if (this.entries.get(id) === entry) this.send(entry);
      },
      remove: () => {
        if (this.entries.get(id) !== entry) return;
        entry.active = false;
        this.entries.delete(id);
        settle(entry);
        if (this.entries.size === 0) this.shutdown();
      },
      settled: () =>
        this.entries.get(id) !== entry || !this.stream || entry.outstanding.length === 0
          ? Promise.resolve()
          : new Promise<void>((resolve) => entry.onSettled.push(resolve)),
    };
  }

  /** Ends the stream and forgets every lease (their owners stop on their own deadlines). */
  close(): void {
    this.closed = true;
    this.forgetAll();
    this.shutdown();
  }

  private send(entry: Entry): void {
    const stream = this.stream;
    if (!stream) return; // reconnecting: the reopened stream renews every lease
    const sentAt = this.now();
    entry.outstanding.push(sentAt);
    entry.sent += 1;
    stream.queue.push({ key: entry.target.key, runId: entry.target.runId });
    stream.stalls.add(entry, entry.sent, sentAt);
  }

  /** Drops every lease; their requests no longer count as stalled. */
  private forgetAll(): void {
    for (const entry of this.entries.values()) {
      entry.active = false;
      settle(entry);
    }
    this.entries.clear();
  }

  private open(): void {
    this.reconnectTimer = undefined;
    const baseUrl = this.options.baseUrls[this.urlIndex % this.options.baseUrls.length] as string;
    // A fresh connection each time: a stalled HTTP/2 session would stall
    // every new stream opened on it too.
    const endpoint = createEndpoint(baseUrl, this.options.transport);
    const generation = ++this.generation;
    const stream: OpenStream = {
      generation,
      endpoint,
      queue: new RequestQueue(),
      abort: new AbortController(),
      // Still unanswered on the same stream: the connection is stalled (a
      // half-open TCP connection, a frozen proxy). Reconnect elsewhere.
      stalls: new StallWatch(this.now, (sent) =>
        this.fail(
          generation,
          new UnavailableError(
            `no answer to a renewal within ${sent.entry.target.responseTimeoutMs}ms`,
            Code.Unavailable,
          ),
        ),
      ),
    };
    this.stream = stream;
    this.options.onEvent?.({ type: "keepalive-open", baseUrl });
    for (const entry of this.entries.values()) {
      entry.outstanding = [];
      entry.sent = 0;
      this.send(entry);
    }
    readStream(endpoint, LeaseService.method.keepAlive, stream.abort.signal, stream.queue, {
      current: () => this.stream === stream,
      message: (message) => this.dispatch(stream, message),
      fail: (error) => this.fail(stream.generation, error),
    });
  }

  private dispatch(stream: OpenStream, response: KeepAliveResponse): void {
    if (!response.key) return;
    const id = entryId(response.key, response.runId);
    const entry = this.entries.get(id);
    if (!entry) return;
    const result = response.result;
    switch (result.case) {
      case "lease": {
        // The answer to the oldest unanswered request; taking the oldest push
        // time can only make the owner's deadline earlier, never later.
        const sentAt = entry.outstanding.shift();
        this.failures = 0;
        entry.target.onRenewed(result.value, sentAt);
        if (entry.outstanding.length === 0) settle(entry);
        break;
      }
      case "lost":
        entry.active = false;
        this.entries.delete(id);
        settle(entry);
        entry.target.onLost(lossCauseFromReason(result.value.reason));
        if (this.entries.size === 0) this.shutdown();
        break;
      case "handoffRequested":
        entry.target.onHandoffRequested(result.value);
        break;
      case "undecided": {
        // Answered, so not stalled; the lease's deadline does not move.
        entry.outstanding.shift();
        this.failures = 0;
        if (entry.outstanding.length === 0) settle(entry);
        this.options.onEvent?.({
          type: "keepalive-renewal-undecided",
          baseUrl: stream.endpoint.baseUrl,
          key: { accountId: response.key.accountId, sessionId: response.key.sessionId },
          runId: response.runId,
          error: errorOfStatus(result.value),
        });
        break;
      }
      default:
        break;
    }
  }

  private fail(generation: number, error: LeaseholdError): void {
    const stream = this.stream;
    if (!stream || stream.generation !== generation) return;
    this.stream = undefined;
    stream.stalls.stop();
    stream.abort.abort(error);
    // Renewals sent on this stream will not be answered.
    for (const entry of this.entries.values()) settle(entry);
    stream.queue.end();
    stream.endpoint.close();
    const final = finalStreamError(error, this.options.transport);
    if (final) {
      error = final.error;
      const failed = [...this.entries.values()];
      this.forgetAll();
      for (const entry of failed) entry.target.onFailed(error, final.reason);
      this.options.onEvent?.({
        type: "keepalive-failed",
        baseUrl: stream.endpoint.baseUrl,
        error,
        retryInMs: undefined,
      });
      return;
    }
    const delay = reconnectDelay(this.failures, this.options);
    this.failures += 1;
    this.urlIndex += 1;
    // The timer first: a lease registered on this lane from here on (by the
    // event's listener, or moved here below) waits for it instead of
    // opening a second stream at once.
    if (this.entries.size > 0 && !this.closed) {
      this.reconnectTimer = setTimeout(() => this.open(), delay);
    }
    this.options.onEvent?.({
      type: "keepalive-failed",
      baseUrl: stream.endpoint.baseUrl,
      error,
      retryInMs: delay,
    });
    if (!this.reconnectTimer) return;
    // The server carries fewer leases per stream than this lane had: the
    // channel moves the ones beyond its bound to other streams before this
    // one reconnects, so that it is not refused again.
    const limit = leasesPerStreamLimit(error);
    if (limit !== undefined) this.onStreamLimit(this, limit);
  }

  private shutdown(): void {
    if (this.reconnectTimer) {
      clearTimeout(this.reconnectTimer);
      this.reconnectTimer = undefined;
    }
    const stream = this.stream;
    if (!stream) return;
    this.stream = undefined;
    stream.stalls.stop();
    // Half-close so the server ends the stream cleanly; cut it if it does not.
    stream.queue.end();
    const cut = setTimeout(() => {
      stream.abort.abort();
      stream.endpoint.close();
    }, 1_000);
    cut.unref();
    this.options.onEvent?.({ type: "keepalive-closed", baseUrl: stream.endpoint.baseUrl });
  }
}

/**
 * The KeepAlive streams of one client, shared by every lease it keeps
 * alive: one stream, and one more for each `maxLeasesPerStream` leases
 * beyond it. A server ends a stream that carries more than its
 * --max-leases-per-stream with RESOURCE_EXHAUSTED, after which none of the
 * stream's leases would be renewed; each lane reconnects on its own. That
 * answer names the server's bound (a LIMIT_EXCEEDED detail): the channel
 * lowers its own to it and moves the leases beyond it to other streams.
 */
export class KeepAliveChannel {
  private readonly lanes: KeepAliveLane[] = [];
  /** Where each registered lease is kept alive, by key and run. */
  private readonly placed = new Map<string, Placement>();
  private maxPerLane: number;
  private closed = false;

  constructor(private readonly options: KeepAliveChannelOptions) {
    if (options.baseUrls.length === 0) throw new RangeError("at least one base URL is required");
    this.maxPerLane = options.maxLeasesPerStream ?? 1_000;
    if (!Number.isInteger(this.maxPerLane) || this.maxPerLane < 1) {
      throw new RangeError(
        `maxLeasesPerStream must be a whole number of at least 1, got ${options.maxLeasesPerStream}`,
      );
    }
  }

  /** Starts keeping a lease alive; the first renewal is sent when its stream (re)opens or on `renew()`. */
  register(target: KeepAliveTarget): KeepAliveRegistration {
    if (this.closed) throw new Error("the client is closed");
    const id = entryId(target.key, target.runId);
    // A lease registered again replaces itself on the lane it is on.
    const lane = this.placed.get(id)?.lane ?? this.laneWithRoom();
    const placement: Placement = { target, lane, registration: lane.register(target) };
    this.placed.set(id, placement);
    return {
      renew: () => {
        if (this.placed.get(id) === placement) placement.registration.renew();
      },
      remove: () => {
        if (this.placed.get(id) !== placement) return;
        placement.registration.remove();
        this.placed.delete(id);
      },
      settled: () =>
        this.placed.get(id) === placement ? placement.registration.settled() : Promise.resolve(),
    };
  }

  /** Ends every stream and forgets every lease (their owners stop on their own deadlines). */
  close(): void {
    this.closed = true;
    for (const lane of this.lanes) lane.close();
    this.placed.clear();
  }

  private laneWithRoom(): KeepAliveLane {
    let lane = this.lanes.find((l) => l.size < this.maxPerLane);
    if (!lane) {
      lane = new KeepAliveLane(this.options, (refused, max) => this.lowerLimit(refused, max));
      this.lanes.push(lane);
    }
    return lane;
  }

  /**
   * A server carries at most `max` leases per stream and refused `refused`
   * for carrying more: new leases go `max` to a stream from now on, and the
   * refused lane keeps its first `max`; the rest move to lanes with room
   * (new streams), renewed at once there. Other lanes over the bound are
   * trimmed when the server refuses them in turn: leases a stream has sent
   * still count on the server's side, so a lane trimmed before its refusal
   * would only be refused later.
   */
  private lowerLimit(refused: KeepAliveLane, max: number): void {
    if (this.closed) return;
    this.maxPerLane = Math.min(this.maxPerLane, max);
    for (const id of refused.ids().slice(this.maxPerLane)) {
      const placement = this.placed.get(id);
      refused.detach(id);
      if (!placement) continue;
      const lane = this.laneWithRoom();
      // A lane that opens for this lease sends its renewal as it opens.
      const connected = lane.connected;
      placement.lane = lane;
      placement.registration = lane.register(placement.target);
      if (connected) placement.registration.renew();
    }
  }
}

/** The lane a lease is on, and its registration there. */
interface Placement {
  readonly target: KeepAliveTarget;
  lane: KeepAliveLane;
  registration: KeepAliveRegistration;
}
