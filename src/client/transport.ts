// Transports to one or more server instances. Each instance gets its own
// transport (and, over HTTP/2, its own session manager so that `close` can
// end its connection); unary calls fail over from an unreachable instance to
// the next one, and an idempotent call is then sent once more to each
// (`attemptPlan`), all within the call's one deadline, as the Python client
// does (docs/clients.md).

import tls from "node:tls";
import type { DescMethodUnary } from "@bufbuild/protobuf";
import { Code, ConnectError, type Interceptor, type Transport } from "@connectrpc/connect";
import { createConnectTransport, Http2SessionManager } from "@connectrpc/connect-node";
import { LeaseService } from "../gen/leasehold/v1/lease_pb.js";
import { brokenConnection, LeaseholdError } from "./errors.js";
import { createGrpcTransport } from "./grpc-transport.js";

/** Wire protocol of a client: gRPC (HTTP/2) or Connect (HTTP/2, or HTTP/1.1 for unary calls). */
export type Protocol = "grpc" | "connect";

/** How to reach servers; shared by the lease client and `createGuardedStoreClient`-style users. */
export interface TransportOptions {
  /** Wire protocol; default "connect". */
  protocol?: Protocol;
  /**
   * HTTP version of the Connect protocol; default "2". Streams (KeepAlive,
   * Watch) need "2"; "1.1" serves unary calls only. gRPC always uses HTTP/2.
   */
  httpVersion?: "1.1" | "2";
  /** A bearer token (JWT), or a function returning the current one. */
  token?: string | (() => string | Promise<string>);
  /** Interceptors run on every call, after the bearer token is set. */
  interceptors?: Interceptor[];
  /**
   * The W3C `traceparent` of a call, sent as its header; called as each
   * call starts, in the caller's async context, so it can read the active
   * OpenTelemetry context. Return undefined or "" to send none. The library
   * imports no OpenTelemetry package: with `@opentelemetry/api`,
   * `traceparentFromActiveContext` of the guide (docs/client.md) is five lines.
   */
  traceparent?: () => string | undefined;
  /** Timeout of a unary call without its own, in ms; default 10 000. */
  defaultTimeoutMs?: number;
  /**
   * PEM certificates of CAs to trust for https:// servers, besides Node's
   * built-in ones (a private CA). NODE_EXTRA_CA_CERTS does the same for a
   * whole process.
   */
  ca?: string | Buffer;
}

/** A transport to one server instance, and a way to drop its connection. */
export interface Endpoint {
  readonly baseUrl: string;
  readonly transport: Transport;
  /** Ends the instance's HTTP/2 connection, failing the calls on it. */
  close(): void;
}

/** Adds `authorization: Bearer <token>` to every call. */
export function bearerTokenInterceptor(
  token: string | (() => string | Promise<string>),
): Interceptor {
  return (next) => async (req) => {
    const value = typeof token === "string" ? token : await token();
    if (value !== "") req.header.set("authorization", `Bearer ${value}`);
    return next(req);
  };
}

/** Sets the `traceparent` header of every call from `traceparent()`, when it returns one. */
export function traceparentInterceptor(traceparent: () => string | undefined): Interceptor {
  return (next) => (req) => {
    const value = traceparent();
    if (value !== undefined && value !== "") req.header.set("traceparent", value);
    return next(req);
  };
}

/** Builds a transport to one server instance with its own connection. */
export function createEndpoint(baseUrl: string, options: TransportOptions = {}): Endpoint {
  const interceptors = [
    ...(options.token !== undefined ? [bearerTokenInterceptor(options.token)] : []),
    ...(options.traceparent !== undefined ? [traceparentInterceptor(options.traceparent)] : []),
    ...(options.interceptors ?? []),
  ];
  const defaultTimeoutMs = options.defaultTimeoutMs ?? 10_000;
  const protocol = options.protocol ?? "connect";
  // Node's `ca` replaces its built-in roots: they are kept beside the given CA.
  const nodeOptions =
    options.ca === undefined ? undefined : { ca: [...tls.rootCertificates, options.ca] };
  if (protocol === "connect" && options.httpVersion === "1.1") {
    return {
      baseUrl,
      transport: createConnectTransport({
        baseUrl,
        httpVersion: "1.1",
        interceptors,
        defaultTimeoutMs,
        nodeOptions,
      }),
      close: () => {},
    };
  }
  if (protocol === "grpc") {
    // The client's own gRPC transport (grpc-transport.ts): the same codes
    // as connect-node's, at a fraction of its CPU per call.
    const transport = createGrpcTransport({ baseUrl, interceptors, defaultTimeoutMs, nodeOptions });
    return {
      baseUrl,
      transport,
      close: () => transport.close(new ConnectError("client closed", Code.Canceled)),
    };
  }
  const sessionManager = new Http2SessionManager(baseUrl, undefined, nodeOptions);
  return {
    baseUrl,
    transport: createConnectTransport({
      baseUrl,
      httpVersion: "2",
      sessionManager,
      interceptors,
      defaultTimeoutMs,
    }),
    close: () => sessionManager.abort(new ConnectError("client closed", Code.Canceled)),
  };
}

// A connection closed under a call (an instance killed behind a proxy or a
// load balancer) surfaces as an HTTP/2 CANCEL, i.e. Canceled, although the
// caller canceled nothing: the call never reached a server that answered,
// so it is as retryable as UNAVAILABLE. (The caller's own cancel is told
// apart by its signal.) A reset connection reads as ABORTED: see brokenConnection.
function failsOver(error: ConnectError): boolean {
  return error.code === Code.Unavailable || error.code === Code.Canceled || brokenConnection(error);
}

/** A unary call's instance failed without answering; the call goes on to `nextBaseUrl`. */
export interface FailoverEvent {
  type: "failover";
  /** The method, e.g. "Acquire". */
  method: string;
  baseUrl: string;
  error: ConnectError;
  /** The next instance tried: the same one, with one base URL, in an idempotent call's second round. */
  nextBaseUrl: string;
}

// Unary calls of LeaseService that change nothing when sent twice: reads,
// and writes keyed by the caller's run id (S5: a Release can only end that
// run's own lease; sent again after it succeeded it answers released =
// false). Acquire is one of them only with a run id chosen by the client
// (the same run re-acquiring keeps its token); the client's `acquire` fills
// one in. Revoke and RequestHandoff are not: a second Revoke could end a
// lease granted in between, a second RequestHandoff records a second request.
const idempotentMethods: ReadonlySet<string> = new Set([
  "Renew",
  "Release",
  "Get",
  "List",
  "History",
  "CheckFence",
]);

function idempotent(method: DescMethodUnary, input: unknown): boolean {
  if (method.parent.typeName !== LeaseService.typeName) return false;
  if (idempotentMethods.has(method.name)) return true;
  const runId = (input as { runId?: unknown } | undefined)?.runId;
  return method.name === "Acquire" && typeof runId === "string" && runId !== "";
}

/**
 * The instance indexes a unary call tries, in order, while none answers:
 * each once from the preferred one, then, for an idempotent call, each
 * again. A connection reset under a call (a proxy or load balancer cutting
 * it) fails that call once though the same instance answers the next one;
 * with a single base URL there is nowhere else to go.
 */
export function attemptPlan(
  method: DescMethodUnary,
  input: unknown,
  count: number,
  start: number,
): number[] {
  const first = Array.from({ length: count }, (_, i) => (start + i) % count);
  return idempotent(method, input) ? [...first, ...first] : first;
}

// Before an idempotent call's second round, which asks instances already
// tried: a connection reset under the first attempt may not yet be seen by
// the session, whose next call would then go out on the dead connection. A
// pause of this length, as a gRPC retry policy's backoff, lets it close the
// connection and dial again. The Python client pauses as long
// (SECOND_ROUND_PAUSE_S); never more than half of what is left of the deadline.
export const secondRoundPauseMs = 100;

/** Resolves after `ms`, or at once when `signal` aborts. */
function pause(ms: number, signal: AbortSignal | undefined): Promise<void> {
  if (signal?.aborted) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done);
  });
}

/** Options of `failoverTransport`. */
export interface FailoverOptions {
  /** Reports each step from an instance that did not answer to the next attempt. */
  onFailover?: (event: FailoverEvent) => void;
  /**
   * The deadline of a call that brings none, in ms (the endpoints'
   * `defaultTimeoutMs`; default 10 000): every attempt of a call shares it.
   */
  defaultTimeoutMs?: number;
}

/**
 * A transport over several instances. A unary call that finds its instance
 * UNAVAILABLE (or its connection closed under it) is sent to the next one;
 * an idempotent call (`attemptPlan`) then goes to each instance once more,
 * after a pause of `secondRoundPauseMs`. Every attempt shares the call's
 * one deadline. The instance that answered last is tried first next time.
 * Streams go to that preferred instance: their callers (KeepAlive, Watch)
 * reconnect on their own terms. An error thrown after a failover names
 * every attempt's instance and what it did, so that a deadline hit on the
 * second instance is not read as the first one's.
 */
export function failoverTransport(
  endpoints: readonly Endpoint[],
  options: FailoverOptions = {},
): Transport {
  if (endpoints.length === 0) throw new RangeError("at least one server base URL is required");
  const { onFailover, defaultTimeoutMs = 10_000 } = options;
  let preferred = 0;
  const at = (i: number) => endpoints[i % endpoints.length] as Endpoint;
  return {
    async unary(method, signal, timeoutMs, header, input, contextValues) {
      const limitMs = timeoutMs ?? defaultTimeoutMs;
      // No deadline (a timeout of 0 or less) leaves every attempt without one.
      const deadline = limitMs > 0 ? performance.now() + limitMs : undefined;
      const plan = attemptPlan(method, input, endpoints.length, preferred);
      const tried: string[] = [];
      let lastError: ConnectError | undefined;
      for (const [position, index] of plan.entries()) {
        if (position === endpoints.length) {
          const remaining = deadline === undefined ? Infinity : deadline - performance.now();
          await pause(Math.max(0, Math.min(secondRoundPauseMs, remaining / 2)), signal);
        }
        let attemptTimeoutMs = limitMs;
        if (deadline !== undefined) {
          const remaining = deadline - performance.now();
          if (tried.length > 0 && remaining <= 0) break;
          // Connect's timeout header takes whole milliseconds.
          attemptTimeoutMs = Math.max(1, Math.ceil(remaining));
        }
        const endpoint = at(index);
        try {
          const response = await endpoint.transport.unary(
            method,
            signal,
            attemptTimeoutMs,
            header,
            input,
            contextValues,
          );
          preferred = index;
          return response;
        } catch (error) {
          const connectError = ConnectError.from(error);
          if (signal?.aborted || !failsOver(connectError)) {
            // A typed error of this client (from an interceptor) passes as it is.
            if (tried.length === 0 || connectError.cause instanceof LeaseholdError) throw error;
            throw withAttempts(connectError, tried, endpoint.baseUrl);
          }
          tried.push(`${endpoint.baseUrl}: ${describe(connectError)}`);
          lastError = connectError;
          const next = plan[position + 1];
          if (next !== undefined) {
            try {
              onFailover?.({
                type: "failover",
                method: method.name,
                baseUrl: endpoint.baseUrl,
                error: connectError,
                nextBaseUrl: at(next).baseUrl,
              });
            } catch {
              // A report that fails must not stop the call from going on.
            }
          }
        }
      }
      // Every attempt failed without an answer. A closed connection reads
      // as Canceled or a reset as ABORTED, but the caller canceled nothing
      // and no server refused anything: say what it is, UNAVAILABLE.
      const last = lastError as ConnectError;
      if (tried.length === 1 && last.code === Code.Unavailable) throw last;
      const message =
        tried.length === 1
          ? `${at(plan[0] as number).baseUrl} closed the connection under the call (${last.rawMessage})`
          : `no instance answered: ${tried.join("; ")}`;
      const unavailable = new ConnectError(
        message,
        Code.Unavailable,
        last.metadata,
        undefined,
        last,
      );
      // What the last server said (DATABASE_UNAVAILABLE, say) stays readable.
      unavailable.details = last.details;
      throw unavailable;
    },
    stream(method, signal, timeoutMs, header, input, contextValues) {
      return at(preferred).transport.stream(
        method,
        signal,
        timeoutMs,
        header,
        input,
        contextValues,
      );
    },
  };
}

function describe(error: ConnectError): string {
  return `${Code[error.code] ?? error.code} (${error.rawMessage})`;
}

/** The same error, its message naming the instances that failed before the one that gave it. */
function withAttempts(error: ConnectError, tried: string[], baseUrl: string): ConnectError {
  const wrapped = new ConnectError(
    `${error.rawMessage} [at ${baseUrl}, after ${tried.join("; ")}]`,
    error.code,
    error.metadata,
    undefined,
    error,
  );
  wrapped.details = error.details;
  return wrapped;
}
