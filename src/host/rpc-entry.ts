// Where requests enter the Connect adapter, for both servers (host.ts):
//
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

import { Code, ConnectError, type ConnectRouter } from "@connectrpc/connect";
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
import { type MessageCheck, wholeBody, wholeEnvelopes } from "./whole-messages.js";

export type Fallback = NonNullable<ConnectNodeAdapterOptions["fallback"]>;
type NodeRequest = Parameters<Fallback>[0];
type NodeResponse = Parameters<Fallback>[1];

export interface RpcEntryOptions {
  /** Largest request message in bytes (the adapter's readMaxBytes). */
  readMaxBytes: number;
  /** Ignore JSON fields the API does not have (a rolling upgrade), instead of INVALID_ARGUMENT. */
  acceptUnknownJsonFields: boolean;
}

export interface RpcEntry {
  /** The services' routes, with every handler they register wrapped. */
  routes(register: (router: ConnectRouter) => void): (router: ConnectRouter) => void;
  /** Answers unrouted RPC-shaped requests with UNIMPLEMENTED; passes the rest to `next`. */
  fallback(next: Fallback | undefined): Fallback;
}

export function createRpcEntry(options: RpcEntryOptions): RpcEntry {
  let handlers: UniversalHandler[] = [];
  return {
    routes: (register) => (router) => {
      register(router);
      router.handlers.forEach((handler, i) => {
        router.handlers[i] = wrapHandler(handler, options);
      });
      handlers = router.handlers;
    },
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

const enveloped = /^application\/(grpc|grpc-web|connect\+)/i;
const connectUnary = /^application\/(json|proto)(;|$)/i;
const jsonType = /^application\/[^;]*\bjson(;|$)/i;

function wrapHandler(handler: UniversalHandler, options: RpcEntryOptions): UniversalHandler {
  const wrapped = async (req: UniversalServerRequest): Promise<UniversalServerResponse> => {
    const res = await handler(withWholeMessages(req, handler, options));
    return res.body === undefined ? explain(handler, req, res) : res;
  };
  return Object.assign(wrapped, handler);
}

function withWholeMessages(
  req: UniversalServerRequest,
  handler: UniversalHandler,
  options: RpcEntryOptions,
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
    return { ...req, body: wholeEnvelopes(body, options.readMaxBytes, checkPlain) };
  }
  if (connectUnary.test(type)) {
    const encoding = req.header.get("content-encoding");
    const plain = encoding === null || encoding === "identity";
    return { ...req, body: wholeBody(body, options.readMaxBytes, plain ? check : undefined) };
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
