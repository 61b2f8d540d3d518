// A request body that stalls while a message is due ends its call after
// --read-timeout with DEADLINE_EXCEEDED and its stream reset, on both servers
// and every serving path (docs/security.md, "Bodies before authentication"):
// a client that sends part of a message and then nothing must not hold what
// it sent, nor its stream, for ever. A stream idle between whole messages (a
// KeepAlive between renewals) is not ended by it.

import http from "node:http";
import http2 from "node:http2";
import { create, toBinary } from "@bufbuild/protobuf";
import { beforeAll, describe, expect, it } from "vitest";
import { KeepAliveRequestSchema } from "../src/gen/leasehold/v1/lease_pb.js";
import { readTimeoutText } from "../src/protocol/grpc-frame.js";
import type { RunningServer } from "../src/server/server.js";
import { useTestDatabase } from "./support/fixture.js";
import { within } from "./support/wait.js";

const { startServer, startGuardedServer } = useTestDatabase();

const readTimeoutMs = 500;
const args = ["--read-timeout", `${readTimeoutMs}ms`];
let lease: RunningServer;
let store: RunningServer;

beforeAll(async () => {
  lease = await startServer(args);
  store = await startGuardedServer([...args, "--lease-url", lease.url]);
});

const putPath = "/leasehold.guarded.v1.GuardedStoreService/Put";
const acquirePath = "/leasehold.v1.LeaseService/Acquire";
const watchPath = "/leasehold.v1.LeaseService/Watch";
const keepAlivePath = "/leasehold.v1.LeaseService/KeepAlive";

const connect = { "content-type": "application/proto", "connect-protocol-version": "1" };
const grpcWeb = { "content-type": "application/grpc-web+proto", "x-grpc-web": "1" };
const grpc = { "content-type": "application/grpc", te: "trailers" };

/** The first `sent` bytes of a gRPC frame declaring a 1,000-byte message. */
function partialFrame(sent: number): Buffer {
  const frame = Buffer.alloc(5 + 1_000);
  frame.writeUInt32BE(1_000, 1);
  return frame.subarray(0, sent);
}

const httpCodes: Record<number, string> = { 504: "deadline_exceeded" };
const grpcCodes: Record<string, string> = { "0": "ok", "4": "deadline_exceeded" };

interface Ended {
  code: string;
  message: string;
  /** From the last bytes sent to the answer. */
  elapsedMs: number;
  /** The server reset the stream after its answer. */
  reset: boolean;
}

/**
 * Opens a stream, sends `body` without ending it, and resolves once the
 * server has answered and reset it.
 */
function stall(
  session: http2.ClientHttp2Session,
  path: string,
  headers: Record<string, string>,
  body: Buffer,
): Promise<Ended> {
  return new Promise((resolve) => {
    const stream = session.request({ ":method": "POST", ":path": path, ...headers });
    let sentAt = 0;
    let answer: http2.IncomingHttpHeaders = {};
    let status = 0;
    let elapsedMs = 0;
    stream.on("error", () => {});
    stream.on("response", (h) => {
      elapsedMs = performance.now() - sentAt;
      status = Number(h[":status"]);
      answer = h;
    });
    stream.on("trailers", (t) => {
      answer = { ...answer, ...t };
    });
    // gRPC-Web sends its status in the body: a frame flagged 0x80 of
    // "name:value" lines.
    const received: Buffer[] = [];
    stream.on("data", (chunk: Buffer) => received.push(chunk));
    const settle = (reset: boolean) => {
      const bytes = Buffer.concat(received);
      if (bytes[0] === 0x80) {
        for (const line of bytes.subarray(5).toString().split("\r\n")) {
          const [name = "", ...value] = line.split(":");
          if (name !== "") answer[name.toLowerCase()] = value.join(":").trim();
        }
      }
      const grpcStatus = answer["grpc-status"];
      resolve({
        code:
          typeof grpcStatus === "string"
            ? (grpcCodes[grpcStatus] ?? grpcStatus)
            : (httpCodes[status] ?? `HTTP ${status}`),
        message: decodeURIComponent(String(answer["grpc-message"] ?? "")),
        elapsedMs,
        reset,
      });
    };
    stream.once("aborted", () => settle(true));
    stream.once("close", () => settle(stream.rstCode !== undefined));
    stream.write(body, () => {
      sentAt = performance.now();
    });
  });
}

function open(server: RunningServer): http2.ClientHttp2Session {
  const session = http2.connect(server.url);
  session.on("error", () => {});
  return session;
}

describe(`a body that stalls while a message is due ends after --read-timeout (${readTimeoutMs}ms)`, () => {
  const cases: [string, () => RunningServer, string, Record<string, string>, Buffer][] = [
    ["guarded store Put, Connect", () => store, putPath, connect, Buffer.alloc(100)],
    ["guarded store Put, gRPC-Web", () => store, putPath, grpcWeb, partialFrame(300)],
    ["guarded store Put, gRPC", () => store, putPath, grpc, partialFrame(300)],
    ["lease server Acquire, Connect", () => lease, acquirePath, connect, Buffer.alloc(10)],
    ["lease server Acquire, gRPC-Web", () => lease, acquirePath, grpcWeb, partialFrame(300)],
    ["lease server Acquire, native gRPC", () => lease, acquirePath, grpc, partialFrame(300)],
    // A call that takes one message waits for its body's end, not only a frame's.
    [
      "lease server Watch, native gRPC, no byte sent",
      () => lease,
      watchPath,
      grpc,
      Buffer.alloc(0),
    ],
    [
      "lease server KeepAlive, native gRPC, inside a frame",
      () => lease,
      keepAlivePath,
      grpc,
      partialFrame(3),
    ],
  ];
  for (const [name, server, path, headers, body] of cases) {
    it(`${name}: DEADLINE_EXCEEDED, then the stream is reset`, async () => {
      const session = open(server());
      try {
        const ended = await within(stall(session, path, headers, body), {
          what: "the stalled call to end",
        });
        expect(ended.code).toBe("deadline_exceeded");
        if (ended.message !== "") expect(ended.message).toBe(readTimeoutText(readTimeoutMs));
        expect(ended.reset).toBe(true);
        // Not before the timeout (less a timer's 1 ms of rounding).
        expect(ended.elapsedMs).toBeGreaterThanOrEqual(readTimeoutMs - 1);
      } finally {
        session.destroy();
      }
    });
  }

  it("guarded store Put, Connect over HTTP/1.1: 504 DEADLINE_EXCEEDED, then the connection is closed", async () => {
    const url = new URL(store.url);
    const ended = await within(
      new Promise<{ status: number; code: string; closed: boolean; elapsedMs: number }>(
        (resolve, reject) => {
          let sentAt = 0;
          const req = http.request({
            host: url.hostname,
            port: url.port,
            path: putPath,
            method: "POST",
            agent: false,
            headers: { ...connect, "content-length": "1000", connection: "keep-alive" },
          });
          req.on("error", reject);
          req.on("response", (res) => {
            const elapsedMs = performance.now() - sentAt;
            let text = "";
            res.setEncoding("utf8");
            res.on("data", (chunk: string) => {
              text += chunk;
            });
            res.on("end", () => {
              const code = (JSON.parse(text) as { code: string }).code;
              const settle = () =>
                resolve({ status: res.statusCode ?? 0, code, closed: true, elapsedMs });
              if (req.socket?.destroyed) settle();
              else req.socket?.once("close", settle);
            });
          });
          // 100 of the 1,000 bytes it declares, and then nothing.
          req.write(Buffer.alloc(100), () => {
            sentAt = performance.now();
          });
        },
      ),
      { what: "the stalled HTTP/1.1 call to end and its connection to close" },
    );
    expect(ended).toMatchObject({ status: 504, code: "deadline_exceeded", closed: true });
    expect(ended.elapsedMs).toBeGreaterThanOrEqual(readTimeoutMs - 1);
  });

  it("a KeepAlive stream idle between whole renewals is not ended by it, while a stalled Acquire on its connection is", async () => {
    const session = open(lease);
    try {
      const keepAlive = session.request({ ":method": "POST", ":path": keepAlivePath, ...grpc });
      keepAlive.on("error", () => {});
      const answered = new Promise<http2.IncomingHttpHeaders>((resolve) =>
        keepAlive.once("response", resolve),
      );
      const renewal = toBinary(
        KeepAliveRequestSchema,
        create(KeepAliveRequestSchema, {
          key: { accountId: "idle", sessionId: "s" },
          runId: "0b7a4e5c-1b0f-4d4e-9a56-0c1d2e3f4a5b",
        }),
      );
      const frame = Buffer.alloc(5 + renewal.length);
      frame.writeUInt32BE(renewal.length, 1);
      frame.set(renewal, 5);
      const firstAnswer = new Promise<void>((resolve) => keepAlive.once("data", () => resolve()));
      keepAlive.write(frame);
      await within(firstAnswer, { what: "the answer to the first renewal" });
      // The stream now waits between messages while a stalled call on the
      // same connection runs out its read timeout.
      const stalled = await within(stall(session, acquirePath, grpc, partialFrame(300)), {
        what: "the stalled Acquire to end",
      });
      expect(stalled.code).toBe("deadline_exceeded");
      expect(keepAlive.closed).toBe(false);
      const secondAnswer = new Promise<void>((resolve) => keepAlive.once("data", () => resolve()));
      keepAlive.write(frame);
      await within(secondAnswer, { what: "the answer to a renewal after the idle time" });
      expect((await answered)[":status"]).toBe(200);
      keepAlive.close();
    } finally {
      session.destroy();
    }
  });
});
