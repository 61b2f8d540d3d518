// Issue 25, item 7: a request message sent as 1-byte HTTP/2 DATA frames.
// connect-es's envelope decoder (gRPC, gRPC-Web and Connect streaming bodies
// served by connect-node) sums every buffered chunk of an unfinished message
// on each chunk that arrives: quadratic in the chunks, unauthenticated CPU
// (a 60 KB message took 15.7 s). The server hands the decoder each message
// whole (src/host/whole-messages.ts). These tests trickle real calls
// through a proxy that splits every DATA frame into 1-byte frames, and count
// the chunks the server's decoders are handed: one per message. The native
// gRPC path, which reads frames itself, answers the same calls correctly.
// They assert no time.

import path from "node:path";
import { pathToFileURL } from "node:url";
import { create, type Message } from "@bufbuild/protobuf";
import { BinaryWriter, WireType } from "@bufbuild/protobuf/wire";
import { createClient, type Transport } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import { afterAll, beforeAll, beforeEach, describe, expect, it } from "vitest";
import {
  AcquireRequestSchema,
  type KeepAliveRequest,
  KeepAliveRequestSchema,
  LeaseService,
  WatchRequestSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import type { RunningServer } from "../src/server/server.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { startTricklingProxy, type TricklingProxy } from "./support/raw-http2.js";
import { repoRoot } from "./support/server.js";
import { Pushable, StreamReader } from "./support/streams.js";

// The servers' message bound, told apart from the clients' decoders (4 GiB).
const serverBound = 60_001;
const padding = 3_000;

// ---- counting what the server's envelope decoders are handed -----------------

interface Decoder {
  readonly readMaxBytes: number;
  decode(chunk: Uint8Array): unknown[];
}
const handed = new Map<Decoder, number>();
let restore: (() => void) | undefined;

beforeAll(async () => {
  // connect-es's decoder is internal to its package; its module is the one
  // connect-node loads (same file), so its prototype is the servers' too.
  const file = path.join(
    repoRoot,
    "node_modules/@connectrpc/connect/dist/esm/protocol/envelope.js",
  );
  const envelope = (await import(pathToFileURL(file).href)) as {
    createEnvelopeDecoder(readMaxBytes: number): Decoder;
  };
  const proto = Object.getPrototypeOf(envelope.createEnvelopeDecoder(1)) as Decoder;
  const decode = proto.decode;
  proto.decode = function (this: Decoder, chunk: Uint8Array) {
    if (this.readMaxBytes === serverBound) handed.set(this, (handed.get(this) ?? 0) + 1);
    return decode.call(this, chunk);
  };
  restore = () => {
    proto.decode = decode;
  };
});
afterAll(() => restore?.());
beforeEach(() => handed.clear());

// ---- servers behind the trickling proxy ---------------------------------------

const { startServer, defer } = useTestDatabase();
let native: { server: RunningServer; proxy: TricklingProxy };
let connectPath: { server: RunningServer; proxy: TricklingProxy };

beforeAll(async () => {
  const start = async (grpcPath: string) => {
    const server = await startServer([
      "--grpc-path",
      grpcPath,
      "--max-message-bytes",
      String(serverBound),
    ]);
    const proxy = await startTricklingProxy(server.url);
    defer(() => proxy.close());
    return { server, proxy };
  };
  native = await start("native");
  connectPath = await start("connect");
});

/** A request message with `padding` bytes of an unknown field (binary protobuf keeps it). */
function padded<M extends Message>(message: M): M {
  message.$unknown = [
    {
      no: 1000,
      wireType: WireType.LengthDelimited,
      // The field's bytes after its tag: a length, then the bytes.
      data: new BinaryWriter().bytes(new Uint8Array(padding).fill(7)).finish(),
    },
  ];
  return message;
}

const cases = () =>
  [
    // The native path reads gRPC frames itself (grpc-wire.ts FrameReader,
    // whose copies test/whole-messages.test.ts bounds); connect-node's
    // decoder serves the rest.
    ["gRPC on the native path", native, "grpc"],
    ["connect-node's gRPC (--grpc-path connect)", connectPath, "grpc"],
    ["gRPC-Web over HTTP/2", native, "grpc-web"],
    ["Connect over HTTP/2", native, "connect"],
  ] as const;

function transport(kind: "grpc" | "grpc-web" | "connect", baseUrl: string): Transport {
  if (kind === "grpc") return createGrpcTransport({ baseUrl });
  if (kind === "grpc-web") return createGrpcWebTransport({ baseUrl, httpVersion: "2" });
  return createConnectTransport({ baseUrl, httpVersion: "2" });
}

describe("a request message trickled in 1-byte DATA frames reaches the decoder whole (issue 25, item 7)", () => {
  it.each([
    "gRPC on the native path",
    "connect-node's gRPC (--grpc-path connect)",
    "gRPC-Web over HTTP/2",
    "Connect over HTTP/2",
  ])(
    "%s: unary Acquire, Watch and a KeepAlive of three renewals are answered; each decoder is handed one chunk per message",
    async (name) => {
      const [, target, kind] = cases().find(([n]) => n === name) ?? [];
      if (!target || !kind) throw new Error(name);
      const client = createClient(LeaseService, transport(kind, target.proxy.url));
      const framesBefore = target.proxy.dataFrames;
      const key = freshKey();

      // Unary: S2 — the trickled Acquire is decided like any other.
      const acquired = await client.acquire(
        padded(create(AcquireRequestSchema, { key, ttl: { seconds: 60n }, holder: "trickled" })),
      );
      expect(acquired.acquired).toBe(true);
      const lease = acquired.lease;
      if (!lease) throw new Error("no lease");

      // Server streaming: the Watch's one request message.
      const controller = new AbortController();
      const watch = new StreamReader(
        client.watch(padded(create(WatchRequestSchema, { key })), { signal: controller.signal }),
      );
      const snapshot = await watch.next();
      expect(snapshot.kind.case).toBe("snapshot");
      controller.abort();

      // Both ways: three renewals on one KeepAlive stream (S4: the run's own lease).
      const requests = new Pushable<KeepAliveRequest>();
      const keepAlive = new StreamReader(client.keepAlive(requests));
      for (let i = 0; i < 3; i++) {
        requests.push(
          padded(
            create(KeepAliveRequestSchema, { key, runId: lease.runId, ttl: { seconds: 60n } }),
          ),
        );
        const answer = await keepAlive.next();
        expect(answer.result.case === "lease" && answer.result.value.fencingToken).toBe(
          lease.fencingToken,
        );
      }
      requests.end();
      await keepAlive.finished;

      // The messages really went as 1-byte frames: five messages of over 3 KB.
      expect(target.proxy.dataFrames - framesBefore).toBeGreaterThan(5 * padding);
      // Per decoder: Acquire and Watch one message each, the KeepAlive
      // stream three; Connect unary bodies are not enveloped.
      const expected =
        name === "gRPC on the native path" ? [] : kind === "connect" ? [1, 3] : [1, 1, 3];
      expect([...handed.values()].sort((a, b) => a - b)).toEqual(expected);
    },
  );
});
