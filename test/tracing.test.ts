// Tracing (docs/operations.md, "Tracing"): OpenTelemetry spans made by the
// tracing step of the one call policy (src/server/rpc/tracing-step.ts) and by
// the group commit (src/server/observability/tracing.ts). The spans are read
// from the SDK's in-memory exporter, given to servers in this process through
// LeaseServerExtensions.tracerProvider, and, in one test, from an OTLP/HTTP
// receiver on a local port that the standard OTEL_* variables point at.
//
// - A span per call on every path (native gRPC or connect-node's gRPC,
//   Connect, gRPC-Web), unary and streaming, with the method, the path, the
//   account and the outcome; the session id only with --trace-session-keys.
//   Each call's requests carry its span into the batched statement: the
//   statement that decided a Get or a KeepAlive renewal links to its span.
// - The caller's W3C traceparent is continued, from a raw header and from
//   the client library's `traceparent` option.
// - A group-committed statement is one span linked to every call of its
//   batch: a table lock holds the first Acquire's statement in flight while
//   two more Acquires queue behind it and then go out together.
// - With tracing off no span is made; OTEL_SDK_DISABLED and
//   OTEL_TRACES_EXPORTER=none turn it off, unsupported exporters are refused.
//
// Every test runs on a server with `--grpc-path native` and on one with
// `--grpc-path connect`, so a gRPC client reaches both serving paths.

import { randomBytes, randomUUID } from "node:crypto";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { type Client, createClient } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import { SpanKind } from "@opentelemetry/api";
import {
  AlwaysOffSampler,
  BasicTracerProvider,
  InMemorySpanExporter,
  ParentBasedSampler,
  type ReadableSpan,
  SimpleSpanProcessor,
} from "@opentelemetry/sdk-trace-base";
import { beforeAll, describe, expect, it } from "vitest";
import { ConfigError } from "../src/config/settings.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { parseServerConfig } from "../src/server/config/server-config.js";
import { createTracing } from "../src/server/observability/tracing.js";
import type { LeaseServer } from "../src/server/server.js";
import { seconds } from "./support/calls.js";
import { openTransaction } from "./support/db.js";
import { useTestDatabase } from "./support/fixture.js";
import { testServerArgs } from "./support/server.js";
import { bearer, createTestKeys, type TestKeys } from "./support/tokens.js";
import { waitFor, within } from "./support/wait.js";

const { db, startServer, libraryClient, defer } = useTestDatabase();
const exporter = new InMemorySpanExporter();
const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
let keys: TestKeys;
const servers = {} as Record<"native" | "connect" | "off", LeaseServer>;
const account = "alice";

beforeAll(async () => {
  keys = await createTestKeys();
  // A statement held by a test's table lock waits for the lock, not for a timeout.
  const common = [...keys.args, "--lock-timeout", "30s", "--statement-timeout", "30s"];
  const tracing = { tracerProvider: provider };
  servers.native = await startServer(
    [...common, "--grpc-path", "native", "--tracing", "on", "--trace-session-keys", "on"],
    {},
    undefined,
    tracing,
  );
  servers.connect = await startServer(
    [...common, "--grpc-path", "connect", "--tracing", "on"],
    {},
    undefined,
    tracing,
  );
  // Given the same provider, but tracing is off.
  servers.off = await startServer([...common, "--grpc-path", "native"], {}, undefined, tracing);
});

type LeaseClient = Client<typeof LeaseService>;
type Protocol = "grpc" | "connect" | "grpc-web";

function clientOf(url: string, protocol: Protocol): LeaseClient {
  if (protocol === "grpc") return createClient(LeaseService, createGrpcTransport({ baseUrl: url }));
  if (protocol === "grpc-web") {
    return createClient(LeaseService, createGrpcWebTransport({ baseUrl: url, httpVersion: "1.1" }));
  }
  return createClient(LeaseService, createConnectTransport({ baseUrl: url, httpVersion: "2" }));
}

const finished = () => exporter.getFinishedSpans();

/** The span of the call with this x-request-id, once it has ended. */
const callSpan = (requestId: string) =>
  waitFor(() => finished().find((s) => s.attributes["leasehold.request_id"] === requestId), {
    what: `the span of call ${requestId}`,
  });

/** The statement span named `name` that links to every one of `calls`. */
const statementLinking = (name: string, calls: readonly ReadableSpan[]) =>
  waitFor(
    () =>
      finished().find(
        (s) =>
          s.name === name &&
          calls.every((c) => s.links.some((l) => l.context.spanId === c.spanContext().spanId)),
      ),
    { what: `a "${name}" span linked to ${calls.map((c) => c.name).join(", ")}` },
  );

const randomHex = (bytes: number) => randomBytes(bytes).toString("hex");

for (const mode of ["native", "connect"] as const) {
  describe(`--grpc-path ${mode}`, () => {
    const server = () => servers[mode];
    const grpcName = mode === "native" ? "grpc-native" : "grpc";

    it("a span per call on every path, unary and streaming, with the method, the path, the account and the outcome; the statement that decided the call links to it", async () => {
      const token = await keys.token(account);
      const cases: { protocol: Protocol; path: string; method: "Get" | "Watch" | "KeepAlive" }[] = [
        { protocol: "grpc", path: grpcName, method: "Get" },
        { protocol: "connect", path: "connect", method: "Get" },
        { protocol: "grpc-web", path: "grpc-web", method: "Get" },
        { protocol: "grpc", path: grpcName, method: "Watch" },
        { protocol: "connect", path: "connect", method: "Watch" },
        { protocol: "grpc-web", path: "grpc-web", method: "Watch" },
        { protocol: "grpc", path: grpcName, method: "KeepAlive" },
        { protocol: "connect", path: "connect", method: "KeepAlive" },
      ];
      for (const c of cases) {
        const client = clientOf(server().url, c.protocol);
        const key = { accountId: account, sessionId: `span-${mode}-${c.protocol}-${c.method}` };
        const requestId = `trace-${randomUUID()}`;
        const options = { headers: { ...bearer(token).headers, "x-request-id": requestId } };
        if (c.method === "Get") {
          await client.get({ key }, options);
        } else if (c.method === "Watch") {
          // Cancelled by the client after the snapshot.
          const controller = new AbortController();
          await within(
            (async () => {
              try {
                for await (const _ of client.watch(
                  { key },
                  { ...options, signal: controller.signal },
                )) {
                  controller.abort();
                }
              } catch {
                // the client's own abort
              }
            })(),
            { what: `${c.protocol}: the Watch snapshot` },
          );
        } else {
          const granted = await client.acquire({ key, ttl: seconds(60) }, bearer(token));
          const runId = granted.lease?.runId ?? "";
          async function* requests() {
            yield { key, runId };
          }
          const answers: string[] = [];
          for await (const m of client.keepAlive(requests(), options)) {
            answers.push(m.result.case ?? "");
          }
          expect(answers).toEqual(["lease"]);
        }

        const span = await callSpan(requestId);
        expect(span.name, c.protocol).toBe(`leasehold.v1.LeaseService/${c.method}`);
        expect(span.kind).toBe(SpanKind.SERVER);
        expect(span.attributes).toMatchObject({
          "rpc.method": `leasehold.v1.LeaseService/${c.method}`,
          "rpc.system.name": c.protocol === "connect" ? "connectrpc" : "grpc",
          "leasehold.protocol": c.path,
          "leasehold.account_id": account,
          "rpc.status_code": c.method === "Watch" ? "CANCELLED" : "OK",
        });
        // Session ids only where --trace-session-keys allows them.
        expect(span.attributes["leasehold.session_id"]).toBe(
          mode === "native" ? key.sessionId : undefined,
        );
        // The request carried the call's span into its batch.
        if (c.method === "Get") await statementLinking("get leases", [span]);
        if (c.method === "KeepAlive") await statementLinking("keepalive renew leases", [span]);
      }
    });

    it("the caller's traceparent is continued: the call's span is its child, on gRPC, Connect and gRPC-Web, unary and streaming", async () => {
      const token = await keys.token(account);
      for (const protocol of ["grpc", "connect", "grpc-web"] as const) {
        const client = clientOf(server().url, protocol);
        const key = { accountId: account, sessionId: `parent-${mode}-${protocol}` };
        for (const method of ["Get", "Watch"] as const) {
          const traceId = randomHex(16);
          const parentId = randomHex(8);
          const requestId = `parent-${randomUUID()}`;
          const headers = {
            ...bearer(token).headers,
            "x-request-id": requestId,
            traceparent: `00-${traceId}-${parentId}-01`,
          };
          if (method === "Get") {
            await client.get({ key }, { headers });
          } else {
            const controller = new AbortController();
            try {
              for await (const _ of client.watch({ key }, { headers, signal: controller.signal })) {
                controller.abort();
              }
            } catch {
              // the client's own abort
            }
          }
          const span = await callSpan(requestId);
          expect(span.spanContext().traceId, `${protocol} ${method}`).toBe(traceId);
          expect(span.parentSpanContext?.spanId, `${protocol} ${method}`).toBe(parentId);
          expect(span.parentSpanContext?.isRemote).toBe(true);
        }
      }
    });

    it("the client library's traceparent option continues the caller's trace (gRPC and Connect)", async () => {
      const token = await keys.token(account);
      for (const protocol of ["grpc", "connect"] as const) {
        const traceId = randomHex(16);
        const parentId = randomHex(8);
        const client = libraryClient({
          baseUrl: server().url,
          protocol,
          token,
          traceparent: () => `00-${traceId}-${parentId}-01`,
        });
        await client.get({ key: { accountId: account, sessionId: `library-${mode}` } });
        const span = await waitFor(
          () =>
            finished().find(
              (s) => s.spanContext().traceId === traceId && s.kind === SpanKind.SERVER,
            ),
          { what: `${protocol}: the span of the library's Get in trace ${traceId}` },
        );
        expect(span.name).toBe("leasehold.v1.LeaseService/Get");
        expect(span.parentSpanContext?.spanId).toBe(parentId);
      }
    });

    it("a group-committed statement is one span linked to every call of its batch", async () => {
      const token = await keys.token(account);
      const stats = server().streaming.storeStats.acquire;
      const acquire = (protocol: Protocol, requestId: string) =>
        clientOf(server().url, protocol).acquire(
          { key: { accountId: account, sessionId: `batch-${mode}-${protocol}` }, ttl: seconds(60) },
          { headers: { ...bearer(token).headers, "x-request-id": requestId } },
        );
      const ids = {
        first: `batch-first-${randomUUID()}`,
        second: `batch-second-${randomUUID()}`,
        third: `batch-third-${randomUUID()}`,
      };
      // The first Acquire's statement waits on the table lock; the next two
      // queue behind it (one statement of a kind in flight) and go out together.
      const lock = await openTransaction(
        db,
        (tx) => tx`LOCK TABLE leases IN ACCESS EXCLUSIVE MODE`,
      );
      const sentBefore = stats.statements;
      const first = acquire("grpc", ids.first);
      await waitFor(() => stats.statements === sentBefore + 1, {
        what: "the first Acquire's statement to be sent",
      });
      const second = acquire("connect", ids.second);
      const third = acquire("grpc-web", ids.third);
      await waitFor(() => stats.queued === 2, { what: "two Acquires queued behind it" });
      await lock.end();
      const answers = await Promise.all([first, second, third]);
      expect(answers.map((a) => a.acquired)).toEqual([true, true, true]);
      expect(stats.statements).toBe(sentBefore + 2);

      const [a, b, c] = await Promise.all([
        callSpan(ids.first),
        callSpan(ids.second),
        callSpan(ids.third),
      ]);
      const batch = await statementLinking("acquire leases", [b, c]);
      expect(batch.links).toHaveLength(2);
      expect(batch.attributes).toMatchObject({
        "db.system.name": "postgresql",
        "db.operation.name": "acquire",
        "db.operation.batch.size": 2,
      });
      expect(batch.kind).toBe(SpanKind.CLIENT);
      // In the first call's trace (so a parent-based sampler keeps it), linked to both.
      expect(batch.parentSpanContext?.spanId).toBe(b.spanContext().spanId);
      expect(batch.spanContext().traceId).toBe(b.spanContext().traceId);
      const alone = await statementLinking("acquire leases", [a]);
      expect(alone.links).toHaveLength(1);
    });
  });
}

it("a waiting Acquire woken by another call's Release is not part of that call's trace", async () => {
  const token = await keys.token(account);
  const server = servers.native;
  const client = clientOf(server.url, "grpc");
  const key = { accountId: account, sessionId: `woken-${randomUUID()}` };
  const held = await client.acquire({ key, ttl: seconds(60) }, bearer(token));
  const headers = (requestId: string) => ({
    headers: { ...bearer(token).headers, "x-request-id": requestId },
  });
  const waitingId = `waiting-${randomUUID()}`;
  const waitingBefore = server.streaming.waiters.stats.waiting;
  const waiting = client.acquire({ key, ttl: seconds(60), wait: seconds(30) }, headers(waitingId));
  await waitFor(() => server.streaming.waiters.stats.waiting === waitingBefore + 1, {
    what: "the Acquire to wait",
  });
  const releaseId = `release-${randomUUID()}`;
  await client.release({ key, runId: held.lease?.runId ?? "" }, headers(releaseId));
  expect((await waiting).acquired).toBe(true);
  const release = await callSpan(releaseId);
  await callSpan(waitingId);
  // The Release's own statement links to it; the attempt it woke does not.
  await statementLinking("release leases", [release]);
  const linkedToRelease = finished().filter((s) =>
    s.links.some((l) => l.context.spanId === release.spanContext().spanId),
  );
  expect(linkedToRelease.map((s) => s.name)).toEqual(["release leases"]);
});

it("a statement that decided a sampled call is kept by a sampler that samples no root (parentbased, root off)", async () => {
  // The sampling docs/operations.md suggests, at its extreme: only callers'
  // sampled traces are kept. Their calls' statements must be kept with them.
  const sampledOnly = new InMemorySpanExporter();
  const tracing = createTracing({
    exporters: [],
    provider: new BasicTracerProvider({
      sampler: new ParentBasedSampler({ root: new AlwaysOffSampler() }),
      spanProcessors: [new SimpleSpanProcessor(sampledOnly)],
    }),
  });
  const traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
  const headers: Record<string, string> = { traceparent: `00-${traceId}-00f067aa0ba902b7-01` };
  const call = tracing.startCall(
    "leasehold.v1.LeaseService/Acquire",
    (n) => headers[n] ?? null,
    {},
  );
  expect(call.isRecording()).toBe(true);
  const link = tracing.within(call, () => tracing.statements.link());
  expect(link?.spanId).toBe(call.spanContext().spanId);
  await tracing.statements.statement("acquire", link ? [link] : [], 1, async () => 1);
  call.end();
  const statement = sampledOnly.getFinishedSpans().find((s) => s.name === "acquire leases");
  expect(statement, "the statement span was sampled").toBeDefined();
  expect(statement?.spanContext().traceId).toBe(traceId);
  expect(statement?.links.map((l) => l.context.spanId)).toEqual([call.spanContext().spanId]);
  // A call without a traceparent is a root the sampler drops: nothing is linked to it.
  const unsampled = tracing.startCall("leasehold.v1.LeaseService/Get", () => null, {});
  expect(unsampled.isRecording()).toBe(false);
  expect(tracing.within(unsampled, () => tracing.statements.link())).toBeUndefined();
  await tracing.shutdown();
});

it("with tracing off, no span is made on any path, and no statement span", async () => {
  const token = await keys.token(account);
  exporter.reset();
  const offIds: string[] = [];
  for (const protocol of ["grpc", "connect", "grpc-web"] as const) {
    const client = clientOf(servers.off.url, protocol);
    const key = { accountId: account, sessionId: `off-${protocol}` };
    const requestId = `off-${randomUUID()}`;
    offIds.push(requestId);
    const headers = { ...bearer(token).headers, "x-request-id": requestId };
    const granted = await client.acquire({ key, ttl: seconds(60) }, { headers });
    if (protocol === "grpc-web") continue;
    async function* requests() {
      yield { key, runId: granted.lease?.runId ?? "" };
    }
    for await (const _ of client.keepAlive(requests(), { headers })) {
      // the one renewal's answer
    }
  }
  // A barrier: a call to a server with tracing on, whose spans end after
  // everything the calls above could have made.
  const barrierId = `barrier-${randomUUID()}`;
  await clientOf(servers.native.url, "grpc").get(
    { key: { accountId: account, sessionId: "barrier" } },
    { headers: { ...bearer(token).headers, "x-request-id": barrierId } },
  );
  const barrier = await callSpan(barrierId);
  await statementLinking("get leases", [barrier]);
  const others = finished().filter(
    (s) =>
      s !== barrier &&
      !(s.links.length === 1 && s.links[0]?.context.spanId === barrier.spanContext().spanId),
  );
  expect(others.map((s) => `${s.name} ${String(s.attributes["leasehold.request_id"])}`)).toEqual(
    [],
  );
});

it("spans reach an OTLP/HTTP receiver configured by the standard OTEL_* variables", async () => {
  const received: { service: string | undefined; spans: { name: string; requestId: unknown }[] }[] =
    [];
  const receiver = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (chunk: Buffer) => chunks.push(chunk));
    req.on("end", () => {
      if (req.url === "/v1/traces") {
        received.push(...readOtlpJson(Buffer.concat(chunks).toString("utf8")));
      }
      res.writeHead(200, { "content-type": "application/json" });
      res.end("{}");
    });
  });
  await new Promise<void>((resolve) => receiver.listen(0, "127.0.0.1", resolve));
  // Closed after the server, which exports what it still buffers when it closes.
  defer(() => new Promise((resolve) => receiver.close(resolve)));
  const { port } = receiver.address() as AddressInfo;
  const otel = {
    OTEL_TRACES_EXPORTER: "otlp",
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "http/json",
    OTEL_EXPORTER_OTLP_ENDPOINT: `http://127.0.0.1:${port}`,
    OTEL_BSP_SCHEDULE_DELAY: "50",
    OTEL_SERVICE_NAME: "leasehold-tracing-test",
  };
  // The SDK reads its variables from the process environment when the server starts.
  const saved = Object.fromEntries(Object.keys(otel).map((k) => [k, process.env[k]]));
  Object.assign(process.env, otel);
  let server: LeaseServer;
  try {
    const config = parseServerConfig(
      [...testServerArgs, "--database-url", db.url, ...keys.args, "--tracing", "on"],
      otel,
    );
    expect(config.tracing).toEqual({
      enabled: true,
      exporters: ["otlp-http-json"],
      sessionKeys: false,
    });
    server = await startServer([], config);
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
  const requestId = `otlp-${randomUUID()}`;
  await clientOf(server.url, "connect").get(
    { key: { accountId: account, sessionId: "otlp" } },
    { headers: { ...bearer(await keys.token(account)).headers, "x-request-id": requestId } },
  );
  const batch = await waitFor(
    () => received.find((r) => r.spans.some((s) => s.requestId === requestId)),
    { what: "the Get's span at the OTLP receiver" },
  );
  expect(batch.service).toBe("leasehold-tracing-test");
  expect(batch.spans.find((s) => s.requestId === requestId)?.name).toBe(
    "leasehold.v1.LeaseService/Get",
  );
});

it("OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none turn tracing off; an exporter or protocol the server cannot use is refused, naming the variable", () => {
  const parse = (env: NodeJS.ProcessEnv, args = ["--tracing", "on"]) =>
    parseServerConfig(["--listen", "127.0.0.1:0", ...args], env).tracing;
  expect(parse({})).toEqual({
    enabled: true,
    exporters: ["otlp-http-protobuf"],
    sessionKeys: false,
  });
  expect(parse({}, []).enabled).toBe(false);
  expect(parse({ LEASEHOLD_TRACING: "on", OTEL_TRACES_EXPORTER: "console,otlp" }, [])).toEqual({
    enabled: true,
    exporters: ["console", "otlp-http-protobuf"],
    sessionKeys: false,
  });
  expect(parse({ OTEL_SDK_DISABLED: "true" }).enabled).toBe(false);
  expect(parse({ OTEL_TRACES_EXPORTER: "none" }).enabled).toBe(false);
  expect(parse({ OTEL_EXPORTER_OTLP_PROTOCOL: "http/json" }).exporters).toEqual(["otlp-http-json"]);
  expect(() => parse({ OTEL_TRACES_EXPORTER: "zipkin" })).toThrow(
    new ConfigError('OTEL_TRACES_EXPORTER must list otlp, console or none, got "zipkin"'),
  );
  expect(() => parse({ OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "grpc" })).toThrow(
    /OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be http\/protobuf or http\/json/,
  );
  expect(() => parse({}, ["--tracing", "yes"])).toThrow(
    /--tracing \(LEASEHOLD_TRACING\) must be on or off, got "yes"/,
  );
  expect(parse({}, ["--tracing", "on", "--trace-session-keys", "on"]).sessionKeys).toBe(true);
});

/** The spans of an OTLP/JSON export request, by resource. */
function readOtlpJson(
  body: string,
): { service: string | undefined; spans: { name: string; requestId: unknown }[] }[] {
  type Attribute = { key: string; value: { stringValue?: string } };
  const request = JSON.parse(body) as {
    resourceSpans?: {
      resource?: { attributes?: Attribute[] };
      scopeSpans?: { spans?: { name: string; attributes?: Attribute[] }[] }[];
    }[];
  };
  const value = (attributes: Attribute[] | undefined, key: string) =>
    attributes?.find((a) => a.key === key)?.value.stringValue;
  return (request.resourceSpans ?? []).map((r) => ({
    service: value(r.resource?.attributes, "service.name"),
    spans: (r.scopeSpans ?? []).flatMap((s) =>
      (s.spans ?? []).map((span) => ({
        name: span.name,
        requestId: value(span.attributes, "leasehold.request_id"),
      })),
    ),
  }));
}
