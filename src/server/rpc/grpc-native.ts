// The native gRPC path: the unary methods of the services given, served
// straight off Node's HTTP/2 streams, on the same port and the same HTTP/2
// connections as the Connect adapter (listener.ts offers each stream here
// first). It runs the same service implementation, the same access control
// (access.ts), the same call observer (call-observer.ts) and the same error
// table (error-codes.ts) as the Connect path; what it leaves out is the
// per-call machinery a general-purpose handler needs and these methods do
// not (async-iterable bodies, web Headers, an AbortController per call):
// docs/design.md has the measurements behind it.
//
// It serves a stream only when it is sure to answer it exactly as the
// Connect adapter would: POST, content type application/grpc or
// application/grpc+proto, no request compression, a method it has. Anything
// else (gRPC-Web, the Connect protocol, JSON, compressed requests, streaming
// methods, other services) goes on to the Connect adapter.

import type http2 from "node:http2";
import {
  create,
  type DescMessage,
  type DescMethod,
  type DescService,
  fromBinary,
  type Message,
  toBinary,
} from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type ContextValues,
  createContextValues,
  type HandlerContext,
} from "@connectrpc/connect";
import { parseTimeout, setTrailerStatus } from "@connectrpc/connect/protocol-grpc";
import { requestIdHeader } from "../../protocol/headers.js";
import { InvalidArgumentError } from "../lease/errors.js";
import type { Access } from "./access.js";
import type { CallObserver, ObservedCall } from "./call-observer.js";
import { toConnectError } from "./error-codes.js";

// biome-ignore lint/suspicious/noExplicitAny: any unary implementation of any service
type UnaryFn = (request: any, context: HandlerContext) => unknown;

export interface NativeService {
  desc: DescService;
  /** The service implementation; its unary methods are served here. */
  impl: Partial<Record<string, unknown>>;
}

export interface NativeGrpcOptions {
  services: NativeService[];
  observer: CallObserver;
  access: Access;
  /** Largest request message, in bytes; larger is RESOURCE_EXHAUSTED, as the Connect adapter answers. */
  maxMessageBytes: number;
  /** Aborts the signals of calls still running (a waiting Acquire) at shutdown. */
  shutdownSignal: AbortSignal;
}

interface Route {
  service: DescService;
  method: DescMethod;
  fn: UnaryFn;
}

const contentType = "application/grpc+proto";
// Node sends a constant headers object as it is; nothing here mutates one.
const okTrailers: http2.OutgoingHttpHeaders = { "grpc-status": "0" };
const maxTimeoutMs = 2 ** 31 - 1;

/** Returns the stream handler of the native path (see listener.ts). */
export function createNativeGrpc(
  options: NativeGrpcOptions,
): (stream: http2.ServerHttp2Stream, headers: http2.IncomingHttpHeaders) => boolean {
  const routes = new Map<string, Route>();
  for (const { desc, impl } of options.services) {
    for (const method of desc.methods) {
      const fn = impl[method.localName];
      if (method.methodKind === "unary" && typeof fn === "function") {
        routes.set(`/${desc.typeName}/${method.name}`, {
          service: desc,
          method,
          fn: (fn as UnaryFn).bind(impl),
        });
      }
    }
  }

  return (stream, headers) => {
    const path = headers[":path"];
    const route = path === undefined ? undefined : routes.get(path);
    if (route === undefined || headers[":method"] !== "POST") return false;
    const type = headers["content-type"];
    if (type !== "application/grpc" && type !== contentType) return false;
    const encoding = headers["grpc-encoding"];
    if (encoding !== undefined && encoding !== "identity") return false;
    serveUnary(options, route, stream, headers);
    return true;
  };
}

function serveUnary(
  options: NativeGrpcOptions,
  route: Route,
  stream: http2.ServerHttp2Stream,
  headers: http2.IncomingHttpHeaders,
): void {
  const { service, method } = route;
  const call = options.observer.begin(
    service.typeName,
    method.name,
    header(headers, requestIdHeader),
  );
  const context = new NativeContext(route, headers, options.shutdownSignal);
  let answered = false;
  let deadline: NodeJS.Timeout | undefined;

  const finish = () => {
    answered = true;
    if (deadline) clearTimeout(deadline);
    context.done();
  };
  const fail = (error: unknown) => {
    if (answered) return;
    finish();
    const ce = toConnectError(error);
    ce.metadata.set(requestIdHeader, call.requestId);
    call.end(ce.code, ce);
    if (stream.destroyed || stream.closed || stream.headersSent) return;
    // Trailers-only: the status in the one HEADERS frame that ends the stream.
    const out: http2.OutgoingHttpHeaders = { ":status": 200, "content-type": contentType };
    for (const [name, value] of setTrailerStatus(new Headers(), ce)) out[name] = value;
    stream.respond(out, { endStream: true });
  };
  const succeed = (response: unknown) => {
    if (answered) return;
    let frame: Buffer;
    try {
      frame = encodeFrame(method.output, response);
    } catch (error) {
      fail(error);
      return;
    }
    finish();
    call.end();
    if (stream.destroyed || stream.closed) return;
    const out: http2.OutgoingHttpHeaders = {
      ":status": 200,
      "content-type": contentType,
      [requestIdHeader]: call.requestId,
    };
    context.responseHeaderInto(out);
    stream.respond(out, { waitForTrailers: true });
    const trailers = context.responseTrailerInto({ ...okTrailers }) ?? okTrailers;
    stream.once("wantTrailers", () => stream.sendTrailers(trailers));
    stream.end(frame);
  };

  const timeout = parseTimeout(header(headers, "grpc-timeout"), maxTimeoutMs);
  if (timeout.error) {
    fail(timeout.error);
    return;
  }
  if (timeout.timeoutMs !== undefined) {
    context.deadlineMs = timeout.timeoutMs;
    deadline = setTimeout(() => {
      const error = new ConnectError("the operation timed out", Code.DeadlineExceeded);
      context.abort(error);
      fail(error);
    }, timeout.timeoutMs);
  }
  // The client went away (RST_STREAM, a closed connection) before the answer.
  stream.once("close", () => {
    if (answered) return;
    finish();
    context.abort(new ConnectError("the call was cancelled", Code.Canceled));
    call.end(Code.Canceled);
  });

  const chunks: Buffer[] = [];
  let size = 0;
  stream.on("data", (chunk: Buffer) => {
    // Keep reading past the limit (the client may not stop) but keep only
    // what the size check needs: the prefix that holds the length.
    if (size <= options.maxMessageBytes + 5 || size < 5) chunks.push(chunk);
    size += chunk.length;
  });
  stream.once("end", () => {
    if (answered) return;
    let request: Message;
    try {
      request = decodeRequest(method.input, chunks, size, options.maxMessageBytes);
    } catch (error) {
      fail(error);
      return;
    }
    run(options.access, route, request, headers, context, call).then(succeed, fail);
  });
}

async function run(
  access: Access,
  route: Route,
  request: Message,
  headers: http2.IncomingHttpHeaders,
  context: NativeContext,
  call: ObservedCall,
): Promise<unknown> {
  const { service, method } = route;
  if (access.protects(service.typeName)) {
    const caller = await access.caller(method.name, header(headers, "authorization"));
    call.principal = caller;
    const principal = await access.check(method.name, method.input, request, caller);
    call.principal = principal;
  }
  return route.fn(request, context);
}

/** The one message of a unary request: a 5-byte prefix (flags, length) and the protobuf bytes. */
function decodeRequest(
  desc: DescMessage,
  chunks: Buffer[],
  size: number,
  maxMessageBytes: number,
): Message {
  if (size < 5) throw new InvalidArgumentError("request message", "is missing");
  const body = chunks.length === 1 ? (chunks[0] as Buffer) : Buffer.concat(chunks);
  const length = body.readUInt32BE(1);
  if (length > maxMessageBytes) {
    throw new ConnectError(
      `message size ${length} is larger than configured readMaxBytes ${maxMessageBytes}`,
      Code.ResourceExhausted,
    );
  }
  if ((body[0] ?? 0) & 1) {
    throw new ConnectError(
      "request message: flagged compressed, but the request names no grpc-encoding",
      Code.InvalidArgument,
    );
  }
  if (size !== 5 + length) {
    throw new ConnectError(
      `request message: expected one message of ${length} bytes in a unary call, got ${size - 5}`,
      Code.InvalidArgument,
    );
  }
  try {
    return fromBinary(desc, body.subarray(5));
  } catch (error) {
    // The same words the Connect path uses (parse-errors.ts).
    throw new ConnectError(
      `request message: parse binary: ${(error as Error).message}`,
      Code.InvalidArgument,
    );
  }
}

function encodeFrame(desc: DescMessage, response: unknown): Buffer {
  const message =
    (response as Message).$typeName === desc.typeName
      ? (response as Message)
      : create(desc, response as Record<string, unknown>);
  const bytes = toBinary(desc, message);
  const frame = Buffer.allocUnsafe(5 + bytes.length);
  frame[0] = 0;
  frame.writeUInt32BE(bytes.length, 1);
  frame.set(bytes, 5);
  return frame;
}

function header(headers: http2.IncomingHttpHeaders, name: string): string | null {
  const value = headers[name];
  return typeof value === "string" ? value : null;
}

/**
 * The HandlerContext of a native call, built lazily: a call that never looks
 * at its signal or headers (most) pays for neither.
 */
class NativeContext implements HandlerContext {
  readonly method: DescMethod;
  readonly service: DescService;
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
    route: Route,
    private readonly headers: http2.IncomingHttpHeaders,
    private readonly shutdownSignal: AbortSignal,
  ) {
    this.method = route.method;
    this.service = route.service;
  }

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

  /** Adds the headers a handler set, if any, to `out`. */
  responseHeaderInto(out: http2.OutgoingHttpHeaders): void {
    if (this.lazyResponseHeader) for (const [k, v] of this.lazyResponseHeader) out[k] = v;
  }

  /** `out` with the trailers a handler set, or undefined when it set none. */
  responseTrailerInto(out: http2.OutgoingHttpHeaders): http2.OutgoingHttpHeaders | undefined {
    if (!this.lazyResponseTrailer) return undefined;
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
