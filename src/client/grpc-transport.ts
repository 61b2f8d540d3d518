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
// The codes for failures are connect-node's on purpose: failoverTransport and
// toLeaseholdError (transport.ts, errors.ts) tell a connection lost under a
// call (CANCELED from an RST_STREAM CANCEL, ABORTED from a reset socket,
// UNAVAILABLE for a refused connection) from a server's answer by them.

import http2 from "node:http2";
import {
  create,
  type DescMessage,
  type DescMethodStreaming,
  type DescMethodUnary,
  fromBinary,
  type MessageInitShape,
  type MessageShape,
  toBinary,
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
import { getAbortSignalReason } from "@connectrpc/connect/protocol";
import {
  codeFromHttpStatus,
  contentTypeRegExp,
  findTrailerError,
} from "@connectrpc/connect/protocol-grpc";
import { KeepAliveResponseSchema, WatchResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  compressedFlag,
  encodeFrame,
  FrameDecoder,
  type FrameDecoderOptions,
  FrameError,
  type FrameSink,
} from "../protocol/grpc-frame.js";
import { readKeepAliveResponse, readWatchResponse } from "../protocol/wire-reader.js";

// The messages of the two hot streams, read without protobuf-es's reflection
// when they have the shape a Leasehold server sends (a renewed lease, a
// Watch event); protobuf-es reads everything else (wire-reader.ts).
const fastReaders = new Map<string, (bytes: Uint8Array) => unknown>([
  [KeepAliveResponseSchema.typeName, readKeepAliveResponse],
  [WatchResponseSchema.typeName, readWatchResponse],
]);

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
// Response messages buffered for a slow reader of a stream before the
// HTTP/2 stream is paused (flow control then stops the server).
const pauseAt = 32;
const resumeAt = 8;
const { NGHTTP2_CANCEL, NGHTTP2_NO_ERROR } = http2.constants;

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

interface Limits {
  readMaxBytes: number;
  writeMaxBytes: number;
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

/**
 * The per-call state shared by the attempts an interceptor may make: the
 * deadline, the caller's signal, the lazily built `req.signal`, and for a
 * stream the request iterable to close when the call ends.
 */
class Call {
  /** Set when the caller's signal or the deadline ended the call. */
  aborted: ConnectError | undefined;
  ended = false;
  input: AsyncIterable<unknown> | undefined;
  private abortReason: unknown;
  private failure: ConnectError | undefined;
  private readonly signal: AbortSignal | undefined;
  private timer: NodeJS.Timeout | undefined;
  private controller: AbortController | undefined;
  private onCallerAbort: (() => void) | undefined;
  private attempts: Attempt | Attempt[] | undefined;

  constructor(signal: AbortSignal | undefined, timeoutMs: number | undefined) {
    this.signal = signal;
    if (timeoutMs !== undefined) this.timer = setTimeout(onDeadline, timeoutMs, this);
    if (signal !== undefined) {
      if (signal.aborted) {
        this.callerAborted(signal);
      } else {
        this.onCallerAbort = () => this.callerAborted(signal);
        signal.addEventListener("abort", this.onCallerAbort);
      }
    }
  }

  /**
   * `req.signal`, as connect links it: aborted with the caller's own reason
   * or the deadline's error, with the call's error when it fails, and
   * without a reason when it ends.
   */
  lazySignal(): AbortSignal {
    if (this.controller === undefined) {
      this.controller = new AbortController();
      if (this.aborted !== undefined) this.controller.abort(this.abortReason);
      else if (this.ended) this.controller.abort(this.failure);
    }
    return this.controller.signal;
  }

  private callerAborted(signal: AbortSignal): void {
    const reason = getAbortSignalReason(signal);
    this.abort(ConnectError.from(reason, Code.Canceled), reason);
  }

  track(attempt: Attempt): void {
    const a = this.attempts;
    if (a === undefined || (!Array.isArray(a) && a.done)) this.attempts = attempt;
    else if (Array.isArray(a)) a.push(attempt);
    else this.attempts = [a, attempt];
  }

  /** The caller's signal or the deadline: fail every attempt in flight, now. */
  abort(error: ConnectError, reason: unknown = error): void {
    if (this.aborted !== undefined || this.ended) return;
    this.aborted = error;
    this.abortReason = reason;
    this.controller?.abort(reason);
    this.failAttempts(error);
    this.closeInput(error);
  }

  /** The call failed: the error it reports (the abort's reason when it was aborted). */
  fail(error: unknown): ConnectError {
    const e = this.aborted ?? ConnectError.from(error);
    if (!this.ended) {
      this.ended = true;
      this.failure = e;
      this.cleanup();
      this.controller?.abort(e);
      this.failAttempts(e);
      this.closeInput(e);
    }
    return e;
  }

  /** The call succeeded. */
  complete(): void {
    if (this.ended) return;
    this.ended = true;
    this.cleanup();
    this.controller?.abort();
    this.closeInput(undefined);
  }

  private cleanup(): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    if (this.onCallerAbort !== undefined) {
      this.signal?.removeEventListener("abort", this.onCallerAbort);
    }
  }

  private failAttempts(error: ConnectError): void {
    const a = this.attempts;
    if (a === undefined) return;
    if (Array.isArray(a)) for (const attempt of a) attempt.fail(error);
    else a.fail(error);
  }

  // As connect's runStreamingCall: the request iterable is told the call is
  // over (throw on failure, then return), so a queue feeding it can stop.
  private closeInput(error: ConnectError | undefined): void {
    const input = this.input;
    if (input === undefined) return;
    this.input = undefined;
    const it = input[Symbol.asyncIterator]();
    if (error !== undefined) it.throw?.(error).catch(() => {});
    it.return?.().catch(() => {});
  }
}

function onDeadline(call: Call): void {
  call.abort(new ConnectError("the operation timed out", Code.DeadlineExceeded));
}

const kAttempt = Symbol("leasehold.grpc.attempt");
type CallStream = http2.ClientHttp2Stream & { [kAttempt]?: Attempt };

/**
 * One HTTP/2 stream of a call: its response headers, frames and trailers,
 * and how it ends. The stream's listeners are shared functions that find
 * their attempt on the stream, so a call allocates no closures for them.
 */
class Attempt implements FrameSink {
  stream: CallStream | undefined;
  conn: Conn | undefined;
  done = false;
  private connection: Connection | undefined;
  private requestHeaders: http2.OutgoingHttpHeaders | undefined;
  private frame: Buffer | undefined;
  private messages: { desc: DescMessage; iterable: AsyncIterable<unknown> } | undefined;
  service: UnaryRequest["service"] | undefined;
  method: UnaryRequest["method"] | StreamRequest["method"] | undefined;
  resolveUnary: ((response: UnaryResponse) => void) | undefined;
  resolveStream: ((response: StreamResponse) => void) | undefined;
  reject: ((error: ConnectError) => void) | undefined;
  headers: http2.IncomingHttpHeaders | undefined;
  trailers: http2.IncomingHttpHeaders | undefined;
  /** The unary response message. */
  message: unknown;
  private readonly decoder: FrameDecoder;
  // Streams: messages not yet read, the reader waiting, and how it ended.
  private queue: unknown[] | undefined;
  private queueStart = 0;
  private waiting:
    | { resolve: (r: IteratorResult<unknown>) => void; reject: (e: unknown) => void }
    | undefined;
  private error: ConnectError | undefined;
  private finished = false;
  private paused = false;
  private trailerHeaders: Headers | undefined;
  drained: (() => void) | undefined;

  constructor(
    readonly call: Call,
    private readonly output: DescMessage,
    private readonly limits: Limits,
    readonly streaming: boolean,
  ) {
    call.track(this);
    this.fastRead = fastReaders.get(output.typeName);
    this.decoder = new FrameDecoder(limits.readMaxBytes, decoderOptions);
  }

  /** The hand reader of this call's output messages, if it has one. */
  private readonly fastRead: ((bytes: Uint8Array) => unknown) | undefined;

  /**
   * Sends the request: `frame` (a unary call's one message, with END_STREAM)
   * or, for a stream, the messages of `messages` as they come. The HTTP/2
   * stream opens once the connection is up, as connect-node's does: a
   * refused or reset connection then fails the call with the same error.
   */
  open(
    connection: Connection,
    path: string,
    header: Headers,
    frame: Buffer | undefined,
    messages: { desc: DescMessage; iterable: AsyncIterable<unknown> } | undefined,
  ): void {
    const h: http2.OutgoingHttpHeaders = { ":method": "POST", ":path": path };
    header.forEach((value, name) => {
      h[name] = value;
    });
    this.connection = connection;
    this.requestHeaders = h;
    this.frame = frame;
    this.messages = messages;
    connection.whenReady(this);
  }

  /** The connection is up: open the stream on it. */
  connected(conn: Conn, retried = false): void {
    if (this.done) return;
    const session = conn.session;
    let stream: CallStream;
    try {
      stream = session.request(this.requestHeaders) as CallStream;
    } catch (error) {
      // The session closed between the check and the request (a GOAWAY just
      // read), or ran out of stream ids: once more, on a new connection.
      if (
        !retried &&
        (session.closed || session.destroyed || hasNodeCode(error, "ERR_HTTP2_OUT_OF_STREAMS"))
      ) {
        if (!session.closed && !session.destroyed) session.close();
        this.connection?.whenReady(this, true);
        return;
      }
      this.fail(connectErrorFromNodeReason(error));
      return;
    }
    conn.acquired();
    this.stream = stream;
    this.conn = conn;
    this.requestHeaders = undefined;
    stream[kAttempt] = this;
    stream.on("response", onResponse);
    stream.on("trailers", onTrailers);
    stream.on("data", onData);
    stream.on("end", onEnd);
    stream.on("error", onError);
    stream.on("close", onClose);
    const frame = this.frame;
    if (frame !== undefined) {
      this.frame = undefined;
      stream.end(frame);
      return;
    }
    const messages = this.messages;
    this.messages = undefined;
    if (messages !== undefined) {
      void pump(this, messages.desc, messages.iterable, this.limits.writeMaxBytes);
    }
  }

  onHeaders(headers: http2.IncomingHttpHeaders): void {
    this.headers = headers;
    const status = (headers[":status"] as number | undefined) ?? 0;
    if (status !== 200) {
      this.fail(
        new ConnectError(`HTTP ${status}`, codeFromHttpStatus(status), webHeaders(headers)),
      );
      return;
    }
    const contentType = headers["content-type"];
    if (contentType === undefined || !contentTypeRegExp.test(contentType)) {
      this.fail(new ConnectError(`unsupported content type ${contentType ?? null}`, Code.Unknown));
      return;
    }
    const encoding = headers["grpc-encoding"];
    if (typeof encoding === "string" && encoding.toLowerCase() !== "identity") {
      // No grpc-accept-encoding is sent, so a server has no reason to compress.
      this.fail(
        new ConnectError(
          `unsupported response encoding "${encoding}"`,
          Code.Internal,
          webHeaders(headers),
        ),
      );
      return;
    }
    if (!this.streaming) return;
    const foundStatus = headers["grpc-status"] !== undefined;
    if (foundStatus) {
      const headerError = findTrailerError(webHeaders(headers));
      if (headerError !== undefined) {
        this.fail(headerError);
        return;
      }
    }
    const resolve = this.resolveStream;
    this.resolveStream = undefined;
    resolve?.(this.streamResponse());
  }

  onChunk(chunk: Buffer): void {
    try {
      this.decoder.push(chunk, this);
    } catch (error) {
      // onFrame fails the call itself; what the codec throws is a message over readMaxBytes.
      if (!(error instanceof FrameError)) throw error;
      this.fail(new ConnectError(error.message, Code.ResourceExhausted));
    }
  }

  /** One response frame (the decoder's sink); false once the attempt is done. */
  onFrame(flags: number, data: Uint8Array): boolean {
    if ((flags & compressedFlag) !== 0) {
      this.fail(
        new ConnectError(
          "received compressed envelope, but do not know how to decompress",
          Code.Internal,
        ),
      );
      return false;
    }
    let message: unknown = this.fastRead?.(data);
    try {
      message ??= fromBinary(this.output, data);
    } catch (e) {
      const m = e instanceof Error ? e.message : String(e);
      this.fail(new ConnectError(`parse binary: ${m}`, Code.Internal));
      return false;
    }
    if (!this.streaming) {
      if (this.message !== undefined) {
        this.fail(
          new ConnectError(
            "protocol error: received extra output message for unary method",
            Code.Unimplemented,
          ),
        );
        return false;
      }
      this.message = message;
      return true;
    }
    const waiting = this.waiting;
    if (waiting !== undefined) {
      this.waiting = undefined;
      waiting.resolve({ value: message, done: false });
      return true;
    }
    const queue = this.queue ?? [];
    this.queue = queue;
    queue.push(message);
    if (queue.length - this.queueStart >= pauseAt && !this.paused) {
      this.paused = true;
      this.stream?.pause();
    }
    return true;
  }

  /** The response ended (END_STREAM): decide the call from what arrived. */
  onEnd(): void {
    if (this.done) return;
    const stream = this.stream;
    // Node also ends the readable side of a stream closed under the call (a
    // connection lost: RST CANCEL). Without a status, that close is the
    // answer, as connect-node reads it.
    if (
      stream?.closed === true &&
      this.trailers === undefined &&
      this.headers?.["grpc-status"] === undefined
    ) {
      const reset = connectErrorFromH2ResetCode(stream.rstCode);
      if (reset !== undefined) {
        this.fail(reset);
        return;
      }
    }
    if (this.decoder.incomplete) {
      this.fail(new ConnectError("protocol error: incomplete envelope", Code.InvalidArgument));
      return;
    }
    // The server has answered; a request side still open has nothing more
    // to say (a bidi stream the server ended): free the stream.
    if (stream !== undefined && !stream.writableEnded && !stream.closed) {
      stream.close(NGHTTP2_NO_ERROR);
    }
    if (this.streaming) this.endStream();
    else this.endUnary();
  }

  private endUnary(): void {
    const headers = this.headers ?? {};
    const trailers = this.trailers;
    const message = this.message;
    // The common answer, decided without building any web Headers.
    if (
      message !== undefined &&
      trailers !== undefined &&
      trailers["grpc-status"] === "0" &&
      trailers["grpc-status-details-bin"] === undefined &&
      headers["grpc-status"] === undefined
    ) {
      this.done = true;
      this.settleUnary(headers, trailers, message);
      return;
    }
    // Everything else, decided as connect's gRPC transport decides it.
    const header = webHeaders(headers);
    const trailer = webHeaders(trailers ?? {});
    const trailerError = findTrailerError(trailer);
    if (trailerError !== undefined) {
      header.forEach((value, key) => {
        trailerError.metadata.append(key, value);
      });
      this.fail(trailerError);
      return;
    }
    if (!header.has("grpc-status") && !trailer.has("grpc-status")) {
      this.fail(new ConnectError("protocol error: missing status", Code.Internal));
      return;
    }
    const headerError = findTrailerError(header);
    if (message === undefined) {
      this.fail(
        headerError ??
          new ConnectError(
            "protocol error: missing output message for unary method",
            trailer.has("grpc-status") ? Code.Unimplemented : Code.Unknown,
          ),
      );
      return;
    }
    if (headerError !== undefined) {
      this.fail(
        new ConnectError(
          "protocol error: received output message for unary method with error status",
          Code.Unknown,
        ),
      );
      return;
    }
    this.done = true;
    this.settleUnary(headers, trailers ?? {}, message);
  }

  private settleUnary(
    headers: http2.IncomingHttpHeaders,
    trailers: http2.IncomingHttpHeaders,
    message: unknown,
  ): void {
    const resolve = this.resolveUnary;
    this.resolveUnary = undefined;
    this.reject = undefined;
    let header: Headers | undefined;
    let trailer: Headers | undefined;
    // Own accessors, so that `{ ...res }` in an interceptor still copies them.
    resolve?.({
      stream: false,
      service: this.service,
      method: this.method,
      message,
      get header() {
        header ??= webHeaders(headers);
        return header;
      },
      get trailer() {
        trailer ??= webHeaders(trailers);
        return trailer;
      },
    } as UnaryResponse);
  }

  private endStream(): void {
    const headers = this.headers ?? {};
    if (headers["grpc-status"] === undefined) {
      const trailers = this.trailers ?? {};
      if (trailers["grpc-status"] !== "0" || trailers["grpc-status-details-bin"] !== undefined) {
        const header = webHeaders(headers);
        const trailer = webHeaders(trailers);
        const trailerError = findTrailerError(trailer);
        if (trailerError !== undefined) {
          header.forEach((value, key) => {
            trailerError.metadata.append(key, value);
          });
          this.fail(trailerError);
          return;
        }
        if (!trailer.has("grpc-status")) {
          this.fail(new ConnectError("protocol error: missing status", Code.Internal));
          return;
        }
      }
    }
    this.done = true;
    this.finished = true;
    this.settleDrain();
    const waiting = this.waiting;
    if (waiting !== undefined && this.pending() === 0) {
      this.waiting = undefined;
      waiting.resolve({ value: undefined, done: true });
    }
  }

  onTrailers(trailers: http2.IncomingHttpHeaders): void {
    this.trailers = trailers;
    const t = this.trailerHeaders;
    if (t !== undefined) {
      webHeaders(trailers).forEach((value, key) => {
        t.set(key, value);
      });
    }
  }

  /** Ends the attempt with `error`, resetting its stream (RST_STREAM CANCEL) if still open. */
  fail(error: ConnectError): void {
    if (this.done) return;
    this.done = true;
    this.error = error;
    const stream = this.stream;
    if (stream !== undefined && !stream.closed) stream.close(NGHTTP2_CANCEL);
    this.settleDrain();
    const reject = this.reject;
    this.reject = undefined;
    this.resolveUnary = undefined;
    if (this.resolveStream !== undefined) {
      // The response never started: the call's promise fails.
      this.resolveStream = undefined;
      reject?.(error);
      return;
    }
    if (!this.streaming) {
      reject?.(error);
      return;
    }
    // A stream the caller gave up (its signal, the deadline) keeps nothing;
    // messages that arrived before the connection failed are still read.
    if (this.call.aborted === error) {
      this.queue = undefined;
      this.queueStart = 0;
    }
    const waiting = this.waiting;
    if (waiting !== undefined && this.pending() === 0) {
      this.waiting = undefined;
      waiting.reject(error);
    }
  }

  /** Wakes a request writer waiting for 'drain': the stream drained, ended or closed. */
  settleDrain(): void {
    const drained = this.drained;
    this.drained = undefined;
    drained?.();
  }

  private pending(): number {
    return this.queue === undefined ? 0 : this.queue.length - this.queueStart;
  }

  /** The next response message of a stream. */
  next(): Promise<IteratorResult<unknown>> {
    const queue = this.queue;
    if (queue !== undefined && this.queueStart < queue.length) {
      const value = queue[this.queueStart];
      queue[this.queueStart] = undefined;
      this.queueStart++;
      if (this.queueStart === queue.length) {
        queue.length = 0;
        this.queueStart = 0;
      }
      if (this.paused && queue.length - this.queueStart <= resumeAt) {
        this.paused = false;
        this.stream?.resume();
      }
      return Promise.resolve({ value, done: false });
    }
    if (this.error !== undefined) return Promise.reject(this.error);
    if (this.finished) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => {
      this.waiting = { resolve, reject };
    });
  }

  private streamResponse(): StreamResponse {
    const headers = this.headers ?? {};
    let header: Headers | undefined;
    const attempt = this;
    return {
      stream: true,
      service: this.service,
      method: this.method,
      get header() {
        header ??= webHeaders(headers);
        return header;
      },
      // The same object before and after the trailers arrive, as connect-node's.
      get trailer() {
        if (attempt.trailerHeaders === undefined) {
          attempt.trailerHeaders = webHeaders(attempt.trailers ?? {});
        }
        return attempt.trailerHeaders;
      },
      message: { [Symbol.asyncIterator]: () => ({ next: () => attempt.next() }) },
    } as StreamResponse;
  }
}

function onResponse(this: CallStream, headers: http2.IncomingHttpHeaders): void {
  const attempt = this[kAttempt];
  if (attempt !== undefined && !attempt.done) attempt.onHeaders(headers);
}

function onTrailers(this: CallStream, trailers: http2.IncomingHttpHeaders): void {
  const attempt = this[kAttempt];
  if (attempt !== undefined && !attempt.done) attempt.onTrailers(trailers);
}

function onData(this: CallStream, chunk: Buffer): void {
  const attempt = this[kAttempt];
  if (attempt !== undefined && !attempt.done) attempt.onChunk(chunk);
}

function onEnd(this: CallStream): void {
  this[kAttempt]?.onEnd();
}

function onError(this: CallStream, error: Error): void {
  const attempt = this[kAttempt];
  if (attempt === undefined || attempt.done) return;
  // A server that answered and closed while the request was still being
  // written: its answer (or the close) decides, not this write (as connect-node).
  if (this.writableEnded && hasNodeCode(error, "ERR_STREAM_WRITE_AFTER_END")) return;
  attempt.fail(connectErrorFromNodeReason(error));
}

function onClose(this: CallStream): void {
  const attempt = this[kAttempt];
  if (attempt === undefined) return;
  attempt.conn?.released();
  attempt.settleDrain();
  if (attempt.done) return;
  const reset = connectErrorFromH2ResetCode(this.rstCode);
  if (reset !== undefined) {
    attempt.fail(reset);
    return;
  }
  // Closed without an end and without a mapped code: what a reader of a
  // prematurely closed Node stream gets.
  const premature = Object.assign(new Error("Premature close"), {
    code: "ERR_STREAM_PREMATURE_CLOSE",
  });
  attempt.fail(ConnectError.from(premature));
}

/** Writes the request messages, one frame each, waiting for 'drain' when the stream buffers. */
async function pump(
  attempt: Attempt,
  input: DescMessage,
  messages: AsyncIterable<unknown>,
  writeMaxBytes: number,
): Promise<void> {
  const stream = attempt.stream as CallStream;
  try {
    const it = messages[Symbol.asyncIterator]();
    for (;;) {
      const r = await it.next();
      if (attempt.done || stream.writableEnded) return;
      if (r.done === true) {
        stream.end();
        return;
      }
      const frame = envelope(input, r.value as MessageShape<DescMessage>, writeMaxBytes);
      if (!stream.write(frame)) {
        await new Promise<void>((resolve) => {
          attempt.drained = resolve;
          stream.once("drain", () => attempt.settleDrain());
        });
      }
    }
  } catch (error) {
    attempt.fail(error instanceof ConnectError ? error : connectErrorFromNodeReason(error));
  }
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

/** One gRPC message frame: flags (uncompressed), big-endian length, the message. */
function envelope(desc: DescMessage, message: unknown, writeMaxBytes: number): Buffer {
  let bytes: Uint8Array;
  try {
    bytes = toBinary(desc, message as MessageShape<DescMessage>);
  } catch (e) {
    const m = e instanceof Error ? e.message : String(e);
    throw new ConnectError(`serialize binary: ${m}`, Code.Internal);
  }
  try {
    return encodeFrame(bytes, allocate, writeMaxBytes);
  } catch (error) {
    // A message over writeMaxBytes, the one rule of the writer.
    if (!(error instanceof FrameError)) throw error;
    throw new ConnectError(error.message, Code.ResourceExhausted);
  }
}

// Node writes a Buffer to the stream as it is.
const allocate = (size: number): Buffer => Buffer.allocUnsafe(size);
const decoderOptions: FrameDecoderOptions = { allocate };

/** A Node header object as web Headers, without HTTP/2 pseudo-headers (as connect-node). */
function webHeaders(nodeHeaders: http2.IncomingHttpHeaders): Headers {
  const header = new Headers();
  for (const key of Object.keys(nodeHeaders)) {
    if (key.startsWith(":")) continue;
    const value = nodeHeaders[key];
    if (value === undefined) continue;
    if (Array.isArray(value)) for (const v of value) header.append(key, v);
    else header.append(key, String(value));
  }
  return header;
}

function hasNodeCode(error: unknown, code: string): boolean {
  const seen = new Set<unknown>();
  for (let e: unknown = error; e instanceof Error && !seen.has(e); e = e.cause) {
    seen.add(e);
    if ((e as { code?: unknown }).code === code) return true;
  }
  return false;
}

/**
 * A Node error as a ConnectError, with connect-node's codes: a destroyed
 * stream or a reset connection is ABORTED, an unreachable or refused host
 * UNAVAILABLE, anything else INTERNAL. The Node error stays the cause.
 */
function connectErrorFromNodeReason(reason: unknown): ConnectError {
  let code = Code.Internal;
  if (hasNodeCode(reason, "ERR_STREAM_WRITE_AFTER_END")) {
    code = Code.Aborted;
  } else if (
    hasNodeCode(reason, "ERR_STREAM_DESTROYED") ||
    hasNodeCode(reason, "ERR_HTTP2_INVALID_STREAM") ||
    hasNodeCode(reason, "ECONNRESET")
  ) {
    code = Code.Aborted;
  } else if (
    hasNodeCode(reason, "ETIMEDOUT") ||
    hasNodeCode(reason, "ENOTFOUND") ||
    hasNodeCode(reason, "EAI_AGAIN") ||
    hasNodeCode(reason, "ECONNREFUSED")
  ) {
    code = Code.Unavailable;
  }
  const ce = ConnectError.from(reason, code);
  if (ce !== reason) ce.cause = reason;
  return ce;
}

const h2CodeNames: Record<number, string> = {
  1: "PROTOCOL_ERROR",
  2: "INTERNAL_ERROR",
  3: "FLOW_CONTROL_ERROR",
  4: "SETTINGS_TIMEOUT",
  6: "FRAME_SIZE_ERROR",
  7: "REFUSED_STREAM",
  8: "CANCEL",
  9: "COMPRESSION_ERROR",
  10: "CONNECT_ERROR",
  11: "ENHANCE_YOUR_CALM",
  12: "INADEQUATE_SECURITY",
  13: "HTTP_1_1_REQUIRED",
};

const h2Codes: Record<number, Code> = {
  1: Code.Internal,
  2: Code.Internal,
  3: Code.Internal,
  4: Code.Internal,
  6: Code.Internal,
  7: Code.Unavailable,
  8: Code.Canceled,
  9: Code.Internal,
  10: Code.Internal,
  11: Code.ResourceExhausted,
  12: Code.PermissionDenied,
  13: Code.PermissionDenied,
};

/** connect-node's code for an RST_STREAM code; NO_ERROR and STREAM_CLOSED map to none. */
function connectErrorFromH2ResetCode(rstCode: number): ConnectError | undefined {
  const code = h2Codes[rstCode];
  if (code === undefined) return undefined;
  return new ConnectError(
    `http/2 stream closed with error code ${h2CodeNames[rstCode]} (0x${rstCode.toString(16)})`,
    code,
  );
}

/** One HTTP/2 session and the streams open on it. */
class Conn {
  connected = false;
  /** Calls waiting for the session to connect. */
  waiting: { attempt: Attempt; retried: boolean }[] = [];
  active = 0;
  idleSince = 0;
  idleTimer: NodeJS.Timeout | undefined;

  constructor(
    readonly session: http2.ClientHttp2Session,
    private readonly idleMs: number,
  ) {}

  failWaiting(error: ConnectError): void {
    const waiting = this.waiting;
    this.waiting = [];
    for (const w of waiting) w.attempt.fail(error);
  }

  acquired(): void {
    // A session with calls keeps the process alive; an idle one does not.
    if (this.active++ === 0) this.session.ref();
  }

  released(): void {
    if (--this.active === 0) this.idle();
  }

  /** No stream is open: let the process exit, and close after idleMs without one. */
  idle(): void {
    if (!this.session.destroyed) this.session.unref();
    this.idleSince = performance.now();
    // One timer per idle period, not per call: it re-arms itself for what is
    // left if calls came and went meanwhile.
    if (this.idleTimer === undefined) this.armIdle(this.idleMs);
  }

  private armIdle(ms: number): void {
    this.idleTimer = setTimeout(() => {
      this.idleTimer = undefined;
      if (this.active > 0) return;
      const left = this.idleMs - (performance.now() - this.idleSince);
      if (left > 0) this.armIdle(left);
      else this.session.close();
    }, ms);
    this.idleTimer.unref();
  }
}

/** The transport's connection: one current session, plus any still draining after GOAWAY. */
class Connection {
  private current: Conn | undefined;
  private readonly all = new Set<Conn>();

  constructor(
    private readonly authority: string,
    private readonly nodeOptions: GrpcTransportOptions["nodeOptions"],
    private readonly idleMs: number,
  ) {}

  /**
   * Hands `attempt` a connected session: at once when the current one is up,
   * once it connects, or a new one when the current one is gone or going.
   */
  whenReady(attempt: Attempt, retried = false): void {
    let conn = this.current;
    if (conn === undefined || conn.session.closed || conn.session.destroyed) conn = this.open();
    if (conn.connected) attempt.connected(conn, retried);
    else conn.waiting.push({ attempt, retried });
  }

  close(reason: ConnectError): void {
    this.current = undefined;
    for (const conn of this.all) {
      if (!conn.session.destroyed) conn.session.destroy(reason, NGHTTP2_CANCEL);
    }
    this.all.clear();
  }

  private open(): Conn {
    const session = http2.connect(this.authority, this.nodeOptions);
    const conn = new Conn(session, this.idleMs);
    session.once("connect", () => {
      conn.connected = true;
      const waiting = conn.waiting;
      conn.waiting = [];
      for (const w of waiting) w.attempt.connected(conn, w.retried);
      // Every waiting call gave up meanwhile: an idle connection.
      if (conn.active === 0) conn.idle();
    });
    // Before it connects, the session's error is every waiting call's (as
    // connect-node: ECONNREFUSED is UNAVAILABLE); after, the calls see it
    // through their streams.
    session.on("error", (error: Error) => {
      if (!conn.connected) conn.failWaiting(connectErrorFromNodeReason(error));
    });
    session.on("goaway", () => {
      if (this.current === conn) this.current = undefined;
    });
    session.on("close", () => {
      if (this.current === conn) this.current = undefined;
      conn.failWaiting(
        new ConnectError("the connection closed before it was established", Code.Unavailable),
      );
      this.all.delete(conn);
      if (conn.idleTimer !== undefined) clearTimeout(conn.idleTimer);
    });
    // Referenced while it connects (calls wait on it), as connect-node's.
    this.current = conn;
    this.all.add(conn);
    return conn;
  }
}
