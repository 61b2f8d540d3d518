// The client's gRPC transport: gRPC over node:http2, written for the CPU it
// costs per call. On a machine where the caller, the server and PostgreSQL
// share the cores, the client's CPU per call is part of every user's bill;
// connect-node's gRPC transport spends most of its time on per-call
// AbortControllers (and the DOMException each abort builds), async-iterable
// pipelines and web Headers conversions. This one keeps connect's contract —
// the Transport interface, interceptors run as connect runs them, the same
// ConnectError codes for the same wire events — and spends per call only what
// the call needs: no AbortController unless an interceptor reads
// `req.signal`, listeners that find their call through the stream instead of
// closures, response headers turned into web Headers only when read.
//
// This file is the transport: its options, the interceptor chain and the
// request headers. A call over HTTP/2 is grpc-call.ts's, the connection
// http2-connection.ts's, the codes for Node and HTTP/2 failures
// node-error.ts's (connect-node's codes, on purpose).

import type http2 from "node:http2";
import {
  create,
  type DescMessage,
  type DescMethodStreaming,
  type DescMethodUnary,
  type MessageInitShape,
  type MessageShape,
} from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type ContextValues,
  createContextValues,
  type Interceptor,
  type StreamRequest,
  type StreamResponse,
  type Transport,
  type UnaryRequest,
  type UnaryResponse,
} from "@connectrpc/connect";
import { Attempt, Call, envelope, type Limits } from "./grpc-call.js";
import { Connection } from "./http2-connection.js";

/** Options of `createGrpcTransport`. */
export interface GrpcTransportOptions {
  /** The server, e.g. "http://127.0.0.1:7070" (h2c) or "https://…" (TLS, ALPN h2). */
  baseUrl: string;
  /** Run on every call, as connect runs them: the first one is the outermost. */
  interceptors?: Interceptor[];
  /** Timeout of a call that sets none, in ms; undefined or ≤ 0 for none. */
  defaultTimeoutMs?: number;
  /** A response message larger than this fails the call with RESOURCE_EXHAUSTED; default 4 MiB. */
  readMaxBytes?: number;
  /** A request message larger than this fails the call with RESOURCE_EXHAUSTED; default 4 GiB − 1. */
  writeMaxBytes?: number;
  /** An idle connection is closed after this long, in ms; default 15 minutes (connect-node's). */
  idleConnectionTimeoutMs?: number;
  /** Options of `http2.connect` (a CA for TLS, say). */
  nodeOptions?: http2.ClientSessionOptions | http2.SecureClientSessionOptions;
}

/** A gRPC Transport over one HTTP/2 connection at a time. */
export interface GrpcTransport extends Transport {
  /**
   * Ends the connection (and any still draining after a GOAWAY), failing
   * the calls on it with `reason` (default CANCELED). The next call opens a
   * new connection.
   */
  close(reason?: ConnectError): void;
}

const defaultReadMaxBytes = 4 * 1024 * 1024;
const maxWriteMaxBytes = 0xffffffff;
const defaultIdleMs = 15 * 60 * 1000;
const userAgent = "leasehold-client grpc-node-http2";

/**
 * Creates a gRPC transport (binary protobuf, no compression) over node:http2.
 * One HTTP/2 connection, opened by the first call, replaced after it closes
 * or receives GOAWAY, closed after `idleConnectionTimeoutMs` without calls.
 */
export function createGrpcTransport(options: GrpcTransportOptions): GrpcTransport {
  const baseUrl = options.baseUrl;
  const authority = new URL(baseUrl).origin;
  const interceptors = options.interceptors ?? [];
  const defaultTimeoutMs = options.defaultTimeoutMs;
  const limits: Limits = {
    readMaxBytes: options.readMaxBytes ?? defaultReadMaxBytes,
    writeMaxBytes: options.writeMaxBytes ?? maxWriteMaxBytes,
  };
  const connection = new Connection(
    authority,
    options.nodeOptions,
    options.idleConnectionTimeoutMs ?? defaultIdleMs,
  );
  const routes = new WeakMap<object, Route>();
  const routeOf = (method: { parent: { typeName: string }; name: string }): Route => {
    let route = routes.get(method);
    if (route === undefined) {
      const url = baseUrl.replace(/\/?$/, `/${method.parent.typeName}/${method.name}`);
      const parsed = new URL(url);
      route = { url, path: parsed.pathname + parsed.search };
      routes.set(method, route);
    }
    return route;
  };
  // An interceptor may send the request elsewhere; only the same origin is
  // reachable on this transport's connection (connect-node refuses the same).
  const pathFor = (route: Route, url: string): string => {
    if (url === route.url) return route.path;
    const parsed = new URL(url);
    if (parsed.origin !== authority) {
      throw new ConnectError(
        `cannot make a request to ${parsed.origin}: the http2 session is connected to ${authority}`,
        Code.Internal,
      );
    }
    return parsed.pathname + parsed.search;
  };
  const effectiveTimeout = (timeoutMs: number | undefined): number | undefined => {
    const t = timeoutMs === undefined ? defaultTimeoutMs : timeoutMs;
    return t === undefined || t <= 0 ? undefined : t;
  };

  return {
    unary<I extends DescMessage, O extends DescMessage>(
      method: DescMethodUnary<I, O>,
      signal: AbortSignal | undefined,
      timeoutMs: number | undefined,
      header: HeadersInit | undefined,
      input: MessageInitShape<I>,
      contextValues?: ContextValues,
    ): Promise<UnaryResponse<I, O>> {
      const timeout = effectiveTimeout(timeoutMs);
      const call = new Call(signal, timeout);
      const route = routeOf(method);
      let req: UnaryRequest<I, O>;
      try {
        req = {
          stream: false,
          service: method.parent,
          method,
          requestMethod: "POST",
          url: route.url,
          header: requestHeader(timeout, header),
          contextValues: contextValues ?? createContextValues(),
          message: create(method.input, input),
          // Built only for an interceptor that reads it: an AbortController
          // per call is a large share of connect-node's cost.
          get signal() {
            return call.lazySignal();
          },
        };
      } catch (error) {
        // A header or a message that cannot be built: as connect, the error itself.
        call.fail(error);
        return Promise.reject(error);
      }
      const send = (r: UnaryRequest<I, O>): Promise<UnaryResponse<I, O>> => {
        if (call.aborted !== undefined) return Promise.reject(call.aborted);
        let path: string;
        let frame: Buffer;
        try {
          path = pathFor(route, r.url);
          frame = envelope(r.method.input, r.message, limits.writeMaxBytes);
        } catch (error) {
          return Promise.reject(error);
        }
        return new Promise<UnaryResponse<I, O>>((resolve, reject) => {
          const attempt = new Attempt(call, r.method.output, limits, false);
          attempt.resolveUnary = resolve as (response: UnaryResponse) => void;
          attempt.reject = reject;
          attempt.service = r.method.parent;
          attempt.method = r.method;
          attempt.open(connection, path, r.header, frame, undefined);
        });
      };
      return runChain(call, interceptors, send, req) as Promise<UnaryResponse<I, O>>;
    },

    stream<I extends DescMessage, O extends DescMessage>(
      method: DescMethodStreaming<I, O>,
      signal: AbortSignal | undefined,
      timeoutMs: number | undefined,
      header: HeadersInit | undefined,
      input: AsyncIterable<MessageInitShape<I>>,
      contextValues?: ContextValues,
    ): Promise<StreamResponse<I, O>> {
      const timeout = effectiveTimeout(timeoutMs);
      const call = new Call(signal, timeout);
      call.input = input;
      const route = routeOf(method);
      let req: StreamRequest<I, O>;
      try {
        req = {
          stream: true,
          service: method.parent,
          method,
          requestMethod: "POST",
          url: route.url,
          header: requestHeader(timeout, header),
          contextValues: contextValues ?? createContextValues(),
          message: normalizeIterable(method.input, input),
          get signal() {
            return call.lazySignal();
          },
        };
      } catch (error) {
        call.fail(error);
        return Promise.reject(error);
      }
      const send = (r: StreamRequest<I, O>): Promise<StreamResponse<I, O>> => {
        if (call.aborted !== undefined) return Promise.reject(call.aborted);
        let path: string;
        try {
          path = pathFor(route, r.url);
        } catch (error) {
          return Promise.reject(error);
        }
        return new Promise<StreamResponse<I, O>>((resolve, reject) => {
          const attempt = new Attempt(call, r.method.output, limits, true);
          attempt.resolveStream = resolve as (response: StreamResponse) => void;
          attempt.reject = reject;
          attempt.service = r.method.parent;
          attempt.method = r.method;
          attempt.open(connection, path, r.header, undefined, {
            desc: r.method.input,
            iterable: r.message,
          });
        });
      };
      return runChain(call, interceptors, send, req).then(
        (res) => streamingResponse(call, res as StreamResponse<I, O>),
        // runChain already failed the call; the rejection passes through.
      ) as Promise<StreamResponse<I, O>>;
    },

    close(reason?: ConnectError): void {
      connection.close(reason ?? new ConnectError("connection aborted", Code.Canceled));
    },
  };
}

type HeadersInit = ConstructorParameters<typeof Headers>[0];

interface Route {
  url: string;
  path: string;
}

type AnyFn = (req: UnaryRequest | StreamRequest) => Promise<UnaryResponse | StreamResponse>;

/**
 * Runs the interceptor chain around `send` as connect's runUnaryCall and
 * runStreamingCall do: applied per call, the first interceptor outermost;
 * a call whose signal aborted fails with the abort's reason whatever the
 * chain made of it; any other failure becomes a ConnectError.
 */
function runChain<Req extends UnaryRequest | StreamRequest, Res>(
  call: Call,
  interceptors: Interceptor[],
  send: (req: Req) => Promise<Res>,
  req: Req,
): Promise<Res> {
  let next = send as unknown as AnyFn;
  for (let i = interceptors.length - 1; i >= 0; i--) next = (interceptors[i] as Interceptor)(next);
  return (next(req) as Promise<Res>).then(
    (res) => {
      // A stream call ends when its response messages do (streamingResponse).
      if (!req.stream) call.complete();
      return res;
    },
    (error: unknown) => {
      throw call.fail(error);
    },
  );
}

/** As connect's runStreamingCall: the call ends when the response messages do, or fail. */
function streamingResponse<I extends DescMessage, O extends DescMessage>(
  call: Call,
  res: StreamResponse<I, O>,
): StreamResponse<I, O> {
  return {
    ...res,
    message: {
      [Symbol.asyncIterator]() {
        const it = res.message[Symbol.asyncIterator]();
        return {
          next() {
            return it.next().then(
              (r) => {
                if (r.done === true) call.complete();
                return r;
              },
              (error: unknown) => {
                throw call.fail(error);
              },
            );
          },
        };
      },
    },
  };
}

/** Normalizes each request message as connect does (`create` on the init shape). */
function normalizeIterable<I extends DescMessage>(
  desc: I,
  input: AsyncIterable<MessageInitShape<I>>,
): AsyncIterable<MessageShape<I>> {
  const transform = (r: IteratorResult<MessageInitShape<I>>): IteratorResult<MessageShape<I>> =>
    r.done === true ? r : { done: false, value: create(desc, r.value) };
  return {
    [Symbol.asyncIterator]() {
      const it = input[Symbol.asyncIterator]();
      const out: AsyncIterator<MessageShape<I>> = { next: () => it.next().then(transform) };
      if (it.throw !== undefined) {
        const t = it.throw.bind(it);
        out.throw = (e?: unknown) => t(e).then(transform);
      }
      if (it.return !== undefined) {
        const r = it.return.bind(it);
        out.return = (v?: unknown) => r(v as never).then(transform);
      }
      return out;
    },
  };
}

/** The request headers connect's gRPC transport sends, before the interceptors run. */
function requestHeader(
  timeoutMs: number | undefined,
  userHeaders: HeadersInit | undefined,
): Headers {
  const header = new Headers(userHeaders);
  header.set("content-type", "application/grpc+proto");
  if (!header.has("user-agent")) header.set("user-agent", userAgent);
  if (timeoutMs !== undefined) header.set("grpc-timeout", grpcTimeout(timeoutMs));
  // Required by gRPC over HTTP/2: it flushes out proxies without trailer support.
  header.set("te", "trailers");
  return header;
}

/** gRPC's TimeoutValue is at most 8 digits: larger timeouts move to a coarser unit. */
function grpcTimeout(ms: number): string {
  const whole = Math.ceil(ms);
  if (whole < 1e8) return `${whole}m`;
  const seconds = Math.ceil(whole / 1000);
  if (seconds < 1e8) return `${seconds}S`;
  return `${Math.min(99_999_999, Math.ceil(seconds / 3600))}H`;
}
