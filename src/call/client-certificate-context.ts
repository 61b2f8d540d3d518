// Where a call finds its connection's client certificate: on the Connect
// adapter's paths the header gate (policy-interceptor.ts's policyGate) reads
// it off the request and puts it in the call's context values; the native
// gRPC path reads it off its stream's session. Both read the same verdict, made
// once per connection (auth/client-certificate.ts).

import type http from "node:http";
import type http2 from "node:http2";
import { TLSSocket } from "node:tls";
import { createContextKey } from "@connectrpc/connect";
import { type ClientCertificate, clientCertificateOf } from "../auth/client-certificate.js";

/** The call's client certificate in Connect's context values; undefined without one. */
export const clientCertificateKey = createContextKey<ClientCertificate | undefined>(undefined, {
  description: "the client certificate of the call's connection",
});

/** A request as Node's HTTP/1.1 and HTTP/2 servers hand it over. */
export type NodeRequest = http.IncomingMessage | http2.Http2ServerRequest;

/** The client certificate of a request's connection, HTTP/1.1 or HTTP/2. */
export function clientCertificateOfRequest(req: NodeRequest): ClientCertificate | undefined {
  const socket = "stream" in req ? req.stream.session?.socket : req.socket;
  return socket instanceof TLSSocket ? clientCertificateOf(socket) : undefined;
}

/** The client certificate of an HTTP/2 stream's connection. */
export function clientCertificateOfStream(
  stream: http2.ServerHttp2Stream,
): ClientCertificate | undefined {
  const socket = stream.session?.socket;
  return socket instanceof TLSSocket ? clientCertificateOf(socket) : undefined;
}
