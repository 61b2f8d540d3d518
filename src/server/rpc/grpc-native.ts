// The native gRPC path: LeaseService served to gRPC clients straight off
// Node's HTTP/2 streams, on the same port and the same HTTP/2 connections as
// the Connect adapter (listener.ts offers each stream here first). Unary
// methods run the one service implementation; KeepAlive and Watch run the
// same hubs as the Connect path (native-streams.ts). Both paths run the one
// call policy (call-policy.ts): observation, authentication and the token's
// expiry, access control, the Watch quota, error mapping and the request id. What the native path leaves out is the
// per-call machinery a general-purpose handler needs and these methods do
// not (async-iterable bodies, web Headers, an AbortController per call, a
// promise per streamed message): docs/design.md has the measurements.
//
// Every call is authenticated from its headers before any of its body is
// read (the stream is paused until then): a refused call reads nothing, and
// its stream is reset once the status is out and its client sends on. A
// body that stalls while a message is due ends its call after the read
// timeout (DEADLINE_EXCEEDED), as on the Connect adapter (whole-messages.ts).
//
// It serves a stream only when it answers it exactly as the Connect adapter
// would: POST, content type application/grpc or application/grpc+proto, no
// request compression, a method it has. Anything else (gRPC-Web, the Connect
// protocol, JSON, compressed requests, other services) goes on to the
// Connect adapter.

import type http2 from "node:http2";
import type { DescMethod, DescService, Message } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type ContextValues,
  createContextValues,
  type HandlerContext,
} from "@connectrpc/connect";
import { parseTimeout } from "@connectrpc/connect/protocol-grpc";
import {
  type CallPolicy,
  clampGrpcTimeout,
  maxTimeoutMs,
  type PolicyCall,
} from "../../call/call-policy.js";
import { clientCertificateOfStream } from "../../call/client-certificate-context.js";
import { policyText } from "../../call/error-texts.js";
import { readTimeoutText } from "../../protocol/grpc-frame.js";
import { requestIdHeader } from "../../protocol/headers.js";
import {
  encodeFrame,
  errorTrailers,
  FrameReader,
  grpcContentType,
  okTrailers,
} from "./grpc-wire.js";

// biome-ignore lint/suspicious/noExplicitAny: any unary implementation of any service
type UnaryFn = (request: any, context: HandlerContext) => unknown;

/** Serves one streaming call natively (native-streams.ts). */
export type NativeStreamHandler = (call: NativeCall) => void;

export interface NativeService {
  desc: DescService;
  /** The service implementation; its unary methods are served here. */
  impl: Partial<Record<string, unknown>>;
  /** Native handlers of its streaming methods, by method name; others go to the Connect adapter. */
  streams?: Partial<Record<string, NativeStreamHandler>>;
}

export interface NativeGrpcOptions {
  services: NativeService[];
  policy: CallPolicy;
  /** Largest request message, in bytes; larger is RESOURCE_EXHAUSTED, as the Connect adapter answers. */
  maxMessageBytes: number;
  /** How long a request body may stall while a message is due (DEADLINE_EXCEEDED after it). */
  readTimeoutMs: number;
  /**
   * What becomes of a body left unread once its call is answered: the host's
   * rules (src/host/request-end.ts), the same as on the Connect adapter.
   */
  unread: {
    /** Reset the stream on the next bytes its client sends. */
    resetOnMoreData(stream: http2.ServerHttp2Stream): void;
    /** Reset the stream now: its body stalled. */
    resetStalled(stream: http2.ServerHttp2Stream): void;
  };
  /** Aborts the signals of calls still running (a waiting Acquire) and ends streams with UNAVAILABLE. */
  shutdownSignal: AbortSignal;
}

interface Route {
  service: DescService;
  method: DescMethod;
  unary?: UnaryFn;
  stream?: NativeStreamHandler;
}

/** Returns the stream handler of the native path (see listener.ts). */
export function createNativeGrpc(
  options: NativeGrpcOptions,
): (stream: http2.ServerHttp2Stream, headers: http2.IncomingHttpHeaders) => boolean {
  const routes = new Map<string, Route>();
  for (const { desc, impl, streams } of options.services) {
    for (const method of desc.methods) {
      const path = `/${desc.typeName}/${method.name}`;
      const fn = impl[method.localName];
      const streamHandler = streams?.[method.name];
      if (method.methodKind === "unary" && typeof fn === "function") {
        routes.set(path, { service: desc, method, unary: (fn as UnaryFn).bind(impl) });
      } else if (method.methodKind !== "unary" && streamHandler) {
        routes.set(path, { service: desc, method, stream: streamHandler });
      }
    }
  }

  return (stream, headers) => {
    const path = headers[":path"];
    const route = path === undefined ? undefined : routes.get(path);
    if (route === undefined || headers[":method"] !== "POST") return false;
    const type = headers["content-type"];
    if (type !== "application/grpc" && type !== grpcContentType) return false;
    const encoding = headers["grpc-encoding"];
    if (encoding !== undefined && encoding !== "identity") return false;
    const call = new NativeCall(route, stream, headers, options);
    if (call.ended) return true; // a bad grpc-timeout, already answered
    // Nothing is read until the caller is known from the headers.
    call.pauseReading();
    // What the handler starts runs inside the policy's steps (tracing).
    call.policy
      .run(() => call.authenticate())
      .then(() => {
        if (call.ended) return;
        if (route.unary) serveUnary(call, route.unary);
        else call.policy.run(() => route.stream?.(call));
        call.resumeReading();
      })
      // A refusal, or what a handler threw as it started: the call ends with it.
      .catch((error: unknown) => call.end(error));
    return true;
  };
}

function serveUnary(call: NativeCall, fn: UnaryFn): void {
  let reader: FrameReader<Message> | undefined;
  let message: Message | undefined;
  let extra = false;
  call.onData((chunk) => {
    if (message !== undefined) {
      extra = true;
      return;
    }
    reader ??= call.reader();
    try {
      const [first, ...rest] = reader.push(chunk);
      if (first) message = first;
      if (rest.length > 0) extra = true;
    } catch (error) {
      call.end(error);
    }
  });
  call.onEnd(() => {
    if (message === undefined || extra || reader?.incomplete) {
      call.end(
        new ConnectError(
          message === undefined ? policyText.oneMessageGotNone : policyText.oneMessageGotMore,
          Code.InvalidArgument,
        ),
      );
      return;
    }
    const request = message;
    void call.policy
      .run(async () => {
        await call.check(request);
        return fn(request, call.context);
      })
      .then(
        (response) => call.replyOnce(encodeFrame(call.method.output, response)),
        (error: unknown) => call.end(error),
      );
  });
}

/**
 * One call on the native path: its stream, deadline and cancellation, the
 * call policy's steps, and the answer: headers, message frames (as few
 * writes as the caller gives it), then the status in trailers, or a
 * trailers-only status when nothing was sent. A call that ends with an error
 * while its client still sends reads nothing more: its stream is reset once
 * the trailers are out.
 */
export class NativeCall {
  readonly service: DescService;
  readonly method: DescMethod;
  readonly context: NativeContext;
  readonly policy: PolicyCall;
  private headersSent = false;
  private finished = false;
  private deadline: NodeJS.Timeout | undefined;
  private readonly cancelListeners: ((reason: ConnectError) => void)[] = [];
  private onShutdown: (() => void) | undefined;
  /** The reader of the request's frames, once the handler made it: it knows when a message is begun. */
  private frames: FrameReader<Message> | undefined;
  /** The call takes one message: the whole body is due, not only the inside of a frame. */
  private readonly wholeBodyDue: boolean;
  private readTimer: NodeJS.Timeout | undefined;
  private stalled = false;

  constructor(
    route: Route,
    readonly stream: http2.ServerHttp2Stream,
    headers: http2.IncomingHttpHeaders,
    private readonly options: NativeGrpcOptions,
  ) {
    this.service = route.service;
    this.method = route.method;
    this.wholeBodyDue =
      route.method.methodKind === "unary" || route.method.methodKind === "server_streaming";
    this.policy = options.policy.begin({
      service: this.service,
      method: this.method,
      protocol: "grpc-native",
      header: (name) => header(headers, name),
      certificate: () => clientCertificateOfStream(stream),
    });
    this.context = new NativeContext(this.service, this.method, headers, options.shutdownSignal);
    const timeout = parseTimeout(clampGrpcTimeout(header(headers, "grpc-timeout")), maxTimeoutMs);
    if (timeout.error) {
      this.end(timeout.error);
      return;
    }
    if (timeout.timeoutMs !== undefined) {
      this.context.deadlineMs = timeout.timeoutMs;
      this.deadline = setTimeout(() => {
        const error = new ConnectError(policyText.timedOut, Code.DeadlineExceeded);
        this.cancel(error);
        this.end(error);
      }, timeout.timeoutMs);
    }
    // A stream error (a reset, a protocol error of the peer) is followed by
    // 'close', handled below; unhandled, the 'error' event would end the process.
    stream.on("error", ignore);
    // The client went away (RST_STREAM, a closed connection) before the end.
    stream.once("close", () => {
      if (this.finished) return;
      const reason = new ConnectError(policyText.cancelled, Code.Canceled);
      this.cancel(reason);
      this.finish();
      this.policy.end(reason);
    });
  }

  get ended(): boolean {
    return this.finished;
  }

  /** A reader of this method's request frames; `fast`: see FrameReader. */
  reader<T extends Message>(fast?: (bytes: Uint8Array) => T | undefined): FrameReader<T> {
    const reader = new FrameReader<T>(this.method.input, this.options.maxMessageBytes, fast);
    this.frames = reader;
    return reader;
  }

  // Listeners of the stream's events run through the policy's `run`: the
  // connection, not the call, emits them.
  onData(listener: (chunk: Buffer) => void): void {
    const bound = this.policy.bind(listener);
    this.stream.on("data", (chunk: Buffer) => {
      bound(chunk);
      this.armReadTimeout();
    });
  }

  /** The client finished sending. */
  onEnd(listener: () => void): void {
    const bound = this.policy.bind(listener);
    const ended = () => {
      clearTimeout(this.readTimer);
      if (!this.finished) bound();
    };
    // A paused stream still ends when nothing is left to read: a body that
    // was empty ended while the caller was being authenticated.
    if (this.stream.readableEnded) queueMicrotask(ended);
    else this.stream.once("end", ended);
  }

  // The read timeout runs while the stream is read and a message is due; a
  // paused stream (a check awaited) is the server's wait, not the client's.
  private armReadTimeout(): void {
    clearTimeout(this.readTimer);
    this.readTimer = undefined;
    if (this.finished || this.stream.readableEnded || this.stream.isPaused()) return;
    if (!this.wholeBodyDue && !this.frames?.incomplete) return;
    const ms = this.options.readTimeoutMs;
    this.readTimer = setTimeout(() => {
      this.stalled = true;
      const error = new ConnectError(readTimeoutText(ms), Code.DeadlineExceeded);
      this.cancel(error);
      this.end(error);
    }, ms);
  }

  /**
   * Called once when the call ends early: deadline, client gone, shutdown
   * (UNAVAILABLE), or its token's expiry. Added after the call ended, it
   * runs at once: whatever it cleans up must not outlive the call.
   */
  onCancel(listener: (reason: ConnectError) => void): void {
    if (this.finished) {
      listener(new ConnectError(policyText.cancelled, Code.Canceled));
      return;
    }
    this.cancelListeners.push(listener);
    if (!this.onShutdown) {
      const signal = this.options.shutdownSignal;
      this.onShutdown = () => {
        const reason = ConnectError.from(signal.reason, Code.Unavailable);
        this.cancel(reason);
        this.end(reason);
      };
      if (signal.aborted) queueMicrotask(this.onShutdown);
      else signal.addEventListener("abort", this.onShutdown, { once: true });
    }
  }

  /**
   * Admits the call (the policy's authentication and admission steps). A
   * stream is then ended by its token's expiry.
   */
  async authenticate(): Promise<void> {
    await this.policy.admit();
    this.policy.onExpired((error) => {
      this.cancel(error);
      this.end(error);
    });
  }

  /**
   * Checks a request message (the policy's message steps, after
   * authenticate). Synchronous when nothing needs the session authorizer
   * (a KeepAlive stream's later renewals), so a stream adds no promise per message.
   */
  check(message: object): void | Promise<void> {
    return this.policy.message(message);
  }

  /** Stops reading the request: a pending check holds back the client by flow control. */
  pauseReading(): void {
    this.stream.pause();
    clearTimeout(this.readTimer);
    this.readTimer = undefined;
  }

  resumeReading(): void {
    if (this.finished) return;
    this.stream.resume();
    this.armReadTimeout();
  }

  /** Sends the response headers, if not yet sent. */
  sendHeaders(): void {
    if (this.headersSent || this.finished || this.stream.destroyed || this.stream.closed) return;
    this.headersSent = true;
    const out: http2.OutgoingHttpHeaders = {
      ":status": 200,
      "content-type": grpcContentType,
      [requestIdHeader]: this.policy.requestId,
    };
    this.context.responseHeaderInto(out);
    this.stream.respond(out, { waitForTrailers: true });
    this.stream.once("wantTrailers", () => {
      this.stream.sendTrailers(this.trailers);
      if (this.resetAfterTrailers) this.cutRest();
    });
  }

  /**
   * Writes message frames (already encoded, possibly several in one buffer).
   * Returns false when the stream's buffer is full: wait for `onDrain`.
   */
  write(frames: Buffer): boolean {
    if (this.finished || this.stream.destroyed) return true;
    this.sendHeaders();
    return this.stream.write(frames);
  }

  onDrain(listener: () => void): void {
    this.stream.once("drain", this.policy.bind(listener));
  }

  /** The one answer of a unary call. */
  replyOnce(frame: Buffer): void {
    if (this.finished) return;
    this.write(frame);
    this.end();
  }

  private trailers: http2.OutgoingHttpHeaders = okTrailers;

  /** Ends the call: OK without an error, else with its status (mapped by the error table). */
  end(error?: unknown): void {
    if (this.finished) return;
    if (error === undefined) {
      this.trailers = this.context.withResponseTrailer(this.trailers);
      // Before finish(): a call that wrote no message (a KeepAlive stream
      // half-closed without a renewal) still needs its response headers,
      // which sendHeaders() does not send once the call is finished.
      try {
        if (!this.stream.destroyed && !this.stream.closed) {
          this.sendHeaders();
          this.stream.end();
        }
      } finally {
        this.finish();
        this.policy.end();
      }
      return;
    }
    this.finish();
    const ce = this.policy.end(error) ?? new ConnectError(policyText.cancelled, Code.Canceled);
    if (this.stream.destroyed || this.stream.closed) return;
    // A refused call reads nothing more of what its client still sends.
    const stillSending = !this.stream.readableEnded;
    if (stillSending) {
      this.stream.removeAllListeners("data");
      this.stream.pause();
    }
    if (!this.headersSent) {
      // Trailers-only: the status in the one HEADERS frame that ends the stream.
      this.stream.respond(
        { ":status": 200, "content-type": grpcContentType, ...errorTrailers(ce) },
        { endStream: true },
      );
      if (stillSending) this.cutRest();
      return;
    }
    this.trailers = errorTrailers(ce);
    this.resetAfterTrailers = stillSending;
    this.stream.end();
  }

  private resetAfterTrailers = false;

  // After the status, a client that goes on sending gets RST_STREAM(NO_ERROR),
  // as a gRPC server ends a call whose client has not finished sending: the
  // stream gets no more flow-control window, and nothing it sent is parsed
  // (request-end.ts says when, and why not at once). A stalled one is reset
  // as soon as its status is out.
  private cutRest(): void {
    if (this.stalled) this.options.unread.resetStalled(this.stream);
    else this.options.unread.resetOnMoreData(this.stream);
  }

  private finish(): void {
    this.finished = true;
    clearTimeout(this.readTimer);
    if (this.deadline) clearTimeout(this.deadline);
    if (this.onShutdown) {
      this.options.shutdownSignal.removeEventListener("abort", this.onShutdown);
    }
    this.context.done();
  }

  private cancel(reason: ConnectError): void {
    if (this.finished) return;
    this.context.abort(reason);
    for (const listener of this.cancelListeners.splice(0)) listener(reason);
  }
}

function ignore(): void {}

function header(headers: http2.IncomingHttpHeaders, name: string): string | null {
  const value = headers[name];
  return typeof value === "string" ? value : null;
}

/**
 * The HandlerContext of a native call, built lazily: a call that never looks
 * at its signal or headers (most) pays for neither.
 */
class NativeContext implements HandlerContext {
  readonly requestMethod = "POST";
  readonly protocolName = "grpc";
  deadlineMs: number | undefined;
  private controller: AbortController | undefined;
  private abortReason: unknown;
  private aborted = false;
  private shutdownListener: (() => void) | undefined;
  private lazyValues: ContextValues | undefined;
  private lazyRequestHeader: Headers | undefined;
  private lazyResponseHeader: Headers | undefined;
  private lazyResponseTrailer: Headers | undefined;
  private readonly started = performance.now();

  constructor(
    readonly service: DescService,
    readonly method: DescMethod,
    private readonly headers: http2.IncomingHttpHeaders,
    private readonly shutdownSignal: AbortSignal,
  ) {}

  readonly timeoutMs = (): number | undefined =>
    this.deadlineMs === undefined
      ? undefined
      : this.deadlineMs - (performance.now() - this.started);

  get signal(): AbortSignal {
    if (!this.controller) {
      this.controller = new AbortController();
      if (this.aborted) this.controller.abort(this.abortReason);
      else if (this.shutdownSignal.aborted) this.controller.abort(this.shutdownSignal.reason);
      else {
        this.shutdownListener = () => this.abort(this.shutdownSignal.reason);
        this.shutdownSignal.addEventListener("abort", this.shutdownListener, { once: true });
      }
    }
    return this.controller.signal;
  }

  get url(): string {
    return `http://${this.headers[":authority"] ?? ""}${this.headers[":path"] ?? ""}`;
  }

  get values(): ContextValues {
    this.lazyValues ??= createContextValues();
    return this.lazyValues;
  }

  get requestHeader(): Headers {
    if (!this.lazyRequestHeader) {
      const h = new Headers();
      for (const [name, value] of Object.entries(this.headers)) {
        if (name.startsWith(":") || value === undefined) continue;
        for (const v of Array.isArray(value) ? value : [value]) h.append(name, v);
      }
      this.lazyRequestHeader = h;
    }
    return this.lazyRequestHeader;
  }

  get responseHeader(): Headers {
    this.lazyResponseHeader ??= new Headers();
    return this.lazyResponseHeader;
  }

  get responseTrailer(): Headers {
    this.lazyResponseTrailer ??= new Headers();
    return this.lazyResponseTrailer;
  }

  /** Adds the response headers a handler set, if any, to `out`. */
  responseHeaderInto(out: http2.OutgoingHttpHeaders): void {
    if (this.lazyResponseHeader) for (const [k, v] of this.lazyResponseHeader) out[k] = v;
  }

  /** `trailers`, or a copy with the trailers a handler set when it set any. */
  withResponseTrailer(trailers: http2.OutgoingHttpHeaders): http2.OutgoingHttpHeaders {
    if (!this.lazyResponseTrailer) return trailers;
    const out = { ...trailers };
    for (const [k, v] of this.lazyResponseTrailer) out[k] = v;
    return out;
  }

  abort(reason: unknown): void {
    if (this.aborted) return;
    this.aborted = true;
    this.abortReason = reason;
    this.controller?.abort(reason);
    this.done();
  }

  /** The call is over: stop following the shutdown signal. */
  done(): void {
    if (this.shutdownListener) {
      this.shutdownSignal.removeEventListener("abort", this.shutdownListener);
      this.shutdownListener = undefined;
    }
  }
}
