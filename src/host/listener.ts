// One port for every protocol: gRPC clients speak HTTP/2 (h2c, or h2 over
// TLS), browsers and curl speak HTTP/1.1. Node's cleartext http2 server does
// not fall back to HTTP/1.1, so a plain TCP server peeks at the first bytes
// and hands the socket to the HTTP/2 server when they are the connection
// preface, else to the HTTP/1.1 server. With TLS, a TLS server in front does
// the same by ALPN. One HTTP/2 server and one HTTP/1.1 server serve both.
//
// Each HTTP/2 stream is offered to `streamHandler` first (the native gRPC
// path serves the calls it has there); any other goes to `handler` through
// Node's compatibility objects, as http2.createServer(handler) would.

import http from "node:http";
import http2 from "node:http2";
import net from "node:net";
import tls from "node:tls";
import { checkCaBundle, secureContextOf, type TlsCredentials } from "./tls-credentials.js";

type Handler = (
  req: http.IncomingMessage | http2.Http2ServerRequest,
  res: http.ServerResponse | http2.Http2ServerResponse,
) => void;

/** Serves an HTTP/2 stream itself and returns true, or returns false to leave it to `handler`. */
export type StreamHandler = (
  stream: http2.ServerHttp2Stream,
  headers: http2.IncomingHttpHeaders,
) => boolean;

const preface = Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");

export interface Listener {
  /** The bound address, with the port the OS chose when 0 was asked. */
  readonly host: string;
  readonly port: number;
  /**
   * Stops accepting, lets in-flight requests finish for up to `graceMs`,
   * then destroys what is left.
   */
  close(graceMs: number): Promise<void>;
}

export interface ListenerOptions {
  host: string;
  port: number;
  handler: Handler;
  streamHandler?: StreamHandler;
  /** Upper bound on concurrent streams per HTTP/2 connection. */
  maxConcurrentStreams?: number;
  /** Largest accepted request body, in bytes (HTTP/2 frames and headers). */
  maxSessionMemoryMb?: number;
  /**
   * Serve TLS only (h2 and HTTP/1.1 by ALPN) with these files, taking new
   * ones as they are reloaded. `clientCertificates`: ask every client for a
   * certificate; none is refused at the handshake (the call policy refuses
   * calls, naming why: tls-credentials.ts, client-certificate.ts).
   */
  tls?: { credentials: TlsCredentials; clientCertificates: boolean };
  /**
   * Time a connection has to finish its opening: the TLS handshake, then the
   * HTTP/2 preface and SETTINGS, or its first HTTP/1.1 request. Default 10 s.
   */
  handshakeTimeoutMs?: number;
  /**
   * An HTTP/2 connection with no open stream for this long is closed with
   * GOAWAY; an HTTP/1.1 connection between requests likewise. Default 5 min.
   */
  idleTimeoutMs?: number;
}

export async function listen(options: ListenerOptions): Promise<Listener> {
  const handshakeTimeoutMs = options.handshakeTimeoutMs ?? 10_000;
  const idleTimeoutMs = options.idleTimeoutMs ?? 300_000;
  const openings = new Openings(handshakeTimeoutMs);
  const clientCertificates = options.tls?.clientCertificates === true;
  const h1 = http.createServer(options.handler as http.RequestListener);
  // Long-lived streams (KeepAlive, Watch) must not be cut by Node's defaults.
  h1.requestTimeout = 0;
  h1.headersTimeout = 30_000;
  h1.keepAliveTimeout = idleTimeoutMs;
  h1.on("request", (req: http.IncomingMessage, res: http.ServerResponse) => {
    openings.opened(req.socket);
    // Its client certificate expired: this answer closes the connection, so
    // the client's next request comes on a new one, with its new certificate.
    if (clientCertificates && certificateExpired(req.socket)) res.shouldKeepAlive = false;
  });
  const h2 = http2.createServer({
    settings: { maxConcurrentStreams: options.maxConcurrentStreams ?? 1000 },
    maxSessionMemory: options.maxSessionMemoryMb ?? 32,
  });
  h2.on("session", (session: http2.ServerHttp2Session) => {
    // The socket is being handed over right now (emit is synchronous); the
    // session's own socket property is a proxy, not that socket.
    const socket = openings.handingOver;
    session.once("remoteSettings", () => {
      if (socket) openings.opened(socket);
    });
    closeWhenIdle(session, idleTimeoutMs);
    if (clientCertificates && socket instanceof tls.TLSSocket) {
      closeAtCertificateExpiry(session, socket);
    }
  });
  h2.on(
    "stream",
    (
      stream: http2.ServerHttp2Stream,
      headers: http2.IncomingHttpHeaders,
      _flags: number,
      rawHeaders: string[],
    ) => {
      if (options.streamHandler?.(stream, headers)) return;
      compat(options.handler, stream, headers, rawHeaders);
    },
  );
  const connections = trackConnections(h2);

  const front = options.tls
    ? tls.createServer(
        {
          ...secureContextOf(options.tls.credentials.files()),
          ALPNProtocols: ["h2", "http/1.1"],
          handshakeTimeout: handshakeTimeoutMs,
          requestCert: options.tls.clientCertificates,
          rejectUnauthorized: false,
        },
        (socket) => {
          openings.begin(socket);
          connections.add(socket);
          openings.handOver(socket, socket.alpnProtocol === "h2" ? h2 : h1);
        },
      )
    : net.createServer((socket) => {
        openings.begin(socket);
        connections.add(socket);
        // Read the first bytes in paused mode and put them back: both servers
        // then find them in the socket's buffer (Node's HTTP/2 session feeds
        // already-buffered bytes to nghttp2 before reading from the handle).
        socket.once("readable", () => {
          const chunk = socket.read() as Buffer | null;
          if (chunk === null) return;
          const n = Math.min(chunk.length, preface.length);
          const isH2 = chunk.subarray(0, n).equals(preface.subarray(0, n));
          socket.unshift(chunk);
          openings.handOver(socket, isH2 ? h2 : h1);
        });
      });
  // A client that fails the handshake, or resets its socket, must not leave
  // an error unhandled. One that sent plain HTTP (or other bytes that are no
  // TLS record) is told the port speaks TLS, where it got an empty reply.
  front.on("tlsClientError", (error: NodeJS.ErrnoException, socket: tls.TLSSocket) => {
    if (error.code !== undefined && notTls.has(error.code)) explainTls(socket);
  });
  if (front instanceof tls.Server && options.tls) {
    const server = front;
    options.tls.credentials.use((files) => {
      const context = secureContextOf(files);
      // Throws when the key is not the certificate's or a PEM does not parse;
      // the client CA bundle is checked apart (createSecureContext drops what
      // does not parse).
      if (files.clientCa) checkCaBundle(files.clientCa);
      tls.createSecureContext(context);
      return () => server.setSecureContext(context);
    });
  }
  return serveOn(front, options, connections, () => h1.closeIdleConnections());
}

// OpenSSL's errors for a first record that is not TLS: an HTTP request, a
// proxy's CONNECT, anything else (an h2c preface, junk).
const notTls = new Set([
  "ERR_SSL_HTTP_REQUEST",
  "ERR_SSL_HTTPS_PROXY_REQUEST",
  "ERR_SSL_WRONG_VERSION_NUMBER",
]);

const speaksTls = Buffer.from(
  "This port speaks TLS: use https:// (curl https://..., leasehold --server https://...).\n",
);

/**
 * Answers a connection that is not TLS with an HTTP/1.1 400 saying so, in
 * clear text. The TLS socket would encrypt it; the plain socket beneath it
 * is Node's `_parent` (not public API, hence the check that it is there).
 */
function explainTls(socket: tls.TLSSocket): void {
  const raw = (socket as tls.TLSSocket & { _parent?: unknown })._parent;
  if (!(raw instanceof net.Socket) || raw.destroyed) return;
  raw.on("error", () => {});
  raw.end(
    Buffer.concat([
      Buffer.from(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n" +
          `content-length: ${speaksTls.length}\r\nconnection: close\r\n\r\n`,
      ),
      speaksTls,
    ]),
  );
}

/**
 * Connections that have not finished their opening, each with its deadline.
 * Neither server bounds this on its own: a socket that never sends a byte is
 * handed to neither, nghttp2 waits for a preface forever, and Node's
 * HTTP/1.1 headersTimeout is only checked every 30 s.
 */
class Openings {
  private readonly timers = new Map<net.Socket, NodeJS.Timeout>();
  /** The socket being handed to a server, for the 'session' listener that runs meanwhile. */
  handingOver: net.Socket | undefined;

  constructor(private readonly timeoutMs: number) {}

  begin(socket: net.Socket): void {
    if (this.timers.has(socket)) return;
    const timer = setTimeout(() => {
      this.timers.delete(socket);
      socket.destroy();
    }, this.timeoutMs);
    // The listener keeps the process alive, not a pending deadline.
    timer.unref();
    this.timers.set(socket, timer);
    socket.once("close", () => this.opened(socket));
  }

  handOver(socket: net.Socket, server: net.Server | http2.Http2Server): void {
    this.handingOver = socket;
    try {
      server.emit("connection", socket);
    } finally {
      this.handingOver = undefined;
    }
  }

  /** The connection finished its opening (or closed): no deadline any more. */
  opened(socket: net.Socket): void {
    const timer = this.timers.get(socket);
    if (timer === undefined) return;
    clearTimeout(timer);
    this.timers.delete(socket);
  }
}

/**
 * Closes an HTTP/2 session (GOAWAY, then the socket) once it has had no open
 * stream for `idleMs`. Node's own session timeout counts frames, so it would
 * cut a quiet Watch stream; this counts streams instead.
 */
/**
 * The notAfter of a TLS connection's verified client certificate (wall clock
 * ms), read once per socket; infinite without one. A certificate refused at
 * the handshake (expired then, among others) is answered per call, naming
 * why, on a connection left open.
 */
const certificateUntil = new WeakMap<net.Socket, number>();

function certificateUntilMs(socket: net.Socket): number {
  let until = certificateUntil.get(socket);
  if (until === undefined) {
    const verified = socket instanceof tls.TLSSocket && socket.authorized;
    const peer = verified ? socket.getPeerCertificate() : undefined;
    until = peer?.valid_to ? Date.parse(peer.valid_to) : Number.POSITIVE_INFINITY;
    certificateUntil.set(socket, Number.isNaN(until) ? Number.POSITIVE_INFINITY : until);
  }
  return certificateUntil.get(socket) as number;
}

function certificateExpired(socket: net.Socket): boolean {
  return Date.now() >= certificateUntilMs(socket);
}

/**
 * Closes an HTTP/2 connection with GOAWAY once its client certificate has
 * expired. Every call on it is refused from then on (certificate_expired),
 * and a client keeps a healthy connection for as long as it likes: without
 * this, one that has already rotated its certificate would never open the
 * connection that presents it. Open streams run on to their own end (the
 * call policy ends the certificate's streams at the same moment).
 */
function closeAtCertificateExpiry(session: http2.ServerHttp2Session, socket: tls.TLSSocket): void {
  const until = certificateUntilMs(socket);
  if (until === Number.POSITIVE_INFINITY) return;
  let timer: NodeJS.Timeout | undefined;
  const arm = () => {
    const left = until - Date.now();
    if (left <= 0) {
      if (!session.closed && !session.destroyed) session.close();
      return;
    }
    // setTimeout holds at most 2^31−1 ms; a certificate may last years.
    timer = setTimeout(arm, Math.min(left, 2 ** 31 - 1));
    timer.unref();
  };
  session.once("close", () => clearTimeout(timer));
  arm();
}

function closeWhenIdle(session: http2.ServerHttp2Session, idleMs: number): void {
  let open = 0;
  let timer: NodeJS.Timeout | undefined;
  const arm = () => {
    timer = setTimeout(() => session.close(), idleMs);
    timer.unref();
  };
  session.on("stream", (stream: http2.ServerHttp2Stream) => {
    open += 1;
    clearTimeout(timer);
    stream.once("close", () => {
      open -= 1;
      if (open === 0 && !session.closed && !session.destroyed) arm();
    });
  });
  session.once("close", () => clearTimeout(timer));
  arm();
}

/** Hands a stream to a compatibility-API handler, as Node's http2 server does for 'request'. */
function compat(
  handler: Handler,
  stream: http2.ServerHttp2Stream,
  headers: http2.IncomingHttpHeaders,
  rawHeaders: string[],
): void {
  const Request = http2.Http2ServerRequest as unknown as new (
    stream: http2.ServerHttp2Stream,
    headers: http2.IncomingHttpHeaders,
    options: undefined,
    rawHeaders: string[],
  ) => http2.Http2ServerRequest;
  const Response = http2.Http2ServerResponse as unknown as new (
    stream: http2.ServerHttp2Stream,
  ) => http2.Http2ServerResponse;
  const request = new Request(stream, headers, undefined, rawHeaders);
  const response = new Response(stream);
  if (headers[":method"] === "CONNECT") {
    response.statusCode = 405;
    response.end();
    return;
  }
  if (headers.expect !== undefined) {
    if (headers.expect !== "100-continue") {
      response.statusCode = 417;
      response.end();
      return;
    }
    response.writeContinue();
  }
  handler(request, response);
}

interface Connections {
  add(socket: net.Socket): void;
  /** Asks HTTP/2 sessions to finish, waits up to graceMs for every socket to close, destroys the rest. */
  drain(graceMs: number): Promise<void>;
}

// The sockets and HTTP/2 sessions of a server, so that close() can let
// in-flight calls finish before it cuts what is left.
function trackConnections(h2: http2.Http2Server): Connections {
  const sessions = new Set<http2.ServerHttp2Session>();
  const sockets = new Set<net.Socket>();
  let onDrained: (() => void) | undefined;
  h2.on("session", (session: http2.ServerHttp2Session) => {
    sessions.add(session);
    session.once("close", () => sessions.delete(session));
  });
  return {
    add: (socket) => {
      sockets.add(socket);
      socket.setNoDelay(true);
      socket.once("error", () => socket.destroy());
      socket.once("close", () => {
        sockets.delete(socket);
        if (sockets.size === 0) onDrained?.();
      });
    },
    drain: async (graceMs) => {
      for (const session of sessions) session.close();
      const drained = new Promise<void>((resolve) => {
        onDrained = resolve;
        if (sockets.size === 0) resolve();
      });
      const timer = new Promise<void>((resolve) => setTimeout(resolve, graceMs).unref());
      await Promise.race([drained, timer]);
      for (const socket of sockets) socket.destroy();
    },
  };
}

async function serveOn(
  server: net.Server,
  options: ListenerOptions,
  connections: Connections,
  closeIdle: () => void,
): Promise<Listener> {
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen({ host: options.host, port: options.port }, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const address = server.address() as net.AddressInfo;
  return {
    host: address.address,
    port: address.port,
    close: async (graceMs) => {
      const closed = new Promise<void>((resolve) => server.close(() => resolve()));
      closeIdle();
      await connections.drain(graceMs);
      await closed;
    },
  };
}
