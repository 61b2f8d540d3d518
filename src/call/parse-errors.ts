// A request body that is not valid protobuf, or whose compression is broken,
// is the client's mistake, so it gets INVALID_ARGUMENT (never INTERNAL for
// anything a client sent). connect-es answers it with INTERNAL ("parse binary: …") because clients and servers
// share that parser, and for a client a bad response is the server's fault.
// So is a call that must carry one request message and carries none or two
// (gRPC and gRPC-Web frame messages, so a body can hold any number):
// connect-es answers UNIMPLEMENTED ("protocol error: … input message for …");
// the native gRPC path says INVALID_ARGUMENT in the words used here.
// connect-node offers no hook into request parsing (its serialization is
// internal), so the error is recognized by that message prefix, here only.
//
// Streaming calls parse their input inside the interceptors, where the error
// interceptor maps it (requestParseErrorAsInvalidArgument). A unary call
// parses it before any interceptor runs, so the router's handlers are wrapped
// and that one error is rewritten in each protocol's encoding: the gRPC
// trailer, the gRPC-Web trailer frame, the Connect unary JSON body. Nothing
// else is touched.

import { Code, ConnectError, type ConnectRouter } from "@connectrpc/connect";
import type {
  UniversalHandler,
  UniversalServerRequest,
  UniversalServerResponse,
} from "@connectrpc/connect/protocol";
import { policyText } from "./error-texts.js";

// A body that does not parse, and one whose compression is broken (connect-node
// says INTERNAL for a truncated gzip or brotli stream, INVALID_ARGUMENT only
// for some corrupt ones).
const markers = ["parse binary:", "decompression failed"];
// A message whose flags say compressed in a call that names no compression
// (no grpc-encoding or connect-content-encoding, or identity): connect-node
// says INTERNAL, as the gRPC implementations do; the native gRPC path says
// INVALID_ARGUMENT in the same words as here.
const compressedWithoutEncoding = "received compressed envelope, but do not know how to decompress";

/** The INVALID_ARGUMENT message for an error connect-es gave a bad request body, or undefined. */
function invalidArgumentMessage(code: number, message: string): string | undefined {
  if (code === Code.Internal && markers.some((m) => message.startsWith(m))) {
    return `request message: ${message}`;
  }
  if (code === Code.Internal && message === compressedWithoutEncoding) {
    return policyText.flaggedCompressed;
  }
  if (code === Code.Unimplemented) {
    if (message.startsWith("protocol error: missing input message for ")) {
      return policyText.oneMessageGotNone;
    }
    if (message.startsWith("protocol error: received extra input message for ")) {
      return policyText.oneMessageGotMore;
    }
  }
  return undefined;
}

/** A request parse failure becomes INVALID_ARGUMENT; any other error is returned as it is. */
export function requestParseErrorAsInvalidArgument(error: ConnectError): ConnectError {
  const message = invalidArgumentMessage(error.code, error.rawMessage);
  return message === undefined ? error : new ConnectError(message, Code.InvalidArgument);
}

/** Wraps every unary handler registered on `router` so far. */
export function unaryParseErrorsAsInvalidArgument(router: ConnectRouter): void {
  router.handlers.forEach((handler, i) => {
    if (handler.method.methodKind !== "unary") return;
    const wrapped = async (req: UniversalServerRequest) => rewrite(await handler(req));
    router.handlers[i] = Object.assign(wrapped, handler) as UniversalHandler;
  });
}

async function rewrite(res: UniversalServerResponse): Promise<UniversalServerResponse> {
  const type = res.header?.get("content-type") ?? "";
  if (type.startsWith("application/grpc-web")) return rewriteGrpcWeb(res);
  if (type.startsWith("application/grpc")) {
    // The parse failed before any output, so the trailer is already final.
    for (const h of [res.trailer, res.header]) {
      const message = h && invalidArgumentMessage(Number(h.get("grpc-status")), grpcMessage(h));
      if (h && message !== undefined) {
        h.set("grpc-status", String(Code.InvalidArgument));
        h.set("grpc-message", encodeURIComponent(message));
      }
    }
    return res;
  }
  if (res.status === 500 && type.startsWith("application/json") && res.body) {
    const chunks: Uint8Array[] = [];
    for await (const chunk of res.body as AsyncIterable<Uint8Array>) chunks.push(chunk);
    const bytes = Buffer.concat(chunks);
    try {
      const error = JSON.parse(bytes.toString("utf8")) as { code?: string; message?: string };
      const message =
        error.code === "internal"
          ? invalidArgumentMessage(Code.Internal, error.message ?? "")
          : undefined;
      if (message !== undefined) {
        const body = Buffer.from(JSON.stringify({ code: "invalid_argument", message }));
        res.header?.set("content-length", String(body.byteLength));
        return { ...res, status: 400, body: once(body) };
      }
    } catch {
      // Not a JSON error body (e.g. compressed): leave it as it was.
    }
    return { ...res, body: once(bytes) };
  }
  return res;
}

// gRPC-Web sends the status in a final frame (flag 0x80) of the body.
function rewriteGrpcWeb(res: UniversalServerResponse): UniversalServerResponse {
  const body = res.body as AsyncIterable<Uint8Array> | undefined;
  if (!body) return res;
  async function* frames() {
    for await (const chunk of body as AsyncIterable<Uint8Array>) {
      if (chunk.length >= 5 && chunk[0] === 0x80) {
        const text = Buffer.from(chunk.subarray(5)).toString("latin1");
        const status = Number(/grpc-status: ?(\d+)\r\n/i.exec(text)?.[1]);
        const raw = /grpc-message: ?([^\r]*)\r\n/i.exec(text)?.[1] ?? "";
        const message = invalidArgumentMessage(status, safeDecode(raw));
        if (message !== undefined) {
          const fixed = text
            .replace(/grpc-status: ?\d+\r\n/i, `grpc-status: ${Code.InvalidArgument}\r\n`)
            .replace(
              /grpc-message: ?[^\r]*\r\n/i,
              `grpc-message: ${encodeURIComponent(message)}\r\n`,
            );
          const data = Buffer.from(fixed, "latin1");
          const frame = Buffer.alloc(5 + data.length);
          frame[0] = 0x80;
          frame.writeUInt32BE(data.length, 1);
          data.copy(frame, 5);
          yield new Uint8Array(frame);
          continue;
        }
      }
      yield chunk;
    }
  }
  return { ...res, body: frames() };
}

function grpcMessage(h: Headers): string {
  return safeDecode(h.get("grpc-message") ?? "");
}

function safeDecode(text: string): string {
  try {
    return decodeURIComponent(text);
  } catch {
    return text;
  }
}

async function* once(bytes: Uint8Array) {
  yield bytes;
}
