// A TCP proxy for fault tests: forwards connections to a target and can
// drop them (RST, and refuse new ones), stall them (hold every byte, keep the
// sockets open: a partition or a frozen peer), delay them (bytes arrive
// late, in order), move to another target (a database endpoint that
// follows the primary at failover), or reset the connection that carries the
// next call of an HTTP/2 client before the server sees it (a load balancer
// cutting a connection as a request goes out). Real sockets end to end;
// nothing above TCP is faked.

import { once } from "node:events";
import net from "node:net";

/** Which way bytes flow: client to server, or server to client. */
export type Direction = "toServer" | "toClient";

export interface TcpProxy {
  /** http://127.0.0.1:<port>, for clients. */
  readonly url: string;
  readonly port: number;
  /** Connections accepted since start. */
  readonly accepted: number;
  /** Connections open now. */
  readonly open: number;
  /** Connections reset by `resetNextCall`, since start. */
  readonly resetCalls: number;
  /** Forward normally; bytes held by `stall` or `delay` flow on. */
  pass(): void;
  /** Reset every open connection and every new one. */
  drop(): void;
  /** Hold every byte of open and new connections, keeping them open. */
  stall(): void;
  /** Deliver each byte `ms` after it arrived, in the given directions (default both). */
  delay(ms: number, directions?: Direction[]): void;
  /**
   * New connections go to `target` (a URL or host:port); open ones are reset,
   * as a load balancer does with the sessions of a backend it marks down.
   */
  retarget(target: string): void;
  /**
   * The next call a client starts (the HTTP/2 HEADERS frame that opens its
   * stream) resets its connection instead of reaching the server: the
   * client sees the reset, the server never sees the call. HTTP/2
   * connections only (gRPC, Connect over HTTP/2): a connection that does
   * not open with the HTTP/2 preface is never reset this way.
   */
  resetNextCall(): void;
  /** Closes the proxy and every connection. */
  close(): Promise<void>;
}

type Mode = "pass" | "drop" | "stall";

class Pipe {
  private readonly queue: { chunk: Buffer; at: number }[] = [];
  private timer: NodeJS.Timeout | undefined;
  delayMs = 0;

  constructor(
    private readonly to: net.Socket,
    private readonly mode: () => Mode,
  ) {}

  push(chunk: Buffer): void {
    this.queue.push({ chunk, at: performance.now() });
    this.pump();
  }

  pump(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    if (this.mode() !== "pass") return;
    while (this.queue.length > 0) {
      const head = this.queue[0] as { chunk: Buffer; at: number };
      const wait = head.at + this.delayMs - performance.now();
      if (wait > 0) {
        this.timer = setTimeout(() => this.pump(), wait);
        return;
      }
      this.queue.shift();
      if (!this.to.destroyed) this.to.write(head.chunk);
    }
  }

  stop(): void {
    clearTimeout(this.timer);
  }
}

interface Connection {
  client: net.Socket;
  upstream: net.Socket;
  pipes: Record<Direction, Pipe>;
  calls: CallScanner;
}

const http2Preface = Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
const headersFrame = 0x1;

/**
 * Follows the frames a client sends on one HTTP/2 connection (RFC 9113 §4.1:
 * a 9-byte header whose first 3 bytes are the payload's length and whose
 * 4th is the type), chunk by chunk, to tell which chunk opens a call. A
 * gRPC or Connect client sends HEADERS only to open a stream (no trailers).
 */
class CallScanner {
  private preface = Buffer.alloc(0);
  private header = Buffer.alloc(0);
  private skip = 0;
  private http2: boolean | undefined;

  /** Reads `chunk`; true when a HEADERS frame starts in it. */
  opensCall(chunk: Buffer): boolean {
    let i = 0;
    if (this.http2 === undefined) {
      const take = Math.min(http2Preface.length - this.preface.length, chunk.length);
      this.preface = Buffer.concat([this.preface, chunk.subarray(0, take)]);
      i = take;
      if (!http2Preface.subarray(0, this.preface.length).equals(this.preface)) this.http2 = false;
      else if (this.preface.length === http2Preface.length) this.http2 = true;
    }
    if (this.http2 !== true) return false;
    let opens = false;
    while (i < chunk.length) {
      if (this.skip > 0) {
        const n = Math.min(this.skip, chunk.length - i);
        this.skip -= n;
        i += n;
        continue;
      }
      const n = Math.min(9 - this.header.length, chunk.length - i);
      this.header = Buffer.concat([this.header, chunk.subarray(i, i + n)]);
      i += n;
      if (this.header.length === 9) {
        if (this.header[3] === headersFrame) opens = true;
        this.skip = this.header.readUIntBE(0, 3);
        this.header = Buffer.alloc(0);
      }
    }
    return opens;
  }
}

/** Starts a proxy on 127.0.0.1, port 0, to `target` (a URL or host:port). */
export async function startTcpProxy(target: string): Promise<TcpProxy> {
  let { host: targetHost, port: targetPort } = hostAndPort(target);
  let mode: Mode = "pass";
  const delays: Record<Direction, number> = { toServer: 0, toClient: 0 };
  const connections = new Set<Connection>();
  let accepted = 0;
  let callsToReset = 0;
  let resetCalls = 0;

  const server = net.createServer((client) => {
    accepted += 1;
    if (mode === "drop") {
      client.resetAndDestroy();
      return;
    }
    const upstream = net.connect({ host: targetHost, port: targetPort });
    const connection: Connection = {
      client,
      upstream,
      pipes: {
        toServer: new Pipe(upstream, () => mode),
        toClient: new Pipe(client, () => mode),
      },
      calls: new CallScanner(),
    };
    connection.pipes.toServer.delayMs = delays.toServer;
    connection.pipes.toClient.delayMs = delays.toClient;
    connections.add(connection);
    client.on("data", (chunk: Buffer) => {
      // Every chunk is scanned, armed or not, to keep track of frame bounds.
      if (connection.calls.opensCall(chunk) && callsToReset > 0) {
        callsToReset -= 1;
        resetCalls += 1;
        client.resetAndDestroy();
        upstream.resetAndDestroy();
        return;
      }
      connection.pipes.toServer.push(chunk);
    });
    upstream.on("data", (chunk: Buffer) => connection.pipes.toClient.push(chunk));
    const end = () => {
      connection.pipes.toServer.stop();
      connection.pipes.toClient.stop();
      client.destroy();
      upstream.destroy();
      connections.delete(connection);
    };
    // A stalled connection must not notice anything either: hold its close.
    client.on("close", () => (mode === "stall" ? undefined : end()));
    upstream.on("close", () => (mode === "stall" ? undefined : end()));
    client.on("error", end);
    upstream.on("error", end);
  });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const port = (server.address() as net.AddressInfo).port;

  const resetAll = () => {
    for (const c of connections) {
      c.client.resetAndDestroy();
      c.upstream.resetAndDestroy();
      connections.delete(c);
    }
  };
  const pumpAll = () => {
    for (const c of connections) {
      c.pipes.toServer.pump();
      c.pipes.toClient.pump();
    }
  };

  return {
    url: `http://127.0.0.1:${port}`,
    port,
    get accepted() {
      return accepted;
    },
    get open() {
      return connections.size;
    },
    get resetCalls() {
      return resetCalls;
    },
    pass: () => {
      mode = "pass";
      pumpAll();
    },
    drop: () => {
      mode = "drop";
      resetAll();
    },
    stall: () => {
      mode = "stall";
    },
    delay: (ms, directions = ["toServer", "toClient"]) => {
      for (const d of directions) delays[d] = ms;
      for (const c of connections) {
        for (const d of directions) c.pipes[d].delayMs = ms;
      }
      pumpAll();
    },
    retarget: (to) => {
      ({ host: targetHost, port: targetPort } = hostAndPort(to));
      resetAll();
    },
    resetNextCall: () => {
      callsToReset = 1;
    },
    close: async () => {
      for (const c of connections) {
        c.client.destroy();
        c.upstream.destroy();
      }
      connections.clear();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

function hostAndPort(target: string): { host: string; port: number } {
  const u = new URL(target.includes("://") ? target : `tcp://${target}`);
  return { host: u.hostname.replace(/^\[|\]$/g, ""), port: Number(u.port) };
}
