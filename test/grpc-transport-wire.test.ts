// The client's gRPC transport at the wire, against scripted HTTP/2 servers:
// what it sends (headers, one 5-byte-prefixed frame per message, RST_STREAM
// CANCEL on cancel and deadline, END_STREAM when the request side ends), how
// it reads (frames split across chunks, many frames in one chunk, trailers-
// only answers, bad answers), its limits, flow control in both directions,
// GOAWAY and close. Where connect-node's gRPC transport (what the client used
// before) defines the answer, both run against the same script and must
// report the same thing: failover and toLeaseholdError read those codes.

import { EventEmitter, once } from "node:events";
import http2 from "node:http2";
import net from "node:net";
import { setImmediate as nextTurn } from "node:timers/promises";
import {
  create,
  type DescMessage,
  fromBinary,
  type MessageInitShape,
  toBinary,
} from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  createClient,
  type Interceptor,
  type Transport,
} from "@connectrpc/connect";
import { setTrailerStatus } from "@connectrpc/connect/protocol-grpc";
import {
  createGrpcTransport as connectNodeGrpcTransport,
  Http2SessionManager,
} from "@connectrpc/connect-node";
import { afterEach, describe, expect, it } from "vitest";
import { brokenConnection } from "../src/client/errors.js";
import { createGrpcTransport, type GrpcTransportOptions } from "../src/client/grpc-transport.js";
import { createEndpoint, createLeaseClient } from "../src/client/index.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import {
  GetRequestSchema,
  GetResponseSchema,
  KeepAliveRequestSchema,
  KeepAliveResponseSchema,
  LeaseSchema,
  LeaseService,
  ListResponseSchema,
  WatchResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";

type Script = (stream: http2.ServerHttp2Stream, request: http2.IncomingHttpHeaders) => void;

interface FakeServer {
  url: string;
  /** Every request stream, in arrival order, with what it received. */
  readonly streams: {
    stream: http2.ServerHttp2Stream;
    headers: http2.IncomingHttpHeaders;
    body: Buffer[];
  }[];
  readonly sessions: http2.ServerHttp2Session[];
  /** Resolves once `n` request streams have arrived. */
  arrived(n?: number): Promise<void>;
  close(): Promise<void>;
}

const servers: FakeServer[] = [];
const cleanups: (() => void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0)) c();
  await Promise.all(servers.splice(0).map((s) => s.close()));
});

async function fakeServer(script: Script): Promise<FakeServer> {
  const streams: FakeServer["streams"] = [];
  const sessions: http2.ServerHttp2Session[] = [];
  const events = new EventEmitter();
  const server = http2.createServer();
  server.on("session", (session) => {
    session.on("error", () => {});
    sessions.push(session);
  });
  server.on("stream", (stream, headers) => {
    stream.on("error", () => {});
    const entry = { stream, headers, body: [] as Buffer[] };
    streams.push(entry);
    stream.on("data", (chunk: Buffer) => entry.body.push(chunk));
    script(stream, headers);
    events.emit("stream");
  });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const port = (server.address() as net.AddressInfo).port;
  const fake: FakeServer = {
    url: `http://127.0.0.1:${port}`,
    streams,
    sessions,
    arrived: async (n = 1) => {
      while (streams.length < n) await once(events, "stream");
    },
    close: async () => {
      for (const s of sessions) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
  servers.push(fake);
  return fake;
}

function frameOf<S extends DescMessage>(schema: S, init: MessageInitShape<S>, flags = 0): Buffer {
  const body = toBinary(schema, create(schema, init));
  const out = Buffer.alloc(5 + body.length);
  out[0] = flags;
  out.writeUInt32BE(body.length, 1);
  out.set(body, 5);
  return out;
}

const ok = { ":status": 200, "content-type": "application/grpc+proto" };

/** Answers with `frames` (written one write each) and then `trailers`. */
function answer(frames: Buffer[], trailers: http2.OutgoingHttpHeaders = { "grpc-status": "0" }) {
  return (stream: http2.ServerHttp2Stream) => {
    stream.respond(ok, { waitForTrailers: true });
    stream.on("wantTrailers", () => stream.sendTrailers(trailers));
    void (async () => {
      for (const f of frames) {
        await new Promise<void>((resolve) => stream.write(f, () => resolve()));
      }
      stream.end();
    })();
  };
}

/** Node headers for a ConnectError, as a gRPC server sends them (connect's own encoder). */
function statusHeaders(error: ConnectError): http2.OutgoingHttpHeaders {
  const out: http2.OutgoingHttpHeaders = {};
  setTrailerStatus(new Headers(), error).forEach((value, key) => {
    out[key] = value;
  });
  return out;
}

type Impl = "leasehold" | "connect-node";
const impls: Impl[] = ["leasehold", "connect-node"];

function transportFor(
  impl: Impl,
  baseUrl: string,
  options: Partial<GrpcTransportOptions> = {},
): Transport {
  if (impl === "leasehold") {
    const t = createGrpcTransport({ baseUrl, ...options });
    cleanups.push(() => t.close());
    return t;
  }
  const sessionManager = new Http2SessionManager(baseUrl);
  cleanups.push(() => sessionManager.abort());
  return connectNodeGrpcTransport({
    baseUrl,
    sessionManager,
    interceptors: options.interceptors,
    defaultTimeoutMs: options.defaultTimeoutMs,
    readMaxBytes: options.readMaxBytes,
  });
}

interface Outcome {
  ok?: unknown;
  code?: string;
  message?: string;
  details?: unknown;
  metadata?: [string, string][];
  broken?: boolean;
}

function describeError(e: unknown): Outcome {
  const ce = ConnectError.from(e);
  return {
    code: Code[ce.code],
    message: ce.rawMessage,
    details: ce.findDetails(ErrorInfoSchema),
    // The date a Node server adds differs from call to call.
    metadata: [...ce.metadata.entries()].filter(([k]) => k !== "date"),
    broken: brokenConnection(ce),
  };
}

async function getOutcome(
  impl: Impl,
  baseUrl: string,
  options: Partial<GrpcTransportOptions> = {},
) {
  const client = createClient(LeaseService, transportFor(impl, baseUrl, options));
  return client
    .get({ key: { accountId: "a", sessionId: "s" } })
    .then((r): Outcome => ({ ok: r }), describeError);
}

/** Runs the same Get against `script` with both transports; they must agree. */
async function sameAsConnectNode(script: Script, options: Partial<GrpcTransportOptions> = {}) {
  const server = await fakeServer(script);
  const [mine, theirs] = [
    await getOutcome("leasehold", server.url, options),
    await getOutcome("connect-node", server.url, options),
  ];
  expect(mine).toEqual(theirs);
  return mine;
}

const lease = create(LeaseSchema, { runId: "r1", fencingToken: 7n, holder: "desktop" });

describe("unary answers: the same outcome as connect-node's gRPC transport", () => {
  it("an answer, its frame split across chunks (the 5-byte prefix too)", async () => {
    const whole = frameOf(GetResponseSchema, { held: true, lease });
    const outcome = await sameAsConnectNode(
      answer([whole.subarray(0, 3), whole.subarray(3, 9), whole.subarray(9)]),
    );
    expect(outcome.ok).toMatchObject({ held: true, lease: { runId: "r1", fencingToken: 7n } });
  });

  it("a message larger than an HTTP/2 frame (it spans many chunks)", async () => {
    const big = frameOf(ListResponseSchema, {
      leases: Array.from({ length: 800 }, (_, i) => ({ ...lease, runId: `run-${i}`.repeat(8) })),
    });
    expect(big.length).toBeGreaterThan(3 * 16_384);
    const server = await fakeServer(answer([big]));
    for (const impl of impls) {
      const client = createClient(LeaseService, transportFor(impl, server.url));
      const listed = await client.list({ accountId: "a" });
      expect(listed.leases).toHaveLength(800);
      expect(listed.leases[799]?.runId).toBe("run-799".repeat(8));
    }
  });

  it("a trailers-only error with a percent-encoded grpc-message, ErrorInfo in grpc-status-details-bin and custom metadata", async () => {
    const error = new ConnectError("lease not held: ✓ 100%", Code.FailedPrecondition, {
      "x-extra": "yes",
    });
    error.details = [
      {
        desc: ErrorInfoSchema,
        value: {
          reason: "LEASE_NOT_HELD",
          domain: "leasehold.dev",
          metadata: { cause: "expired" },
        },
      },
    ] as never;
    const outcome = await sameAsConnectNode((stream) =>
      stream.respond({ ...ok, ...statusHeaders(error) }, { endStream: true }),
    );
    expect(outcome).toMatchObject({
      code: "FailedPrecondition",
      message: "lease not held: ✓ 100%",
      details: [{ reason: "LEASE_NOT_HELD", metadata: { cause: "expired" } }],
    });
    expect(outcome.metadata).toContainEqual(["x-extra", "yes"]);
  });

  it("an error status in the trailers after headers, with a grpc-message only", async () => {
    const outcome = await sameAsConnectNode(
      answer([], { "grpc-status": "5", "grpc-message": "no%20such%20thing" }),
    );
    expect(outcome).toMatchObject({ code: "NotFound", message: "no such thing" });
  });

  it.each([
    ["no grpc-status at all", answer([frameOf(GetResponseSchema, {})], {})],
    ["status 0 but no message", answer([])],
    [
      "two messages for a unary method",
      answer([frameOf(GetResponseSchema, {}), frameOf(GetResponseSchema, {})]),
    ],
    [
      "a compressed frame without grpc-encoding",
      answer([frameOf(GetResponseSchema, { held: true }, 1)]),
    ],
    [
      "an incomplete frame",
      answer([frameOf(GetResponseSchema, { held: true, lease }).subarray(0, 9)]),
    ],
    ["a frame that is not the message", answer([Buffer.from([0, 0, 0, 0, 2, 0xff, 0xff])])],
    ["an unknown grpc-status", answer([], { "grpc-status": "99" })],
    [
      "a message and an error status in the headers",
      (stream: http2.ServerHttp2Stream) => {
        stream.respond({ ...ok, "grpc-status": "13" }, { waitForTrailers: true });
        stream.on("wantTrailers", () => stream.sendTrailers({ "grpc-status": "0" }));
        stream.end(frameOf(GetResponseSchema, {}));
      },
    ],
    [
      "HTTP 503",
      (s: http2.ServerHttp2Stream) => s.respond({ ":status": 503 }, { endStream: true }),
    ],
    [
      "HTTP 404",
      (s: http2.ServerHttp2Stream) => s.respond({ ":status": 404 }, { endStream: true }),
    ],
    [
      "a content type that is not gRPC",
      (s: http2.ServerHttp2Stream) =>
        s.respond({ ":status": 200, "content-type": "text/html" }, { endStream: true }),
    ],
    [
      "a grpc-encoding neither client offered",
      (s: http2.ServerHttp2Stream) =>
        s.respond({ ...ok, "grpc-encoding": "snappy", "grpc-status": "0" }, { endStream: true }),
    ],
  ])("%s", async (_name, script) => {
    const outcome = await sameAsConnectNode(script as Script);
    expect(outcome.ok).toBeUndefined();
  });

  it("a message above readMaxBytes is RESOURCE_EXHAUSTED", async () => {
    const big = frameOf(GetResponseSchema, { lease: { ...lease, holder: "x".repeat(5_000) } });
    const outcome = await sameAsConnectNode(answer([big]), { readMaxBytes: 1_000 });
    expect(outcome.code).toBe("ResourceExhausted");
  });

  it("the server resets the stream: CANCEL is CANCELED, REFUSED_STREAM as connect-node reads it", async () => {
    const canceled = await sameAsConnectNode((stream) =>
      stream.close(http2.constants.NGHTTP2_CANCEL),
    );
    expect(canceled.code).toBe("Canceled");
    const refused = await sameAsConnectNode((stream) =>
      stream.close(http2.constants.NGHTTP2_REFUSED_STREAM),
    );
    expect(refused.ok).toBeUndefined();
  });
});

describe("connections lost: the codes failover reads, as connect-node gives them", () => {
  it("a refused connection is UNAVAILABLE", async () => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1");
    await once(s, "listening");
    const port = (s.address() as net.AddressInfo).port;
    await new Promise((r) => s.close(r));
    const url = `http://127.0.0.1:${port}`;
    const [mine, theirs] = [
      await getOutcome("leasehold", url),
      await getOutcome("connect-node", url),
    ];
    expect(mine).toEqual(theirs);
    expect(mine.code).toBe("Unavailable");
  });

  it("a connection closed under a call (the server went away) is CANCELED", async () => {
    const outcome = await sameAsConnectNode((stream) => {
      stream.respond(ok);
      stream.session?.destroy();
    });
    expect(outcome.code).toBe("Canceled");
  });

  it("a connection reset under a call: a code that fails over (connect-node's timing reads it as CANCELED, this one as ABORTED with ECONNRESET)", async () => {
    const resetting = net.createServer((socket) =>
      socket.on("data", () => socket.resetAndDestroy()),
    );
    resetting.listen(0, "127.0.0.1");
    await once(resetting, "listening");
    try {
      const url = `http://127.0.0.1:${(resetting.address() as net.AddressInfo).port}`;
      for (const impl of impls) {
        const outcome = await getOutcome(impl, url);
        // failsOver in transport.ts: CANCELED, UNAVAILABLE, or ABORTED from a broken connection.
        expect(
          outcome.code === "Canceled" ||
            outcome.code === "Unavailable" ||
            (outcome.code === "Aborted" && outcome.broken === true),
        ).toBe(true);
      }
      const good = await fakeServer(answer([frameOf(GetResponseSchema, { held: true })]));
      const client = createLeaseClient({ baseUrls: [url, good.url], protocol: "grpc" });
      cleanups.push(() => client.close());
      expect((await client.get({ key: { accountId: "a", sessionId: "s" } })).held).toBe(true);
    } finally {
      await new Promise((r) => resetting.close(r));
    }
  });
});

describe("what the transport sends", () => {
  it("te, content-type, grpc-timeout, user-agent and the caller's headers, then one 5-byte-prefixed frame with END_STREAM", async () => {
    const server = await fakeServer(answer([frameOf(GetResponseSchema, {})]));
    const client = createClient(LeaseService, transportFor("leasehold", server.url));
    await client.get(
      { key: { accountId: "a", sessionId: "s" } },
      { timeoutMs: 1_500, headers: { "x-caller": "1" } },
    );
    const [received] = server.streams;
    expect(received?.headers).toMatchObject({
      ":method": "POST",
      ":path": "/leasehold.v1.LeaseService/Get",
      "content-type": "application/grpc+proto",
      te: "trailers",
      "grpc-timeout": "1500m",
      "x-caller": "1",
    });
    expect(received?.headers["user-agent"]).toBeTruthy();
    expect(received?.stream.readableEnded || received?.stream.closed).toBe(true);
    const body = Buffer.concat(received?.body ?? []);
    expect(body[0]).toBe(0);
    expect(body.readUInt32BE(1)).toBe(body.length - 5);
    expect(fromBinary(GetRequestSchema, body.subarray(5)).key).toMatchObject({
      accountId: "a",
      sessionId: "s",
    });
  });

  it("a deadline the server does not meet: DEADLINE_EXCEEDED, and the server sees RST_STREAM CANCEL", async () => {
    const server = await fakeServer((stream) => stream.respond(ok));
    const client = createClient(LeaseService, transportFor("leasehold", server.url));
    const error = await client
      .get({ key: { accountId: "a", sessionId: "s" } }, { timeoutMs: 100 })
      .then(
        () => new ConnectError("the call succeeded", Code.Unknown),
        (e: unknown) => ConnectError.from(e),
      );
    expect(error.code).toBe(Code.DeadlineExceeded);
    const stream = server.streams[0]?.stream as http2.ServerHttp2Stream;
    if (!stream.closed) await new Promise((resolve) => stream.once("close", resolve));
    expect(stream.rstCode).toBe(http2.constants.NGHTTP2_CANCEL);
  });

  it("a cancel: CANCELED with the caller's reason as cause, as connect-node; the server sees RST_STREAM CANCEL", async () => {
    for (const impl of impls) {
      const server = await fakeServer((stream) => stream.respond(ok));
      const client = createClient(LeaseService, transportFor(impl, server.url));
      const cancel = new AbortController();
      const call = client
        .get({ key: { accountId: "a", sessionId: "s" } }, { signal: cancel.signal })
        .then(
          () => new ConnectError("the call succeeded", Code.Unknown),
          (e: unknown) => ConnectError.from(e),
        );
      await server.arrived();
      const reason = new Error("the user closed the tab");
      cancel.abort(reason);
      const error = await call;
      expect(error.code).toBe(Code.Canceled);
      expect(error.cause).toBe(reason);
      const stream = server.streams[0]?.stream as http2.ServerHttp2Stream;
      if (!stream.closed) await new Promise((resolve) => stream.once("close", resolve));
      if (impl === "leasehold") expect(stream.rstCode).toBe(http2.constants.NGHTTP2_CANCEL);
    }
  });
});

describe("streams", () => {
  it("server streaming: many frames in one chunk and frames split across chunks, in order, then the trailers' error", async () => {
    const frames = Array.from({ length: 50 }, (_, i) =>
      frameOf(WatchResponseSchema, { kind: { case: "event", value: { runId: `r${i}` } } }),
    );
    const batch = Buffer.concat(frames.slice(0, 40));
    const tail = Buffer.concat(frames.slice(40));
    const parts = [batch, tail.subarray(0, 2), tail.subarray(2, 30), tail.subarray(30)];
    const server = await fakeServer(
      answer(parts, statusHeaders(new ConnectError("going away", Code.Unavailable))),
    );
    for (const impl of impls) {
      const client = createClient(LeaseService, transportFor(impl, server.url));
      const seen: string[] = [];
      const error = await (async () => {
        for await (const m of client.watch({ key: { accountId: "a", sessionId: "" } })) {
          seen.push(m.kind.case === "event" ? m.kind.value.runId : "?");
        }
      })().then(
        () => new ConnectError("the call succeeded", Code.Unknown),
        (e: unknown) => ConnectError.from(e),
      );
      expect(seen).toEqual(frames.map((_, i) => `r${i}`));
      expect(error).toMatchObject({ code: Code.Unavailable, rawMessage: "going away" });
    }
  });

  it("bidi: each request is one frame; when the request iterable ends the server sees END_STREAM and answers", async () => {
    const server = await fakeServer((stream) => {
      const chunks: Buffer[] = [];
      stream.on("data", (c: Buffer) => chunks.push(c));
      stream.on("end", () => {
        const body = Buffer.concat(chunks);
        const runIds: string[] = [];
        for (let off = 0; off < body.length; ) {
          const length = body.readUInt32BE(off + 1);
          runIds.push(
            fromBinary(KeepAliveRequestSchema, body.subarray(off + 5, off + 5 + length)).runId,
          );
          off += 5 + length;
        }
        answer(runIds.map((runId) => frameOf(KeepAliveResponseSchema, { runId })))(stream);
      });
    });
    for (const impl of impls) {
      const client = createClient(LeaseService, transportFor(impl, server.url));
      async function* requests() {
        for (const runId of ["a", "b", "c"]) yield { runId };
      }
      const answers: string[] = [];
      for await (const r of client.keepAlive(requests())) answers.push(r.runId);
      expect(answers).toEqual(["a", "b", "c"]);
    }
  });

  it("flow control on the request side: a server that stops reading stops the client pulling requests", async () => {
    const server = await fakeServer((stream) => {
      stream.pause();
      stream.respond(ok);
    });
    const client = createClient(LeaseService, transportFor("leasehold", server.url));
    let pulled = 0;
    const total = 1_000;
    async function* requests() {
      for (let i = 0; i < total; i++) {
        pulled += 1;
        yield { runId: `${i}`.padEnd(16_000, "x") };
      }
    }
    const stop = new AbortController();
    const reading = (async () => {
      for await (const _ of client.keepAlive(requests(), { signal: stop.signal })) {
        // nothing arrives
      }
    })().catch(() => {});
    await server.arrived();
    // Without backpressure the writer loop runs on microtasks and would
    // pull all 16 MB within these turns.
    for (let i = 0; i < 50; i++) await nextTurn();
    expect(pulled).toBeGreaterThan(0);
    expect(pulled).toBeLessThan(50);
    stop.abort();
    await reading;
  });

  it("flow control on the response side: a slow reader still gets every message, in order", async () => {
    const count = 2_000;
    const server = await fakeServer(
      answer([
        Buffer.concat(
          Array.from({ length: count }, (_, i) =>
            frameOf(WatchResponseSchema, { kind: { case: "event", value: { runId: `${i}` } } }),
          ),
        ),
      ]),
    );
    const client = createClient(LeaseService, transportFor("leasehold", server.url));
    let expected = 0;
    for await (const m of client.watch({ key: { accountId: "a", sessionId: "" } })) {
      expect(m.kind.case === "event" ? m.kind.value.runId : "").toBe(`${expected}`);
      expected += 1;
      if (expected % 100 === 0) await nextTurn();
    }
    expect(expected).toBe(count);
  });
});

describe("the connection", () => {
  it("after a GOAWAY the next call opens a new connection; the call in flight on the old one completes", async () => {
    let first: http2.ServerHttp2Stream | undefined;
    const server = await fakeServer((stream) => {
      if (first === undefined) {
        first = stream;
        stream.respond(ok, { waitForTrailers: true });
        stream.on("wantTrailers", () => stream.sendTrailers({ "grpc-status": "0" }));
        stream.session?.goaway(http2.constants.NGHTTP2_NO_ERROR, stream.id);
        return;
      }
      answer([frameOf(GetResponseSchema, { held: true })])(stream);
    });
    const client = createClient(LeaseService, transportFor("leasehold", server.url));
    const key = { accountId: "a", sessionId: "s" };
    const inFlight = client.get({ key });
    await server.arrived();
    // The goaway has reached the client once a ping sent after it is answered.
    await new Promise<void>((resolve) => server.sessions[0]?.ping(() => resolve()));
    const second = await client.get({ key });
    expect(second.held).toBe(true);
    expect(server.sessions).toHaveLength(2);
    first?.end(frameOf(GetResponseSchema, { held: false }));
    expect((await inFlight).held).toBe(false);
  });

  it("Endpoint.close() fails the calls on the connection with CANCELED; the next call reconnects", async () => {
    const server = await fakeServer((stream) => {
      if (server.streams.length === 1) {
        stream.respond(ok);
        return;
      }
      answer([frameOf(GetResponseSchema, { held: true })])(stream);
    });
    const endpoint = createEndpoint(server.url, { protocol: "grpc" });
    const client = createClient(LeaseService, endpoint.transport);
    const key = { accountId: "a", sessionId: "s" };
    const hanging = client.get({ key }).then(
      () => new ConnectError("the call succeeded", Code.Unknown),
      (e: unknown) => ConnectError.from(e),
    );
    await server.arrived();
    endpoint.close();
    expect(await hanging).toMatchObject({ code: Code.Canceled, rawMessage: "client closed" });
    expect((await client.get({ key })).held).toBe(true);
    expect(server.sessions).toHaveLength(2);
    endpoint.close();
  });
});

describe("interceptors, as connect runs them", () => {
  it("an interceptor may call next twice (a retry), and req.signal ends with the call", async () => {
    const server = await fakeServer((stream) => {
      if (server.streams.length === 1) {
        stream.respond(
          { ...ok, ...statusHeaders(new ConnectError("busy", Code.Unavailable)) },
          { endStream: true },
        );
        return;
      }
      answer([frameOf(GetResponseSchema, { held: true })])(stream);
    });
    for (const impl of impls) {
      server.streams.length = 0;
      const signals: AbortSignal[] = [];
      const retry: Interceptor = (next) => async (req) => {
        signals.push(req.signal);
        try {
          return await next(req);
        } catch (e) {
          if (ConnectError.from(e).code !== Code.Unavailable) throw e;
          return await next(req);
        }
      };
      const client = createClient(
        LeaseService,
        transportFor(impl, server.url, { interceptors: [retry] }),
      );
      expect((await client.get({ key: { accountId: "a", sessionId: "s" } })).held).toBe(true);
      expect(server.streams).toHaveLength(2);
      expect(signals[0]?.aborted).toBe(true);
    }
  });
});
