// Where requests enter the Connect adapter, for both servers (host.ts):
//
// - a routed call is authenticated from its headers before connect-node
//   sees it (`gate`: the call policy's authentication, which connect-node
//   would run only after reading a unary body whole); a refused call is
//   answered in its protocol and its body is never read;
// - a body that stalls while a message is due fails after the read timeout
//   (whole-messages.ts), and whatever of a body is left unread once its call
//   is answered is cut (request-end.ts): the HTTP/2 stream reset, the
//   HTTP/1.1 connection closed;
// - every routed handler gets its request body one whole message per chunk
//   (whole-messages.ts: connect-es's envelope decoder is quadratic in the
//   chunks of a message), and JSON request messages are checked for fields
//   the API does not have (json-fields.ts) unless the server accepts them;
// - an RPC path asked with a content type or HTTP method it does not take
//   gets connect-es's 415, 405 or 505 with a body saying what it takes
//   (connect-es sends them empty, so `curl -s` printed nothing);
// - a request shaped like an RPC (POST with a gRPC, gRPC-Web or Connect
//   content type, or a Connect GET) for a method or service this server does
//   not have gets UNIMPLEMENTED in its protocol, instead of falling through
//   to the web page (HTTP 405, which gRPC clients report as UNKNOWN). Other
//   requests go on to the fallback: a page that does not exist stays a 404.
//
// The words are in entry-texts.ts.

import type { DescMethod, DescService } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type ConnectRouter,
  type ContextValues,
  createContextKey,
  createContextValues,
} from "@connectrpc/connect";
import {
  encodeEnvelope,
  type UniversalHandler,
  type UniversalServerRequest,
  type UniversalServerResponse,
} from "@connectrpc/connect/protocol";
import { codeToHttpStatus, endStreamFlag, errorToJson } from "@connectrpc/connect/protocol-connect";
import { setTrailerStatus } from "@connectrpc/connect/protocol-grpc";
import type { ConnectNodeAdapterOptions } from "@connectrpc/connect-node";
import { entryTexts } from "./entry-texts.js";
import { badWellKnownJson, unknownJsonFields } from "./json-fields.js";
import { cutUnreadBody } from "./request-end.js";
import {
  type MessageCheck,
  type ReadTimeout,
  wholeBody,
  wholeEnvelopes,
} from "./whole-messages.js";

export type Fallback = NonNullable<ConnectNodeAdapterOptions["fallback"]>;
type NodeRequest = Parameters<Fallback>[0];
type NodeResponse = Parameters<Fallback>[1];

/**
 * Decides a routed call from its request headers, before its body is read:
 * resolves with the context values its handler starts with, or rejects with
 * the error the call is answered with.
 */
export type HeaderGate = (call: {
  service: DescService;
  method: DescMethod;
  header(name: string): string | null;
  /** The request itself, for what its connection says (a client certificate). */
  request: NodeRequest;
}) => Promise<ContextValues>;

export interface RpcEntryOptions {
  /** Largest request message in bytes (the adapter's readMaxBytes). */
  readMaxBytes: number;
  /** Ignore JSON fields the API does not have (a rolling upgrade), instead of INVALID_ARGUMENT. */
  acceptUnknownJsonFields: boolean;
  /** How long a request body may stall while a message is due. */
  readTimeoutMs: number;
  /** Runs before a routed call's body is read; none: every call goes on. */
  gate?: HeaderGate;
}

export interface RpcEntry {
  /** The services' routes, with every handler they register wrapped. */
  routes(register: (router: ConnectRouter) => void): (router: ConnectRouter) => void;
  /** Gates routed calls by their headers (see above), then hands them to the adapter `next`. */
  node(next: Fallback): Fallback;
  /** The context values a request's handler starts with (the adapter's `contextValues`). */
  contextValues(req: NodeRequest): ContextValues;
  /** Answers unrouted RPC-shaped requests with UNIMPLEMENTED; passes the rest to `next`. */
  fallback(next: Fallback | undefined): Fallback;
}

/** The request's body as the entry sees it: told when it stalled, so it is cut at once. */
interface BodyControl {
  stalled(): void;
}

const bodyControlKey = createContextKey<BodyControl | undefined>(undefined, {
  description: "leasehold request body",
});

export function createRpcEntry(options: RpcEntryOptions): RpcEntry {
  let handlers: UniversalHandler[] = [];
  let byPath = new Map<string, UniversalHandler>();
  const values = new WeakMap<NodeRequest, ContextValues>();
  return {
    routes: (register) => (router) => {
      register(router);
      router.handlers.forEach((handler, i) => {
        router.handlers[i] = wrapHandler(handler, options);
      });
      handlers = router.handlers;
      byPath = new Map(handlers.map((h) => [h.requestPath, h]));
    },
    node: (next) => (req, res) => {
      const protocol = rpcProtocol(req);
      if (protocol === undefined) {
        next(req, res);
        return;
      }
      // Whatever answers an RPC (its handler, an UNIMPLEMENTED, connect-node's
      // 415), a body left unread is cut once the answer is out.
      const control: BodyControl = { stalled: cutUnreadBody(req, res) };
      const handler = byPath.get((req.url ?? "").split("?", 1)[0] ?? "");
      if (handler === undefined) {
        next(req, res);
        return;
      }
      const gate = options.gate;
      if (gate === undefined || !gated(handler, req)) {
        values.set(req, withBodyControl(createContextValues(), control));
        next(req, res);
        return;
      }
      gate({
        service: handler.service,
        method: handler.method,
        header: nodeHeader(req),
        request: req,
      })
        .then(
          (admitted) => {
            values.set(req, withBodyControl(admitted, control));
            next(req, res);
          },
          (error: unknown) => {
            if (res.headersSent || res.writableEnded) return;
            const type = String(req.headers["content-type"] ?? "");
            answerError(res, protocol, ConnectError.from(error), type);
          },
        )
        // What `next` or an answer throws (a request connect-node cannot
        // take, a stream already gone) would otherwise be an unhandled
        // rejection, which ends the process: the request is dropped instead.
        .catch(() => res.destroy());
    },
    contextValues: (req) => values.get(req) ?? createContextValues(),
    fallback: (next) => (req, res) => {
      const protocol = rpcProtocol(req);
      if (protocol === undefined) {
        (next ?? notFound)(req, res);
        return;
      }
      const error = new ConnectError(unroutedMessage(req.url ?? "/", handlers), Code.Unimplemented);
      answerError(res, protocol, error, String(req.headers["content-type"] ?? ""));
    },
  };
}

// ---- routed requests ------------------------------------------------------

function withBodyControl(values: ContextValues, control: BodyControl): ContextValues {
  values.set(bodyControlKey, control);
  return values;
}

/**
 * Whether the gate decides this request: one connect-node would serve, not
 * answer first with its 415, 405 or 505, which read no body either and keep
 * the status their protocol requires.
 */
function gated(handler: UniversalHandler, req: NodeRequest): boolean {
  if (handler.method.methodKind === "bidi_streaming" && req.httpVersion.startsWith("1.")) {
    return false;
  }
  if (!handler.allowedMethods.includes(req.method ?? "")) return false;
  return req.method === "GET" || handler.supportedContentType(req.headers["content-type"] ?? "");
}

/** A request header by its lower-case name, as the call policy reads them. */
function nodeHeader(req: NodeRequest): (name: string) => string | null {
  return (name) => {
    const value = req.headers[name];
    if (value === undefined) return null;
    return Array.isArray(value) ? value.join(", ") : value;
  };
}

const enveloped = /^application\/(grpc|grpc-web|connect\+)/i;
const connectUnary = /^application\/(json|proto)(;|$)/i;
const jsonType = /^application\/[^;]*\bjson(;|$)/i;

function wrapHandler(handler: UniversalHandler, options: RpcEntryOptions): UniversalHandler {
  // A call that takes one message waits for all of its body; a client or
  // bidi stream only for the rest of a message it has begun.
  const kind = handler.method.methodKind;
  const wholeBodyDue = kind === "unary" || kind === "server_streaming";
  const wrapped = async (req: UniversalServerRequest): Promise<UniversalServerResponse> => {
    const control = req.contextValues?.get(bodyControlKey);
    const timeout: ReadTimeout = {
      ms: options.readTimeoutMs,
      wholeBodyDue,
      onStall: () => control?.stalled(),
    };
    const res = await handler(withWholeMessages(req, handler, options, timeout));
    return res.body === undefined ? explain(handler, req, res) : res;
  };
  return Object.assign(wrapped, handler);
}

function withWholeMessages(
  req: UniversalServerRequest,
  handler: UniversalHandler,
  options: RpcEntryOptions,
  timeout: ReadTimeout,
): UniversalServerRequest {
  const body = req.body;
  if (req.method !== "POST" || body === null || typeof body !== "object") return req;
  if (!(Symbol.asyncIterator in body)) return req;
  const type = req.header.get("content-type") ?? "";
  const check = options.acceptUnknownJsonFields ? undefined : jsonCheck(handler, type);
  if (enveloped.test(type)) {
    // Flag 1: compressed; its JSON is judged by protobuf-es once inflated.
    const checkPlain: MessageCheck | undefined =
      check &&
      ((payload, flags) => {
        if ((flags & 1) === 0) check(payload, flags);
      });
    return { ...req, body: wholeEnvelopes(body, options.readMaxBytes, checkPlain, timeout) };
  }
  if (connectUnary.test(type)) {
    const encoding = req.header.get("content-encoding");
    const plain = encoding === null || encoding === "identity";
    return {
      ...req,
      body: wholeBody(body, options.readMaxBytes, plain ? check : undefined, timeout),
    };
  }
  return req;
}

/**
 * Refuses a JSON request message with fields its type does not have, naming
 * every one, or with a Duration or Timestamp field in a form its type does
 * not take, naming the field.
 */
function jsonCheck(handler: UniversalHandler, type: string): MessageCheck | undefined {
  if (!jsonType.test(type)) return undefined;
  const desc = handler.method.input;
  return (payload) => {
    let json: unknown;
    try {
      json = JSON.parse(Buffer.from(payload).toString("utf8"));
    } catch {
      return; // not JSON: protobuf-es says so when it parses it
    }
    const unknown = unknownJsonFields(desc, json);
    if (unknown.length > 0) {
      throw new ConnectError(entryTexts.unknownJsonFields(unknown), Code.InvalidArgument);
    }
    const bad = badWellKnownJson(desc, json);
    if (bad !== undefined) throw new ConnectError(bad, Code.InvalidArgument);
  };
}

/** connect-es answers 415, 405 and 505 without a body; this one says what the path takes. */
function explain(
  handler: UniversalHandler,
  req: UniversalServerRequest,
  res: UniversalServerResponse,
): UniversalServerResponse {
  let text: string;
  const header = new Headers(res.header);
  switch (res.status) {
    case 415:
      text = entryTexts.unsupportedMediaType(
        handler.method,
        handler.protocolNames,
        req.header.get("content-type"),
      );
      break;
    case 405:
      text = entryTexts.methodNotAllowed(
        handler.method,
        handler.protocolNames,
        handler.allowedMethods,
        req.method,
      );
      header.set("allow", handler.allowedMethods.join(", "));
      break;
    case 505:
      text = entryTexts.needsHttp2(handler.method);
      break;
    default:
      return res;
  }
  const bytes = Buffer.from(text);
  header.set("content-type", "text/plain; charset=utf-8");
  header.set("content-length", String(bytes.byteLength));
  return { ...res, header, body: once(bytes) };
}

async function* once(bytes: Uint8Array) {
  yield bytes;
}

// ---- unrouted requests ----------------------------------------------------

type Protocol = "grpc" | "grpc-web" | "connect" | "connect-stream";

/** The RPC protocol a request speaks by its HTTP method and content type, or undefined for anything else. */
function rpcProtocol(req: NodeRequest): Protocol | undefined {
  const type = String(req.headers["content-type"] ?? "").toLowerCase();
  if (req.method === "POST") {
    if (/^application\/grpc-web(-text)?([+;]|$)/.test(type)) return "grpc-web";
    if (/^application\/grpc([+;]|$)/.test(type)) return "grpc";
    if (type.startsWith("application/connect+")) return "connect-stream";
    if (connectUnary.test(type)) return "connect";
    return undefined;
  }
  // A Connect GET names the protocol in its query.
  if (req.method === "GET" && /[?&]connect=v1(&|$)/.test(req.url ?? "")) return "connect";
  return undefined;
}

function unroutedMessage(url: string, handlers: readonly UniversalHandler[]): string {
  const path = url.split("?", 1)[0] ?? "/";
  const services = [...new Set(handlers.map((h) => h.service.typeName))];
  const example = handlers[0]?.requestPath ?? "/leasehold.v1.LeaseService/Acquire";
  const m = /^\/([^/]+)\/([^/]+)$/.exec(path);
  if (!m) return entryTexts.notAnRpcPath(path, example);
  const [, service = "", method = ""] = m;
  return services.includes(service)
    ? entryTexts.unknownMethod(service, method)
    : entryTexts.unknownService(service, services);
}

/**
 * An error as each protocol sends one that ends a call before any message,
 * in the request's content type (clients check that the answer's matches).
 */
function answerError(
  res: NodeResponse,
  protocol: Protocol,
  error: ConnectError,
  requestType: string,
): void {
  const type = requestType.split(";", 1)[0]?.trim().toLowerCase() ?? "";
  switch (protocol) {
    case "grpc": {
      // No message, then the status in trailers: what gRPC clients read
      // (@grpc/grpc-js takes a status from headers only when they end the
      // stream, which Node's compatibility response does not do).
      const status = new Headers();
      setTrailerStatus(status, error);
      res.writeHead(200, { "content-type": type });
      res.addTrailers(Object.fromEntries(status));
      res.end();
      return;
    }
    case "grpc-web": {
      // Trailers-only: the status in the response headers, no body.
      const header = new Headers({ "content-type": type });
      setTrailerStatus(header, error);
      res.writeHead(200, Object.fromEntries(header));
      res.end();
      return;
    }
    case "connect": {
      const body = Buffer.from(JSON.stringify(errorToJson(error, undefined)));
      res.writeHead(codeToHttpStatus(error.code), {
        ...Object.fromEntries(error.metadata),
        "content-type": "application/json",
        "content-length": String(body.byteLength),
      });
      res.end(body);
      return;
    }
    case "connect-stream": {
      const endStream = JSON.stringify({ error: errorToJson(error, undefined) });
      const body = Buffer.from(encodeEnvelope(endStreamFlag, Buffer.from(endStream)));
      res.writeHead(200, {
        ...Object.fromEntries(error.metadata),
        "content-type": type,
        "content-length": String(body.byteLength),
      });
      res.end(body);
      return;
    }
  }
}

function notFound(_req: NodeRequest, res: NodeResponse): void {
  res.writeHead(404, {
    "content-type": "text/plain; charset=utf-8",
    "content-length": String(Buffer.byteLength(entryTexts.notFound)),
  });
  res.end(entryTexts.notFound);
}
