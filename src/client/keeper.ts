// A keeper on the client (docs/keepers.md): one Keep stream carries the
// keeper's heartbeat and every operation on its leases, as requests with ids
// answered in any order.
//
// L2 for every lease on the keeper: the keeper's local deadline is the
// heartbeat's send time (monotonic) + the answer's `remaining` − the margin
// (local-deadline.ts), moved only later, and an answer that arrives after it
// revives nothing. At that deadline, on `lost`, or on close, `keeper.signal`
// aborts, and with it the signal of every run on the keeper. From then on
// nothing is sent for the keeper, not even a Close: a keeper the client can
// no longer vouch for is left to expire on the server, as a lost lease is.
//
// A keeper survives its stream: a stream that fails (an error, an end, a
// heartbeat unanswered for one heartbeat interval) is reopened over a fresh
// connection to the next configured instance, after a backoff with full
// jitter, with the same keeper id (a re-attach keeps every lease), and every
// operation still unanswered is sent again: an Acquire with its run id (an
// idempotent retry), a Release and a Get as they were.

import { randomUUID } from "node:crypto";
import { setMaxListeners } from "node:events";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import {
  type AcquireResponse,
  type GetResponse,
  type HandoffRequested,
  type Keeper as KeeperMessage,
  type KeepRequestSchema,
  type KeepResponse,
  type Lease,
  LeaseService,
  type ReleaseResponse,
} from "../gen/leasehold/v1/lease_pb.js";
import { lossCauseFromReason } from "../protocol/loss-reason.js";
import { durationFromMs, msFromDuration } from "./durations.js";
import {
  CanceledError,
  DeadlineExceededError,
  errorOfStatus,
  type LeaseholdError,
  type LeaseLossReason,
  LeaseLostError,
  type LossCause,
  toLeaseholdError,
  UnavailableError,
} from "./errors.js";
import { finalStreamError, readStream, reconnectDelay } from "./keepalive.js";
import { type LeaseTiming, leaseTiming } from "./local-deadline.js";
import { RequestQueue } from "./request-queue.js";
import {
  createLeaseContext,
  HandoffRelay,
  type LeaseContext,
  notAcquired,
  type SessionKeyInit,
} from "./run-exclusive.js";
import { createEndpoint, type Endpoint, type TransportOptions } from "./transport.js";

/** Options of `client.openKeeper`. */
export interface OpenKeeperOptions {
  /** The keeper's account; it holds leases of this account only. */
  accountId: string;
  /** The keeper's TTL in ms, within the server's TTL bounds. Every lease on it lives as long as it. */
  ttlMs: number;
  /**
   * After the keeper expires (not after a close or a revoke), none of its
   * keys is granted to another run before this has passed (K2); default 0.
   */
  lockDelayMs?: number;
  /** A label of this holder shown to others ("worker-7"). */
  holder?: string;
  /** The keeper's id (a UUID); default a new random one. Give an id only to re-attach to that keeper. */
  keeperId?: string;
  /** Subtracted from the keeper's local deadline, in ms; default TTL/10. */
  safetyMarginMs?: number;
  /** Time between heartbeats, in ms; default (TTL − margin)/3, about every 0.3 TTL. */
  heartbeatIntervalMs?: number;
  /** Cancels the open while it is in progress. */
  signal?: AbortSignal;
}

/** Options of `keeper.runExclusive` (and of `client.runExclusive` with `keeper`). */
export interface KeeperRunOptions {
  /** How long to wait for a held session to become free, in ms; default 0 (fail at once with NotAcquiredError). */
  waitMs?: number;
  /** A label of this holder shown to others; default the keeper's. */
  holder?: string;
  /** The run's id (a UUID); default a new random one. Reuse it only to retry the same run. */
  runId?: string;
  /** Cancels the run: aborts an acquire in progress, or aborts the work's signal. */
  signal?: AbortSignal;
}

/** A request of `keeper.acquire`. */
export interface KeeperAcquireInit {
  key: SessionKeyInit;
  /** The run's id; default a new random one (sent again with it after a cut stream: idempotent). */
  runId?: string;
  /** How long the server may wait for the session to become free, in ms; default 0. */
  waitMs?: number;
  /** A label of this holder; default the keeper's. */
  holder?: string;
}

/** Something that happened to a keeper's stream (for logs and tests). */
export type KeeperEvent =
  | { type: "keeper-open"; baseUrl: string; keeperId: string }
  | {
      type: "keeper-failed";
      baseUrl: string;
      keeperId: string;
      error: LeaseholdError;
      /** Delay before the next attempt; undefined when the failure is final. */
      retryInMs: number | undefined;
    }
  | { type: "keeper-closed"; baseUrl: string; keeperId: string };

/**
 * A keeper: one heartbeat keeps every lease acquired on it (K1). Made by
 * `client.openKeeper`; end it with `close()`, which releases every lease.
 */
export interface Keeper {
  /** The keeper's id (a UUID). */
  readonly id: string;
  /** The keeper's account. */
  readonly accountId: string;
  /**
   * Aborts when the client can no longer vouch for the keeper: its local
   * deadline passed without a confirmed heartbeat, the server said it is
   * lost (expired, revoked), its stream failed for good, or it was closed.
   * Its `reason` is a LeaseLostError naming which (`lossReason`). Every
   * run on the keeper aborts with it.
   */
  readonly signal: AbortSignal;
  /** The keeper as last confirmed by the server (open, heartbeat). */
  readonly state: KeeperMessage;
  /** Milliseconds until the keeper's local deadline, as of now (0 once passed). */
  remainingMs(): number;
  /**
   * Acquires a lease on this keeper over its stream. Not acquired is an
   * answer: `acquired = false` with the blocking lease in `current`, or
   * `lockDelayUntil` when a lock-delay refused it. The lease then lives as
   * long as the keeper, until `release` (or `close`); `onLeaseLost` tells of
   * an admin Revoke of it. Cancelled by `options.signal`: a waiting acquire
   * is given up on the server too (a release of its run), and a grant that
   * arrives after that is released.
   */
  acquire(request: KeeperAcquireInit, options?: { signal?: AbortSignal }): Promise<AcquireResponse>;
  /** Releases a lease of this keeper; `released = false` when it held none (idempotent). */
  release(request: { key: SessionKeyInit; runId: string }): Promise<ReleaseResponse>;
  /** The authoritative state of a session, with `lockDelayUntil` when a lock-delay keeps it. */
  get(key: SessionKeyInit): Promise<GetResponse>;
  /**
   * Calls `listener` when one lease of the keeper ends without its Release
   * (an admin Revoke of that lease). Returns a function that removes it.
   */
  onLeaseLost(
    listener: (key: SessionKeyInit, runId: string, cause: LossCause | undefined) => void,
  ): () => void;
  /**
   * Runs `work` while holding the session's lease on this keeper, as
   * `client.runExclusive` does with a lease of its own: the same context,
   * and `ctx.signal` aborts when the keeper is lost or stalls (before the
   * database deadline), when this lease alone is revoked, or when
   * `options.signal` aborts. Released when `work` settles.
   */
  runExclusive<T>(
    key: SessionKeyInit,
    work: (ctx: LeaseContext) => Promise<T> | T,
    options?: KeeperRunOptions,
  ): Promise<T>;
  /**
   * Closes the keeper (CloseKeeper): every lease on it is released, with no
   * lock-delay, and every run on it aborts first (`lossReason` `released`).
   * Resolves when the server confirmed it, or when it could not be reached
   * within the default timeout (the keeper then expires at its deadline).
   */
  close(): Promise<void>;
}

/** What a keeper needs from its client. */
export interface KeeperDeps {
  baseUrls: readonly string[];
  transport: TransportOptions;
  defaultTimeoutMs: number;
  backoffInitialMs?: number | undefined;
  backoffMaxMs?: number | undefined;
  now?: () => number;
  onEvent?: (event: KeeperEvent) => void;
  onReleaseError?: (error: LeaseholdError, key: SessionKeyInit, runId: string) => void;
}

type KeepOp = MessageInitShape<typeof KeepRequestSchema>["op"];
type KeepResult = KeepResponse["result"];

/** A request waiting for its answer; sent again on every re-attached stream until answered. */
interface Pending {
  build(): KeepOp;
  resolve(result: KeepResult): void;
  reject(error: LeaseholdError): void;
  /** The monotonic time of its last send. */
  sentAt: number;
  /** The stream generation it was last sent on (0: not sent yet). */
  sentOn: number;
  /** An open or a heartbeat: bound to its stream, never sent again. */
  ownStream?: boolean;
}

interface OpenStream {
  generation: number;
  endpoint: Endpoint;
  queue: RequestQueue<MessageInitShape<typeof KeepRequestSchema>>;
  abort: AbortController;
  /** True once the open (or re-attach) was answered. */
  attached: boolean;
}

function keyOf(key: SessionKeyInit): SessionKeyInit {
  return { accountId: key.accountId, sessionId: key.sessionId };
}

function lossMessage(cause: LossCause | undefined, detail: string): string {
  const what = cause?.replace("_", " ") ?? "no reason given";
  return `the server reports the keeper lost (${what}${detail ? `: ${detail}` : ""})`;
}

/** Codes of a request the database could not decide now; the same request may succeed later. */
const transientCodes = new Set<Code>([Code.Unavailable, Code.DeadlineExceeded]);

class KeeperSession implements Keeper {
  readonly id: string;
  readonly accountId: string;
  private last: KeeperMessage | undefined;
  private readonly controller = new AbortController();
  private readonly timing: LeaseTiming;
  private readonly now: () => number;
  private readonly pending = new Map<bigint, Pending>();
  private readonly leaseLostListeners = new Set<
    (key: SessionKeyInit, runId: string, cause: LossCause | undefined) => void
  >();
  private readonly handoffs = new Map<string, HandoffRelay>();
  private nextId = 1n;
  private stream: OpenStream | undefined;
  private generation = 0;
  private urlIndex = 0;
  private failures = 0;
  private reconnectTimer: NodeJS.Timeout | undefined;
  private heartbeatTimer: NodeJS.Timeout | undefined;
  private deadlineTimer: NodeJS.Timeout | undefined;
  /** The keeper's local deadline (monotonic ms); -Infinity until the first open is answered. */
  private deadline = Number.NEGATIVE_INFINITY;
  /** The open or heartbeat whose answer the stall watch waits for. */
  private awaited: { id: bigint; generation: number } | undefined;
  private stallTimer: NodeJS.Timeout | undefined;
  private closing: Promise<void> | undefined;
  /** Set by abandon(): the client closed; the stream is not reopened. */
  private abandoned = false;
  private opened: { resolve: () => void; reject: (error: LeaseholdError) => void } | undefined;

  constructor(
    private readonly deps: KeeperDeps,
    private readonly options: OpenKeeperOptions,
  ) {
    this.accountId = options.accountId;
    // The server keeps a keeper id as PostgreSQL prints a uuid, lower case.
    this.id = options.keeperId?.toLowerCase() ?? randomUUID();
    this.timing = leaseTiming({
      ttlMs: options.ttlMs,
      safetyMarginMs: options.safetyMarginMs,
      renewIntervalMs: options.heartbeatIntervalMs,
    });
    const lockDelayMs = options.lockDelayMs ?? 0;
    if (!(Number.isFinite(lockDelayMs) && lockDelayMs >= 0)) {
      throw new RangeError(`lockDelayMs must be 0 or more milliseconds, got ${lockDelayMs}`);
    }
    this.now = deps.now ?? (() => performance.now());
    // Every run on the keeper listens to its signal: any number is expected.
    setMaxListeners(0, this.controller.signal);
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  get state(): KeeperMessage {
    // Set by the open's answer, before openKeeper resolves.
    return this.last as KeeperMessage;
  }

  /** Opens the stream; resolves once the server answered the open. */
  open(): Promise<void> {
    const signal = this.options.signal;
    signal?.throwIfAborted();
    return new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => {
        fail(
          new UnavailableError(
            `the keeper could not be opened within ${this.deps.defaultTimeoutMs}ms`,
            Code.DeadlineExceeded,
          ),
        );
      }, this.deps.defaultTimeoutMs);
      const onAbort = () => fail(new CanceledError("the open was cancelled", Code.Canceled));
      const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
      };
      const fail = (error: LeaseholdError) => {
        done();
        this.opened = undefined;
        this.lose("renewal_failed", error.message, error);
        reject(error);
      };
      this.opened = {
        resolve: () => {
          done();
          this.opened = undefined;
          resolve();
        },
        reject: fail,
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      this.connect();
    });
  }

  remainingMs(): number {
    return Math.max(0, this.deadline - this.now());
  }

  onLeaseLost(
    listener: (key: SessionKeyInit, runId: string, cause: LossCause | undefined) => void,
  ): () => void {
    this.leaseLostListeners.add(listener);
    return () => this.leaseLostListeners.delete(listener);
  }

  acquire(
    request: KeeperAcquireInit,
    options: { signal?: AbortSignal } = {},
  ): Promise<AcquireResponse> {
    const runId = request.runId?.toLowerCase() ?? randomUUID();
    const key = keyOf(request.key);
    const waitMs = request.waitMs ?? 0;
    const firstSentAt = this.now();
    const holder = request.holder ?? this.options.holder ?? "";
    const { signal } = options;
    return new Promise<AcquireResponse>((resolve, reject) => {
      signal?.throwIfAborted();
      let abandoned = false;
      const onAbort = () => {
        abandoned = true;
        // A waiting acquire stays queued on the server until its wait runs
        // out; a release of its run gives it up there (and ends a grant that
        // raced the cancel), so a cancelled candidate leaves no waiter.
        if (waitMs > 0) void this.release({ key, runId }).catch(() => {});
        reject(new CanceledError("the acquire was cancelled", Code.Canceled));
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      this.request(
        {
          // Sent again after a cut stream with the same run id: the server's
          // answer is the same grant (same token) if the first one was made.
          build: () => {
            const left = waitMs - (this.now() - firstSentAt);
            return {
              case: "acquire",
              value: {
                key,
                runId,
                holder,
                wait: left > 0 ? durationFromMs(left) : undefined,
              },
            };
          },
          resolve: (result) => {
            signal?.removeEventListener("abort", onAbort);
            if (result.case !== "acquire") {
              reject(this.unexpected("acquire", result));
              return;
            }
            // The caller gave up while the server granted it: nobody will
            // use the lease, so it is released rather than left to the keeper.
            if (abandoned && result.value.acquired) {
              void this.release({ key, runId }).catch(() => {});
            }
            resolve(result.value);
          },
          reject: (error) => {
            // Given up (a timeout): a grant that still comes is released.
            abandoned = true;
            signal?.removeEventListener("abort", onAbort);
            reject(error);
          },
        },
        { timeoutMs: waitMs + this.deps.defaultTimeoutMs },
      );
    });
  }

  release(request: { key: SessionKeyInit; runId: string }): Promise<ReleaseResponse> {
    const key = keyOf(request.key);
    const runId = request.runId.toLowerCase();
    return new Promise((resolve, reject) => {
      this.request(
        {
          build: () => ({ case: "release", value: { key, runId } }),
          resolve: (result) =>
            result.case === "release"
              ? resolve(result.value)
              : reject(this.unexpected("release", result)),
          reject,
        },
        { timeoutMs: this.deps.defaultTimeoutMs },
      );
    });
  }

  get(key: SessionKeyInit): Promise<GetResponse> {
    const k = keyOf(key);
    return new Promise((resolve, reject) => {
      this.request(
        {
          build: () => ({ case: "get", value: { key: k } }),
          resolve: (result) =>
            result.case === "get" ? resolve(result.value) : reject(this.unexpected("get", result)),
          reject,
        },
        { timeoutMs: this.deps.defaultTimeoutMs },
      );
    });
  }

  async runExclusive<T>(
    key: SessionKeyInit,
    work: (ctx: LeaseContext) => Promise<T> | T,
    options: KeeperRunOptions = {},
  ): Promise<T> {
    options.signal?.throwIfAborted();
    this.throwIfLost();
    const runId = options.runId?.toLowerCase() ?? randomUUID();
    const sessionKey = keyOf(key);
    const response = await this.acquire(
      { key: sessionKey, runId, waitMs: options.waitMs, holder: options.holder },
      { signal: options.signal },
    );
    if (!response.acquired || !response.lease) throw notAcquired(sessionKey, response);
    // The keeper's local deadline is the lease's: a grant that arrives once
    // it has passed (or the keeper is lost) is not used; nothing is sent for
    // a keeper the client cannot vouch for, so it is not released either.
    this.checkDeadline();
    this.throwIfLost();
    const lease: Lease = response.lease;

    const controller = new AbortController();
    const handoffs = new HandoffRelay();
    this.handoffs.set(runId, handoffs);
    let lost = false;
    const lose = (reason: LeaseLossReason, message: string, cause?: unknown) => {
      if (controller.signal.aborted) return;
      lost = true;
      controller.abort(new LeaseLostError(message, reason, { cause }));
    };
    const onKeeperLost = () => {
      const reason = this.signal.reason as LeaseLostError;
      lose(reason.lossReason, `the keeper ended: ${reason.message}`, reason);
    };
    this.signal.addEventListener("abort", onKeeperLost, { once: true });
    const stopListening = this.onLeaseLost((_key, lostRunId, cause) => {
      if (lostRunId === runId) {
        lose(
          cause ?? "renewal_failed",
          `the server reports the lease lost (${cause ?? "no reason given"})`,
        );
      }
    });
    const onCallerAbort = () => {
      if (!controller.signal.aborted) controller.abort(options.signal?.reason);
    };
    options.signal?.addEventListener("abort", onCallerAbort, { once: true });

    const ctx = createLeaseContext({
      signal: controller.signal,
      fencingToken: lease.fencingToken,
      key: sessionKey,
      runId,
      lease: () => lease,
      remainingMs: () => this.remainingMs(),
      handoffs,
      checkDeadline: () => this.checkDeadline(),
    });
    try {
      return await work(ctx);
    } finally {
      options.signal?.removeEventListener("abort", onCallerAbort);
      this.signal.removeEventListener("abort", onKeeperLost);
      stopListening();
      this.handoffs.delete(runId);
      // L2: once the work has settled, nothing may present this lease again.
      if (!controller.signal.aborted) {
        controller.abort(new LeaseLostError("the run ended and released its lease", "released"));
      }
      if (!lost && !this.signal.aborted) {
        try {
          await this.release({ key: sessionKey, runId });
        } catch (error) {
          // The lease then ends with its keeper; S5 makes a late release harmless.
          this.deps.onReleaseError?.(toLeaseholdError(error), sessionKey, runId);
        }
      }
    }
  }

  close(): Promise<void> {
    if (this.closing) return this.closing;
    if (this.signal.aborted) return Promise.resolve();
    // Every run stops presenting its lease before the close releases it.
    this.end("released", "the keeper was closed, releasing every lease on it");
    this.closing = new Promise<void>((resolve) => {
      const finish = () => {
        clearTimeout(timer);
        this.shutdown();
        resolve();
      };
      const timer = setTimeout(finish, Math.min(this.deps.defaultTimeoutMs, this.timing.ttlMs));
      this.request(
        { build: () => ({ case: "close", value: {} }), resolve: finish, reject: finish },
        { whileEnding: true },
      );
    });
    return this.closing;
  }

  /** Ends every run now when the local deadline has passed by the clock (timers may be late). */
  checkDeadline(): void {
    if (this.deadline !== Number.NEGATIVE_INFINITY && this.now() >= this.deadline) {
      this.lose("deadline", "the keeper's local deadline passed without a confirmed heartbeat");
    }
  }

  private throwIfLost(): void {
    if (this.signal.aborted) throw this.signal.reason;
  }

  private unexpected(op: string, result: KeepResult): LeaseholdError {
    if (result.case === "error") return errorOfStatus(result.value);
    return new UnavailableError(
      `the server answered a ${op} with ${result.case ?? "nothing"}`,
      Code.Internal,
    );
  }

  /**
   * Queues a request; sent now when the stream is attached, else on the
   * next attach. Unanswered after `timeoutMs` (a unary call's deadline), it
   * fails with DeadlineExceededError but stays queued: its answer, when it
   * comes, still reaches `resolve` (where an acquire releases a late grant).
   */
  private request(
    pending: Omit<Pending, "sentAt" | "sentOn">,
    options: { whileEnding?: boolean; timeoutMs?: number } = {},
  ): void {
    if (this.signal.aborted && !options.whileEnding) {
      pending.reject(this.signal.reason as LeaseholdError);
      return;
    }
    if (this.abandoned) {
      pending.reject(new CanceledError("the client was closed", Code.Canceled));
      return;
    }
    const id = this.nextId++;
    const entry: Pending = { ...pending, sentAt: 0, sentOn: 0 };
    const { timeoutMs } = options;
    if (timeoutMs !== undefined) {
      const timer = setTimeout(() => {
        pending.reject(
          new DeadlineExceededError(
            `the keeper's ${pending.build()?.case ?? "request"} had no answer within ${timeoutMs}ms`,
            Code.DeadlineExceeded,
          ),
        );
      }, timeoutMs);
      entry.resolve = (result) => {
        clearTimeout(timer);
        pending.resolve(result);
      };
      entry.reject = (error) => {
        clearTimeout(timer);
        pending.reject(error);
      };
    }
    this.pending.set(id, entry);
    if (this.stream?.attached) this.send(this.stream, id, entry);
  }

  private send(stream: OpenStream, id: bigint, entry: Pending): void {
    entry.sentAt = this.now();
    entry.sentOn = stream.generation;
    stream.queue.push({ id, op: entry.build() });
  }

  private connect(): void {
    this.reconnectTimer = undefined;
    const { baseUrls } = this.deps;
    const baseUrl = baseUrls[this.urlIndex % baseUrls.length] as string;
    // A fresh connection each time: a stalled HTTP/2 session would stall
    // every new stream opened on it too.
    const endpoint = createEndpoint(baseUrl, this.deps.transport);
    const stream: OpenStream = {
      generation: ++this.generation,
      endpoint,
      queue: new RequestQueue(),
      abort: new AbortController(),
      attached: false,
    };
    this.stream = stream;
    const openId = this.nextId++;
    const sentAt = this.now();
    stream.queue.push({
      id: openId,
      op: {
        case: "open",
        value: {
          accountId: this.accountId,
          keeperId: this.id,
          holder: this.options.holder ?? "",
          ttl: durationFromMs(this.timing.ttlMs),
          lockDelay: durationFromMs(this.options.lockDelayMs ?? 0),
        },
      },
    });
    this.watchAnswer(stream, openId, sentAt);
    this.pending.set(openId, {
      build: () => ({ case: undefined }),
      sentAt,
      sentOn: stream.generation,
      ownStream: true,
      resolve: (result) => this.attached(stream, sentAt, result),
      reject: (error) => this.fail(stream.generation, error),
    });
    readStream(endpoint, LeaseService.method.keep, stream.abort.signal, stream.queue, {
      current: () => this.stream === stream,
      message: (message) => this.dispatch(message),
      fail: (error) => this.fail(stream.generation, error),
    });
  }

  private attached(stream: OpenStream, sentAt: number, result: KeepResult): void {
    if (result.case === "error") {
      const error = errorOfStatus(result.value);
      // The database could not decide it now: open again, elsewhere, after
      // the backoff, as for a failed stream.
      if (transientCodes.has(error.code)) {
        this.fail(stream.generation, error);
        return;
      }
      // The server refused the open or re-attach (the keeper ended, its id
      // belongs to another account, bad input): nothing to retry.
      this.opened?.reject(error);
      this.lose("renewal_failed", `the keeper could not be opened: ${error.message}`, error);
      return;
    }
    if (result.case !== "keeper") return;
    this.failures = 0;
    stream.attached = true;
    this.deps.onEvent?.({
      type: "keeper-open",
      baseUrl: stream.endpoint.baseUrl,
      keeperId: this.id,
    });
    this.confirm(sentAt, result.value);
    if (this.signal.aborted && !this.closing) return;
    this.opened?.resolve();
    if (!this.heartbeatTimer && !this.closing) {
      this.heartbeatTimer = setInterval(() => this.heartbeat(), this.timing.renewIntervalMs);
    }
    for (const [id, entry] of this.pending) {
      if (entry.sentOn !== stream.generation) this.send(stream, id, entry);
    }
  }

  private heartbeat(): void {
    const stream = this.stream;
    // Reconnecting: the re-attach renews the keeper when it is answered.
    if (!stream?.attached) return;
    const id = this.nextId++;
    const sentAt = this.now();
    this.pending.set(id, {
      build: () => ({ case: "heartbeat", value: {} }),
      sentAt,
      sentOn: stream.generation,
      ownStream: true,
      resolve: (result) => {
        if (result.case === "keeper") this.confirm(sentAt, result.value);
        else if (result.case === "error") {
          const error = errorOfStatus(result.value);
          // Undecided (the database busy or away): the next heartbeat tries
          // again, and the local deadline bounds how long that may go on.
          if (transientCodes.has(error.code)) return;
          this.lose("renewal_failed", `the heartbeat was refused: ${error.message}`, error);
        }
      },
      // A heartbeat is not sent again on the next stream: the re-attach is one.
      reject: () => {},
    });
    stream.queue.push({ id, op: { case: "heartbeat", value: {} } });
    this.watchAnswer(stream, id, sentAt);
  }

  /**
   * The stall watch: an open or heartbeat still unanswered after one
   * heartbeat interval means the connection is stalled (a half-open TCP
   * connection, a frozen proxy). Reconnect elsewhere, long before the
   * keeper's local deadline.
   */
  private watchAnswer(stream: OpenStream, id: bigint, sentAt: number): void {
    if (this.awaited && this.awaited.generation === stream.generation) return;
    this.awaited = { id, generation: stream.generation };
    clearTimeout(this.stallTimer);
    this.stallTimer = setTimeout(
      () => {
        const awaited = this.awaited;
        this.awaited = undefined;
        if (!awaited || this.stream !== stream || !this.pending.has(awaited.id)) return;
        this.fail(
          stream.generation,
          new UnavailableError(
            `no answer to a heartbeat within ${this.timing.renewIntervalMs}ms`,
            Code.Unavailable,
          ),
        );
      },
      Math.max(0, sentAt + this.timing.renewIntervalMs - this.now()),
    );
  }

  /** L2: a confirmed open or heartbeat moves the local deadline, later only. */
  private confirm(sentAt: number, keeper: KeeperMessage): void {
    if (this.signal.aborted) return;
    // A confirmation that arrives after the local deadline cannot revive
    // the keeper: it may have expired and its keys been taken meanwhile.
    this.checkDeadline();
    if (this.signal.aborted) return;
    this.last = keeper;
    const next = sentAt + msFromDuration(keeper.remaining) - this.timing.marginMs;
    if (next > this.deadline) {
      this.deadline = next;
      this.armDeadline();
    }
  }

  private armDeadline(): void {
    clearTimeout(this.deadlineTimer);
    this.deadlineTimer = setTimeout(
      () => {
        if (this.now() >= this.deadline) this.checkDeadline();
        else this.armDeadline();
      },
      Math.max(0, this.deadline - this.now()),
    );
  }

  private dispatch(message: KeepResponse): void {
    const { result } = message;
    if (result.case === "lost") {
      // Unasked, or as the answer to a heartbeat or a re-attach of a keeper
      // that ended: the stream ends after it, and nothing will be answered.
      const cause = lossCauseFromReason(result.value.reason);
      this.lose(cause ?? "renewal_failed", lossMessage(cause, result.value.detail));
      return;
    }
    if (message.id !== 0n) {
      const entry = this.pending.get(message.id);
      if (!entry) return;
      this.pending.delete(message.id);
      if (this.awaited?.id === message.id) this.awaited = undefined;
      entry.resolve(result);
      return;
    }
    switch (result.case) {
      case "leaseLost": {
        const { key, runId, reason } = result.value;
        if (!key) return;
        const cause = lossCauseFromReason(reason);
        for (const listener of this.leaseLostListeners) listener(keyOf(key), runId, cause);
        break;
      }
      case "handoffRequested":
        if (result.value.request) {
          this.handoffs.get(result.value.runId)?.push(result.value.request as HandoffRequested);
        }
        break;
      default:
        break;
    }
  }

  private fail(generation: number, error: LeaseholdError): void {
    const stream = this.stream;
    if (!stream || stream.generation !== generation) return;
    this.stream = undefined;
    clearTimeout(this.stallTimer);
    this.awaited = undefined;
    stream.abort.abort(error);
    stream.queue.end();
    stream.endpoint.close();
    // The open and heartbeats of this stream will not be answered; callers'
    // requests stay, and are sent again on the next stream.
    for (const [id, entry] of this.pending) if (entry.ownStream) this.pending.delete(id);
    const final = finalStreamError(error, this.deps.transport);
    if (final) {
      this.deps.onEvent?.({
        type: "keeper-failed",
        baseUrl: stream.endpoint.baseUrl,
        keeperId: this.id,
        error: final.error,
        retryInMs: undefined,
      });
      this.opened?.reject(final.error);
      this.lose(final.reason, `the Keep stream failed: ${final.error.message}`, final.error);
      this.shutdown();
      return;
    }
    const delay = reconnectDelay(this.failures, {
      backoffInitialMs: this.deps.backoffInitialMs,
      backoffMaxMs: this.deps.backoffMaxMs,
    });
    this.failures += 1;
    this.urlIndex += 1;
    this.deps.onEvent?.({
      type: "keeper-failed",
      baseUrl: stream.endpoint.baseUrl,
      keeperId: this.id,
      error,
      retryInMs: delay,
    });
    if ((this.signal.aborted && !this.closing) || this.abandoned) return;
    this.reconnectTimer = setTimeout(() => this.connect(), delay);
  }

  /** The keeper can no longer be vouched for: every run stops, nothing more is sent. */
  private lose(reason: LeaseLossReason, message: string, cause?: unknown): void {
    if (this.signal.aborted) return;
    this.end(reason, message, cause);
    this.shutdown();
  }

  /** Aborts the keeper's signal and fails every request in flight. */
  private end(reason: LeaseLossReason, message: string, cause?: unknown): void {
    const error = new LeaseLostError(message, reason, { cause });
    clearInterval(this.heartbeatTimer);
    clearTimeout(this.deadlineTimer);
    this.controller.abort(error);
    const failed = [...this.pending.values()];
    this.pending.clear();
    for (const entry of failed) entry.reject(error);
  }

  /** Stops every timer and ends the stream. */
  /**
   * The client is closing: the stream is cut and never reopened, requests
   * in flight fail, and the runs on the keeper stop at its local deadline
   * (the keeper expires on the server; close it first to release at once).
   */
  abandon(): void {
    this.abandoned = true;
    const failed = [...this.pending.values()];
    this.pending.clear();
    const error = new CanceledError("the client was closed", Code.Canceled);
    for (const entry of failed) entry.reject(error);
    this.shutdown(true);
  }

  shutdown(keepDeadline = false): void {
    clearInterval(this.heartbeatTimer);
    if (!keepDeadline) clearTimeout(this.deadlineTimer);
    clearTimeout(this.stallTimer);
    clearTimeout(this.reconnectTimer);
    this.heartbeatTimer = undefined;
    this.reconnectTimer = undefined;
    const stream = this.stream;
    if (!stream) return;
    this.stream = undefined;
    stream.queue.end();
    stream.abort.abort();
    stream.endpoint.close();
    this.deps.onEvent?.({
      type: "keeper-closed",
      baseUrl: stream.endpoint.baseUrl,
      keeperId: this.id,
    });
  }
}

/** Opens a keeper (see `LeaseClient.openKeeper`). */
export async function openKeeper(deps: KeeperDeps, options: OpenKeeperOptions): Promise<Keeper> {
  const keeper = new KeeperSession(deps, options);
  await keeper.open();
  return keeper;
}

/** Ends a keeper's stream without closing it on the server (the client is closing). */
export function abandonKeeper(keeper: Keeper): void {
  if (keeper instanceof KeeperSession) keeper.abandon();
}
