// The lease client: one typed method per LeaseService RPC, errors mapped to
// typed classes, failover across instances, and runExclusive over the
// client's one shared KeepAlive stream.

import { randomUUID } from "node:crypto";
import {
  create,
  type DescMessage,
  type DescMethodStreaming,
  type MessageInitShape,
  type MessageShape,
} from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import {
  type CallOptions,
  createClient,
  type StreamResponse,
  type Transport,
} from "@connectrpc/connect";
import {
  type AcquireRequestSchema,
  type AcquireResponse,
  type CheckFenceRequestSchema,
  type CheckFenceResponse,
  type GetRequestSchema,
  type GetResponse,
  type HistoryRequestSchema,
  type HistoryResponse,
  type KeepAliveRequestSchema,
  type KeepAliveResponse,
  LeaseService,
  type ListRequestSchema,
  type ListResponse,
  type ReleaseRequestSchema,
  type ReleaseResponse,
  type RenewRequestSchema,
  type RenewResponse,
  type RequestHandoffRequestSchema,
  type RequestHandoffResponse,
  type RevokeRequestSchema,
  type RevokeResponse,
  type WatchRequestSchema,
  type WatchResponse,
} from "../gen/leasehold/v1/lease_pb.js";
import { msFromDuration } from "./durations.js";
import { type LeaseholdError, toLeaseholdError } from "./errors.js";
import { KeepAliveChannel, type KeepAliveEvent } from "./keepalive.js";
import {
  abandonKeeper,
  type Keeper,
  type KeeperEvent,
  type KeeperRunOptions,
  type OpenKeeperOptions,
  openKeeper,
} from "./keeper.js";
import {
  type LeaseContext,
  type RunExclusiveOptions,
  runExclusive,
  type SessionKeyInit,
} from "./run-exclusive.js";
import {
  createEndpoint,
  type FailoverEvent,
  failoverTransport,
  type TransportOptions,
} from "./transport.js";

/** Something the client did in the background, for logs and diagnostics. */
export type ClientEvent =
  | KeepAliveEvent
  | KeeperEvent
  | FailoverEvent
  | { type: "release-failed"; key: SessionKeyInit; runId: string; error: LeaseholdError };

/** Options of `createLeaseClient`. Give `baseUrl` or `baseUrls`. */
export interface LeaseClientOptions extends TransportOptions {
  /** The server, e.g. "http://127.0.0.1:7070". */
  baseUrl?: string;
  /**
   * Several instances of the same service (on one database). Unary calls
   * fail over in order, and an idempotent one then tries each instance once
   * more (with one base URL too), within its deadline (`failoverTransport`);
   * the KeepAlive stream reconnects to the next one.
   */
  baseUrls?: readonly string[];
  /** Reports background events: stream reconnects, unary failovers, failed releases. */
  onEvent?: (event: ClientEvent) => void;
  /** Bounds of the KeepAlive reconnect backoff (full jitter), in ms; default 100 and 2 000. */
  reconnectBackoff?: { initialMs?: number; maxMs?: number };
  /**
   * Leases kept alive on one KeepAlive stream; beyond it the client opens
   * another stream. Default 1,000, the server's default
   * `--max-leases-per-stream`. A server with a lower bound refuses the
   * stream that passes it, naming the bound; the client then lowers this to
   * it and moves the leases beyond it to other streams. Set it to the
   * server's value to avoid that one refused stream.
   */
  maxLeasesPerStream?: number;
}

/** Request shapes of the client's methods: plain objects, as in `create(Schema, init)`. */
export type AcquireInit = MessageInitShape<typeof AcquireRequestSchema>;
/** Request of `renew`. */
export type RenewInit = MessageInitShape<typeof RenewRequestSchema>;
/** Request of `release`. */
export type ReleaseInit = MessageInitShape<typeof ReleaseRequestSchema>;
/** Request of `get`. */
export type GetInit = MessageInitShape<typeof GetRequestSchema>;
/** Request of `list`. */
export type ListInit = MessageInitShape<typeof ListRequestSchema>;
/** One request on a KeepAlive stream. */
export type KeepAliveInit = MessageInitShape<typeof KeepAliveRequestSchema>;
/** Request of `watch`. */
export type WatchInit = MessageInitShape<typeof WatchRequestSchema>;
/** Request of `requestHandoff`. */
export type RequestHandoffInit = MessageInitShape<typeof RequestHandoffRequestSchema>;
/** Request of `history`. */
export type HistoryInit = MessageInitShape<typeof HistoryRequestSchema>;
/** Request of `checkFence`. */
export type CheckFenceInit = MessageInitShape<typeof CheckFenceRequestSchema>;
/** Request of `revoke`. */
export type RevokeInit = MessageInitShape<typeof RevokeRequestSchema>;

/**
 * A client of LeaseService. Every method throws a LeaseholdError subclass
 * (see errors.ts) with the original error as `cause`.
 */
export interface LeaseClient {
  /** The configured server base URLs, in failover order. */
  readonly baseUrls: readonly string[];
  /**
   * Acquire: grants the lease when the session is free. Not acquired is an
   * answer, not an error: `acquired = false` with the blocking lease in
   * `current`. A missing run_id is filled with a new UUID, so that a retry
   * (on another instance too) is idempotent. With `wait`, the call's
   * timeout is extended by the wait.
   */
  acquire(request: AcquireInit, options?: CallOptions): Promise<AcquireResponse>;
  /** Renew: extends run_id's valid lease; LeaseNotHeldError (with `lossCause`) when it is not held. */
  renew(request: RenewInit, options?: CallOptions): Promise<RenewResponse>;
  /** Release: ends run_id's valid lease; `released = false` when it held none (idempotent). */
  release(request: ReleaseInit, options?: CallOptions): Promise<ReleaseResponse>;
  /** Get: the authoritative state of one session. */
  get(request: GetInit, options?: CallOptions): Promise<GetResponse>;
  /** List: the valid leases of an account, a page at a time. */
  list(request: ListInit, options?: CallOptions): Promise<ListResponse>;
  /**
   * KeepAlive, raw: renews the leases named by `requests` over one stream.
   * `runExclusive` manages a shared stream for you; use this only to build
   * your own keep-alive logic. No timeout unless `options.timeoutMs` is set.
   */
  keepAlive(
    requests: AsyncIterable<KeepAliveInit>,
    options?: CallOptions,
  ): AsyncIterable<KeepAliveResponse>;
  /**
   * Watch: a snapshot of one session (or of every session of the account
   * when `key.sessionId` is empty), then every change. No timeout unless
   * `options.timeoutMs` is set; end it with `options.signal`.
   */
  watch(request: WatchInit, options?: CallOptions): AsyncIterable<WatchResponse>;
  /** RequestHandoff: asks the current holder to finish and release; `delivered = false` when nobody held it. */
  requestHandoff(
    request: RequestHandoffInit,
    options?: CallOptions,
  ): Promise<RequestHandoffResponse>;
  /** History: the audit trail of one session, newest first. */
  history(request: HistoryInit, options?: CallOptions): Promise<HistoryResponse>;
  /** CheckFence: whether a token is the session's valid lease's, and the highest granted. */
  checkFence(request: CheckFenceInit, options?: CallOptions): Promise<CheckFenceResponse>;
  /** Revoke: ends the session's valid lease whatever its run (admin scope). */
  revoke(request: RevokeInit, options?: CallOptions): Promise<RevokeResponse>;
  /**
   * Runs `work` while this client holds the session's lease, and returns its
   * result.
   *
   * Acquires (waiting up to `waitMs` if asked), keeps the lease alive on the
   * client's one shared KeepAlive stream (renewing about every TTL/3 by default),
   * and calls `work` with a LeaseContext. `ctx.signal` aborts when the
   * stream says the lease is lost, when renewals fail, when the local
   * deadline passes without a confirmed renewal (L2), or when
   * `options.signal` aborts. The lease is released when `work` settles —
   * returned, thrown or aborted — and `ctx.signal` is aborted then too, so
   * nothing presents the lease afterwards.
   *
   * Throws NotAcquiredError (with the blocking lease in `current`) when the
   * session is held elsewhere, and LateGrantError (a NotAcquiredError) when
   * the grant arrived after its own local deadline (it is released).
   */
  runExclusive<T>(
    key: SessionKeyInit,
    work: (ctx: LeaseContext) => Promise<T> | T,
    options?: RunExclusiveOptions | (KeeperRunOptions & { keeper: Keeper }),
  ): Promise<T>;
  /**
   * Opens a keeper (docs/keepers.md): one Keep stream whose heartbeat, every
   * TTL/3 or so, keeps every lease acquired on it, with one row written per
   * heartbeat whatever their number. Resolves once the server opened it (or
   * re-attached to the keeper `keeperId`, keeping its leases). Its local
   * deadline (L2) is each heartbeat's send time + the answer's `remaining` −
   * the margin: when heartbeats stall, `keeper.signal` and every run on it
   * abort before the database deadline. A cut stream or a stopped instance
   * re-attaches to the same keeper on any configured instance. Leases are
   * held with `keeper.runExclusive` (or `runExclusive(key, work, { keeper })`)
   * or `keeper.acquire`; `keeper.close()` releases them all.
   */
  openKeeper(options: OpenKeeperOptions): Promise<Keeper>;
  /**
   * Ends the KeepAlive stream, every keeper's stream and every connection.
   * Runs in progress then stop at their local deadline; keepers are not
   * closed on the server (they expire), so close them first.
   */
  close(): void;
}

/**
 * A streaming call's responses, read straight off the transport's stream:
 * one promise per message, errors mapped to this client's typed classes.
 * (connect's client wraps each stream in an async generator, which costs
 * a few promises per message and shows in a Watch of many events.) As
 * there, `return` and `throw` are left out: a stream ends with its signal.
 */
function streamCall<I extends DescMessage, O extends DescMessage>(
  transport: Transport,
  method: DescMethodStreaming<I, O>,
  input: AsyncIterable<MessageInitShape<I>>,
  options: CallOptions,
): AsyncIterable<MessageShape<O>> {
  return {
    [Symbol.asyncIterator]() {
      let response: StreamResponse<I, O> | undefined;
      let messages: AsyncIterator<MessageShape<O>> | undefined;
      const failed = (error: unknown): never => {
        throw toLeaseholdError(error);
      };
      const read = (r: IteratorResult<MessageShape<O>>) => {
        if (r.done === true) options.onTrailer?.((response as StreamResponse<I, O>).trailer);
        return r;
      };
      const pull = (it: AsyncIterator<MessageShape<O>>) => it.next().then(read, failed);
      return {
        next() {
          if (messages) return pull(messages);
          return transport
            .stream(
              method,
              options.signal,
              options.timeoutMs,
              options.headers,
              input,
              options.contextValues,
            )
            .then((opened) => {
              response = opened;
              options.onHeader?.(opened.header);
              messages = opened.message[Symbol.asyncIterator]();
              return pull(messages);
            }, failed);
        },
      };
    },
  };
}

/** A server-streaming call's one request, as an async iterable. */
async function* once<T>(message: T): AsyncIterable<T> {
  yield message;
}

/** Streams have no deadline unless the caller sets one. */
function streamOptions(options: CallOptions | undefined): CallOptions {
  return { ...options, timeoutMs: options?.timeoutMs ?? 0 };
}

/**
 * Creates a LeaseService client over the Connect protocol (default) or gRPC,
 * to one server (`baseUrl`) or several instances (`baseUrls`).
 */
export function createLeaseClient(options: LeaseClientOptions): LeaseClient {
  const baseUrls = options.baseUrls ?? (options.baseUrl !== undefined ? [options.baseUrl] : []);
  if (baseUrls.length === 0) throw new RangeError("createLeaseClient needs baseUrl or baseUrls");
  const defaultTimeoutMs = options.defaultTimeoutMs ?? 10_000;
  const endpoints = baseUrls.map((url) => createEndpoint(url, options));
  const transport = failoverTransport(endpoints, {
    onFailover: options.onEvent,
    defaultTimeoutMs,
  });
  const rpc = createClient(LeaseService, transport);
  const keepAlive = new KeepAliveChannel({
    baseUrls,
    transport: options,
    backoffInitialMs: options.reconnectBackoff?.initialMs,
    backoffMaxMs: options.reconnectBackoff?.maxMs,
    onEvent: options.onEvent,
    maxLeasesPerStream: options.maxLeasesPerStream,
  });

  const keepers = new Set<Keeper>();

  const unary =
    <I, O>(call: (request: I, options?: CallOptions) => Promise<O>) =>
    async (request: I, callOptions?: CallOptions): Promise<O> => {
      try {
        return await call(request, callOptions);
      } catch (error) {
        throw toLeaseholdError(error);
      }
    };

  const client: LeaseClient = {
    baseUrls,
    acquire: unary((request: AcquireInit, callOptions?: CallOptions) => {
      const waitMs = request.wait ? msFromDuration(create(DurationSchema, request.wait)) : 0;
      return rpc.acquire(
        { ...request, runId: request.runId || randomUUID() },
        {
          ...callOptions,
          timeoutMs: callOptions?.timeoutMs ?? (waitMs > 0 ? waitMs + defaultTimeoutMs : undefined),
        },
      );
    }),
    renew: unary(rpc.renew),
    release: unary(rpc.release),
    get: unary(rpc.get),
    list: unary(rpc.list),
    keepAlive: (requests, callOptions) =>
      streamCall(transport, LeaseService.method.keepAlive, requests, streamOptions(callOptions)),
    watch: (request, callOptions) =>
      streamCall(transport, LeaseService.method.watch, once(request), streamOptions(callOptions)),
    requestHandoff: unary(rpc.requestHandoff),
    history: unary(rpc.history),
    checkFence: unary(rpc.checkFence),
    revoke: unary(rpc.revoke),
    runExclusive: (key, work, runOptions) => {
      if (runOptions && "keeper" in runOptions && runOptions.keeper !== undefined) {
        const { keeper, ...keeperOptions } = runOptions;
        // A keeper's lease lives as long as its keeper: a TTL, a margin or
        // a renewal interval of the run's own would mean nothing there.
        for (const own of ["ttlMs", "safetyMarginMs", "renewIntervalMs"]) {
          if (own in keeperOptions) {
            return Promise.reject(
              new RangeError(
                `${own} is the keeper's with keeper set: leave it out of runExclusive's options`,
              ),
            );
          }
        }
        return keeper.runExclusive(key, work, keeperOptions);
      }
      return runExclusive(
        {
          acquire: client.acquire,
          release: client.release,
          keepAlive,
          defaultTimeoutMs,
          now: () => performance.now(),
          onReleaseError: (error, key, runId) =>
            options.onEvent?.({ type: "release-failed", key, runId, error }),
        },
        key,
        work,
        runOptions,
      );
    },
    openKeeper: async (keeperOptions) => {
      const keeper = await openKeeper(
        {
          baseUrls,
          transport: options,
          defaultTimeoutMs,
          backoffInitialMs: options.reconnectBackoff?.initialMs,
          backoffMaxMs: options.reconnectBackoff?.maxMs,
          onEvent: options.onEvent,
          onReleaseError: (error, key, runId) =>
            options.onEvent?.({ type: "release-failed", key, runId, error }),
        },
        keeperOptions,
      );
      keepers.add(keeper);
      keeper.signal.addEventListener("abort", () => keepers.delete(keeper), { once: true });
      return keeper;
    },
    close: () => {
      keepAlive.close();
      for (const keeper of keepers) abandonKeeper(keeper);
      for (const endpoint of endpoints) endpoint.close();
    },
  };
  return client;
}
