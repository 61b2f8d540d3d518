// The client's own gRPC transport (src/client/grpc-transport.ts) against the
// real lease server: every RPC and both stream kinds through the typed
// client, the server's errors with their details, a deadline, a
// cancellation, the bearer token and other interceptors, TLS, a server
// killed under a call (failover), and a connection cut under the shared
// KeepAlive stream (it reconnects).

import { readFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import {
  CanceledError,
  type ClientEvent,
  createLeaseClient,
  DeadlineExceededError,
  durationFromMs,
  InvalidArgumentError,
  type KeepAliveInit,
  type LeaseClient,
  LeaseNotHeldError,
  toLeaseholdError,
  UnauthenticatedError,
} from "../src/client/index.js";
import { BadRequestSchema, ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { EventType, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import type { RunningServer } from "../src/server/server.js";
import { createTestDatabase, type TestDatabase } from "./support/db.js";
import { freshKey } from "./support/leases.js";
import { type ServerProcess, spawnServer, startTestServer } from "./support/server.js";
import { startTcpProxy } from "./support/tcp-proxy.js";
import { createTestKeys, type TestKeys } from "./support/tokens.js";

let db: TestDatabase;
let server: RunningServer;
const clients: LeaseClient[] = [];

beforeAll(async () => {
  db = await createTestDatabase();
  server = await startTestServer(db.url);
});
afterAll(async () => {
  for (const c of clients) c.close();
  await server?.close();
  await db?.close();
});

function grpc(options: Partial<Parameters<typeof createLeaseClient>[0]> = {}): LeaseClient {
  const c = createLeaseClient({ baseUrl: server.url, protocol: "grpc", ...options });
  clients.push(c);
  return c;
}

const ttl = durationFromMs(30_000);

/** A request side of a bidi stream that the test pushes into. */
function pushable<T>() {
  const items: T[] = [];
  let wake: (() => void) | undefined;
  let ended = false;
  return {
    push(item: T) {
      items.push(item);
      wake?.();
    },
    end() {
      ended = true;
      wake?.();
    },
    async *[Symbol.asyncIterator](): AsyncGenerator<T> {
      for (;;) {
        const item = items.shift();
        if (item !== undefined) {
          yield item;
          continue;
        }
        if (ended) return;
        await new Promise<void>((resolve) => {
          wake = resolve;
        });
        wake = undefined;
      }
    },
  };
}

/** An interceptor that reports when its call has been handed to the transport. */
function sentSignal(): { interceptor: Interceptor; sent: Promise<void> } {
  let resolve: () => void = () => {};
  const sent = new Promise<void>((r) => {
    resolve = r;
  });
  return {
    interceptor: (next) => (req) => {
      const response = next(req);
      resolve();
      return response;
    },
    sent,
  };
}

describe("the gRPC transport against the lease server", () => {
  it("S1, S3, S5, S6: every unary RPC, Watch (server stream) and KeepAlive (bidi stream)", async () => {
    const c = grpc();
    const key = freshKey("grpc-all");
    const watching = new AbortController();
    const watch = c.watch({ key }, { signal: watching.signal })[Symbol.asyncIterator]();
    const snapshot = await watch.next();
    expect(snapshot.value?.kind.case).toBe("snapshot");

    const a = await c.acquire({ key, ttl, holder: "desktop" });
    expect(a.acquired).toBe(true);
    const lease = a.lease;
    const runId = lease?.runId ?? "";
    const acquired = await watch.next();
    expect(acquired.value?.kind.case).toBe("event");
    expect(acquired.value?.kind.value).toMatchObject({ type: EventType.ACQUIRED, runId });

    const blocked = await c.acquire({ key, ttl, holder: "browser" });
    expect(blocked.acquired).toBe(false);
    expect(blocked.current?.holder).toBe("desktop");
    expect((await c.renew({ key, runId })).lease?.fencingToken).toBe(lease?.fencingToken);
    expect((await c.get({ key })).lease?.runId).toBe(runId);
    const listed = await c.list({ accountId: key.accountId, pageSize: 1000 });
    expect(listed.leases.map((l) => l.key?.sessionId)).toContain(key.sessionId);
    const fence = await c.checkFence({ key, fencingToken: lease?.fencingToken ?? 0n });
    expect(fence.current).toBe(true);
    expect(fence.highestToken).toBe(lease?.fencingToken);
    const handoff = await c.requestHandoff({ key, requesterHolder: "browser", reason: "move" });
    expect(handoff.delivered).toBe(true);

    // KeepAlive: two renewals on one stream, then the request side ends and
    // the server ends the stream cleanly.
    const requests = pushable<KeepAliveInit>();
    const answers = c.keepAlive(requests)[Symbol.asyncIterator]();
    requests.push({ key, runId, ttl });
    const first = await answers.next();
    expect(first.value?.result.case).toBe("lease");
    requests.push({ key, runId, ttl });
    let second = await answers.next();
    // A handoff request may be reported on the stream before the renewal.
    if (second.value?.result.case === "handoffRequested") second = await answers.next();
    expect(second.value?.result.case).toBe("lease");
    expect(second.value?.result.value).toMatchObject({ runId, fencingToken: lease?.fencingToken });
    requests.end();
    expect((await answers.next()).done).toBe(true);

    expect((await c.release({ key, runId })).released).toBe(true);
    const history = await c.history({ key, pageSize: 10 });
    expect(history.events.map((e) => e.type)).toContain(EventType.ACQUIRED);
    expect(history.events.map((e) => e.type)).toContain(EventType.RELEASED);

    const again = await c.acquire({ key, ttl });
    expect(again.lease?.fencingToken).toBeGreaterThan(lease?.fencingToken ?? 0n);
    expect((await c.revoke({ key, reason: "test" })).revoked).toBe(true);

    watching.abort();
    const ended = await (async () => {
      for (;;) {
        const r = await watch.next();
        if (r.done) return undefined;
      }
    })().catch((e: unknown) => e);
    expect(ended).toBeInstanceOf(CanceledError);
  });

  it("S4: LEASE_NOT_HELD with its cause, and INVALID_ARGUMENT with its BadRequest field, read from grpc-status-details-bin", async () => {
    const c = grpc();
    const key = freshKey("grpc-errors");
    const a = await c.acquire({ key, ttl });
    const runId = a.lease?.runId ?? "";
    await c.release({ key, runId });
    const notHeld = await c.renew({ key, runId }).catch((e: unknown) => e);
    expect(notHeld).toBeInstanceOf(LeaseNotHeldError);
    expect((notHeld as LeaseNotHeldError).lossCause).toBe("released");
    const wire = (notHeld as LeaseNotHeldError).cause as ConnectError;
    expect(wire).toBeInstanceOf(ConnectError);
    expect(wire.code).toBe(Code.FailedPrecondition);
    expect(wire.findDetails(ErrorInfoSchema)[0]).toMatchObject({
      reason: "LEASE_NOT_HELD",
      domain: "leasehold.dev",
      metadata: { cause: "released" },
    });

    const bad = await c.acquire({ key, ttl: durationFromMs(0) }).catch((e: unknown) => e);
    expect(bad).toBeInstanceOf(InvalidArgumentError);
    expect((bad as InvalidArgumentError).field).toBe("ttl");
    const badWire = (bad as InvalidArgumentError).cause as ConnectError;
    expect(badWire.findDetails(BadRequestSchema)[0]?.fieldViolations[0]?.field).toBe("ttl");
  });

  it("deadlines: grpc-timeout reaches the server (a waiting Acquire answers before it), and a Watch past its timeoutMs fails with DEADLINE_EXCEEDED", async () => {
    const c = grpc();
    const key = freshKey("grpc-deadline");
    await c.acquire({ key, ttl, holder: "desktop" });
    const started = performance.now();
    const waited = await c.acquire({ key, ttl, wait: durationFromMs(20_000) }, { timeoutMs: 400 });
    // The server cut its 20 s wait short to answer inside the call's 400 ms.
    expect(waited.acquired).toBe(false);
    expect(waited.current?.holder).toBe("desktop");
    expect(performance.now() - started).toBeLessThan(5_000);

    const watchStarted = performance.now();
    const watch = c.watch({ key }, { timeoutMs: 300 })[Symbol.asyncIterator]();
    expect((await watch.next()).value?.kind.case).toBe("snapshot");
    const error = await watch.next().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(DeadlineExceededError);
    expect(performance.now() - watchStarted).toBeGreaterThanOrEqual(250);
  });

  it("cancellation: the caller's signal fails a waiting Acquire with CANCELED, and the server drops the waiter", async () => {
    const { interceptor, sent } = sentSignal();
    const c = grpc({ interceptors: [interceptor] });
    const key = freshKey("grpc-cancel");
    const holder = await c.acquire({ key, ttl, holder: "desktop" });
    const cancel = new AbortController();
    const waiting = c
      .acquire({ key, ttl, wait: durationFromMs(20_000) }, { signal: cancel.signal })
      .catch((e: unknown) => e);
    await sent;
    cancel.abort();
    expect(await waiting).toBeInstanceOf(CanceledError);
    // The RST_STREAM went out before this release on the same connection:
    // the cancelled waiter must not be granted the lease it gave up.
    await c.release({ key, runId: holder.lease?.runId ?? "" });
    expect((await c.get({ key })).held).toBe(false);
  });

  it("TLS: https with ALPN h2 and the server's CA; a client that does not trust it fails as connect-node's does", async () => {
    const fixtures = fileURLToPath(new URL("./fixtures/tls/", import.meta.url));
    const ca = await readFile(path.join(fixtures, "cert.pem"), "utf8");
    const tls = await startTestServer(db.url, [
      "--tls-cert",
      path.join(fixtures, "cert.pem"),
      "--tls-key",
      path.join(fixtures, "key.pem"),
    ]);
    const trusting = createGrpcTransport({ baseUrl: tls.url, nodeOptions: { ca } });
    const untrusting = createGrpcTransport({ baseUrl: tls.url });
    try {
      expect(tls.url).toMatch(/^https:/);
      const key = freshKey("grpc-tls");
      const a = await createClient(LeaseService, trusting).acquire({ key, ttl });
      expect(a.acquired).toBe(true);
      const refused = await createClient(LeaseService, untrusting)
        .get({ key })
        .then(
          () => new ConnectError("the call succeeded", Code.Unknown),
          (e: unknown) => ConnectError.from(e),
        );
      expect(refused.code).toBe(Code.Internal);
      expect(refused.rawMessage).toMatch(/self[- ]signed|certificate/i);
    } finally {
      trusting.close();
      untrusting.close();
      await tls.close();
    }
  });
});

describe("interceptors and the bearer token", () => {
  let secured: RunningServer;
  let keys: TestKeys;

  beforeAll(async () => {
    keys = await createTestKeys();
    secured = await startTestServer(db.url, keys.args);
  });
  afterAll(async () => {
    await secured?.close();
  });

  it("the bearer token reaches the server; interceptors see the request's headers, context values and signal, and the response's headers and trailers", async () => {
    const seen: Record<string, unknown>[] = [];
    const recorder: Interceptor = (next) => async (req) => {
      const res = await next(req);
      if (!res.stream) {
        seen.push({
          authorization: req.header.get("authorization"),
          contentType: req.header.get("content-type"),
          te: req.header.get("te"),
          timeout: req.header.get("grpc-timeout"),
          signal: req.signal instanceof AbortSignal && !req.signal.aborted,
          responseType: res.header.get("content-type"),
          status: res.trailer.get("grpc-status"),
        });
      }
      return res;
    };
    const key = { accountId: "acct-grpc-token", sessionId: freshKey().sessionId };
    const token = await keys.token(key.accountId);
    const c = grpc({ baseUrl: secured.url, token: async () => token, interceptors: [recorder] });
    const a = await c.acquire({ key, ttl });
    expect(a.acquired).toBe(true);
    expect(seen[0]).toEqual({
      authorization: `Bearer ${token}`,
      contentType: "application/grpc+proto",
      te: "trailers",
      timeout: "10000m",
      signal: true,
      responseType: "application/grpc+proto",
      status: "0",
    });
    // The token scopes the caller to its account (S1 of §7): another
    // account's key is refused, so the token really was checked.
    const other = await c
      .get({ key: { accountId: "someone-else", sessionId: "s" } })
      .catch((e: unknown) => e);
    expect(toLeaseholdError(other).code).toBe(Code.PermissionDenied);

    const anonymous = grpc({ baseUrl: secured.url });
    const refused = await anonymous.get({ key }).catch((e: unknown) => e);
    expect(refused).toBeInstanceOf(UnauthenticatedError);
    expect((refused as UnauthenticatedError).failure).toBe("missing");
  });
});

describe("connections lost under calls", () => {
  it("a server killed under a waiting Acquire: the call fails over to the other instance and is granted there", async () => {
    const [a, b]: [ServerProcess, ServerProcess] = await Promise.all([
      spawnServer(db.url),
      spawnServer(db.url),
    ]);
    try {
      const key = freshKey("grpc-killed");
      const holder = grpc({ baseUrl: b.url });
      const held = await holder.acquire({ key, ttl, holder: "desktop" });
      const events: ClientEvent[] = [];
      const { interceptor, sent } = sentSignal();
      const c = grpc({
        baseUrls: [a.url, b.url],
        interceptors: [interceptor],
        onEvent: (e) => events.push(e),
      });
      // The connection to a is up before the call, so that the kill lands
      // under a call, not on a connect.
      expect((await c.get({ key })).held).toBe(true);
      const waiting = c.acquire({ key, ttl, wait: durationFromMs(30_000), holder: "browser" });
      await sent;
      await a.kill();
      await vi.waitFor(() => expect(events.some((e) => e.type === "failover")).toBe(true), {
        timeout: 10_000,
        interval: 20,
      });
      const failover = events.find((e) => e.type === "failover");
      expect(failover).toMatchObject({ method: "Acquire", baseUrl: a.url, nextBaseUrl: b.url });
      expect([Code.Canceled, Code.Aborted, Code.Unavailable]).toContain(
        (failover as { error: ConnectError }).error.code,
      );
      await holder.release({ key, runId: held.lease?.runId ?? "" });
      const granted = await waiting;
      expect(granted.acquired).toBe(true);
      expect(granted.lease?.holder).toBe("browser");
      expect(granted.lease?.fencingToken).toBeGreaterThan(held.lease?.fencingToken ?? 0n);
    } finally {
      await Promise.all([a.kill(), b.stop()]);
    }
  });

  const keepAliveFaults = [
    {
      what: "a connection cut by a proxy under the KeepAlive stream: the channel reconnects",
      fault: "drop",
      failure: /./,
    },
    {
      what: "a KeepAlive stream whose connection goes quiet (every byte held, nothing closed): the unanswered renewal is noticed, the channel reconnects elsewhere",
      fault: "stall",
      failure: /no answer to a renewal within 300ms/,
    },
  ] as const;
  for (const { what, fault, failure } of keepAliveFaults) {
    it(`L2: ${what}, and the run keeps its lease`, async () => {
      const proxy = await startTcpProxy(server.url);
      try {
        const events: ClientEvent[] = [];
        const c = grpc({
          baseUrls: [proxy.url, server.url],
          reconnectBackoff: { initialMs: 10, maxMs: 50 },
          onEvent: (e) => events.push(e),
        });
        const key = freshKey(`grpc-${fault}`);
        const opened = () => events.filter((e) => e.type === "keepalive-open");
        const result = await c.runExclusive(
          key,
          async (ctx) => {
            await vi.waitFor(() => expect(opened()).toHaveLength(1), { interval: 10 });
            const before = ctx.lease.expiresAt?.seconds ?? 0n;
            proxy[fault]();
            await vi.waitFor(
              () => {
                expect(events.some((e) => e.type === "keepalive-failed")).toBe(true);
                expect(opened()).toHaveLength(2);
              },
              { timeout: 10_000, interval: 10 },
            );
            // A renewal confirmed over the new stream moves the deadline on.
            await vi.waitFor(
              () => expect(ctx.lease.expiresAt?.seconds ?? 0n).toBeGreaterThan(before),
              { timeout: 10_000, interval: 20 },
            );
            expect(ctx.signal.aborted).toBe(false);
            return ctx.fencingToken;
          },
          { ttlMs: 3_000, renewIntervalMs: 300 },
        );
        const failed = events.find((e) => e.type === "keepalive-failed");
        expect(failed).toMatchObject({ baseUrl: proxy.url });
        expect((failed as { error: Error }).error.message).toMatch(failure);
        expect(opened()[1]).toMatchObject({ baseUrl: server.url });
        expect(typeof result).toBe("bigint");
      } finally {
        proxy.pass();
        await proxy.close();
      }
    });
  }
});
