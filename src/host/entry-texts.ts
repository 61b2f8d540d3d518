// What the server says to a request it does not route to a method: an
// unknown method or service, a content type or HTTP method an RPC path does
// not take, unknown JSON fields. All of it here, so the words are in one
// place (rpc-entry.ts sends them, docs/security.md quotes them).

import type { DescMethod } from "@bufbuild/protobuf";

/** How each protocol names its content types, for a method of each kind. */
function contentTypes(protocols: readonly string[], method: DescMethod): string[] {
  const unary = method.methodKind === "unary";
  const named: Record<string, string> = {
    connect: unary
      ? "application/json or application/proto (Connect)"
      : "application/connect+json or application/connect+proto (Connect)",
    grpc: "application/grpc or application/grpc+json (gRPC)",
    "grpc-web": "application/grpc-web or application/grpc-web+json (gRPC-Web)",
  };
  return protocols.map((p) => named[p] ?? p);
}

const rpcName = (method: DescMethod) => `${method.parent.typeName}/${method.name}`;

export const entryTexts = {
  /** A POST with an RPC content type to a service this server has, naming a method it lacks. */
  unknownMethod: (service: string, method: string) =>
    `unknown method: ${service} has no method ${JSON.stringify(method)}`,

  /** A POST with an RPC content type to a service this server does not have. */
  unknownService: (service: string, served: readonly string[]) =>
    `unknown service ${JSON.stringify(service)}: this server serves ${served.join(", ")}`,

  /** A POST with an RPC content type to a path that is not /package.Service/Method. */
  notAnRpcPath: (path: string, example: string) =>
    `no RPC at ${JSON.stringify(path)}: RPC paths are /<package>.<Service>/<Method>, such as ${example}`,

  /** HTTP 415: an RPC path with a content type none of its protocols takes. */
  unsupportedMediaType: (method: DescMethod, protocols: readonly string[], got: string | null) =>
    `${rpcName(method)} is an RPC; it does not take content-type ${got ? JSON.stringify(got) : "(none given)"}. ` +
    `Send POST with content-type ${contentTypes(protocols, method).join(", or ")}.\n`,

  /** HTTP 405: an RPC path asked with an HTTP method it does not take (a GET from a browser or curl). */
  methodNotAllowed: (
    method: DescMethod,
    protocols: readonly string[],
    allowed: readonly string[],
    got: string,
  ) =>
    `${rpcName(method)} is an RPC; it does not answer ${got}. ` +
    `Send ${allowed.join(" or ")} with content-type ${contentTypes(protocols, method).join(", or ")}.\n`,

  /** HTTP 505: a method that streams both ways, asked over HTTP/1.1. */
  needsHttp2: (method: DescMethod) =>
    `${rpcName(method)} streams both ways and needs HTTP/2 (h2c, or h2 over TLS); this request came over HTTP/1.1.\n`,

  /** INVALID_ARGUMENT: a JSON request message with fields the API does not have. */
  unknownJsonFields: (fields: readonly string[]) =>
    `request message: unknown ${fields.length === 1 ? "field" : "fields"} ${fields.map((f) => JSON.stringify(f)).join(", ")}: ` +
    "JSON requests may only use the fields of the API (check the spelling; a server started with " +
    "--json-unknown-fields accept ignores fields it does not know, for a rolling upgrade)",

  /** The plain answer to a path that is neither an RPC nor a page (a server without a web page). */
  notFound: "not found\n",
} as const;
