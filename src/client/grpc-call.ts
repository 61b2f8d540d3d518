// One call of the gRPC transport (grpc-transport.ts) over an HTTP/2
// session (http2-connection.ts), as connect-node's node-universal-client.ts
// makes it: the call's deadline and signal shared by the attempts its
// interceptors make, and each attempt's HTTP/2 stream — the request frames
// written, the response headers, frames and trailers read, and the status
// decided as connect's gRPC transport decides it. The stream's listeners are
// shared functions that find their attempt on the stream, so a call
// allocates no closures for them; response headers become web Headers only
// when read.

import http2 from "node:http2";
import { type DescMessage, fromBinary, type MessageShape, toBinary } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type StreamRequest,
  type StreamResponse,
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
import type { Conn, Connection, SessionUser } from "./http2-connection.js";
import {
  connectErrorFromH2ResetCode,
  connectErrorFromNodeReason,
  hasNodeCode,
} from "./node-error.js";

// The messages of the two hot streams, read without protobuf-es's reflection
// when they have the shape a Leasehold server sends (a renewed lease, a
// Watch event); protobuf-es reads everything else (wire-reader.ts).
const fastReaders = new Map<string, (bytes: Uint8Array) => unknown>([
  [KeepAliveResponseSchema.typeName, readKeepAliveResponse],
  [WatchResponseSchema.typeName, readWatchResponse],
]);

// Response messages buffered for a slow reader of a stream before the
// HTTP/2 stream is paused (flow control then stops the server).
const pauseAt = 32;
const resumeAt = 8;
const { NGHTTP2_CANCEL, NGHTTP2_NO_ERROR } = http2.constants;

/** The message size limits of a transport's calls. */
export interface Limits {
  readMaxBytes: number;
  writeMaxBytes: number;
}

/**
 * The per-call state shared by the attempts an interceptor may make: the
 * deadline, the caller's signal, the lazily built `req.signal`, and for a
 * stream the request iterable to close when the call ends.
 */
export class Call {
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
export class Attempt implements FrameSink, SessionUser {
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

/** One gRPC message frame: flags (uncompressed), big-endian length, the message. */
export function envelope(desc: DescMessage, message: unknown, writeMaxBytes: number): Buffer {
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
