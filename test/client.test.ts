// The client library's unary surface over real sockets: typed methods over
// every transport, typed errors that keep their cause, failover across base
// URLs, and the fencing interceptor's headers as a guarded service sees them.

import { once } from "node:events";
import http2 from "node:http2";
import net from "node:net";
import { create } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type ConnectRouter,
  createClient,
  createContextValues,
} from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { describe, expect, it } from "vitest";
import {
  type ClientEvent,
  createEndpoint,
  durationFromMs,
  fencingContextKey,
  fencingHeaderNames,
  fencingInterceptor,
  InvalidArgumentError,
  LeaseholdError,
  LeaseLostError,
  LeaseNotHeldError,
  NotAcquiredError,
  type SessionKeyInit,
  StaleFencingTokenError,
  toLeaseholdError,
  UnavailableError,
} from "../src/client/index.js";
import { failoverTransport } from "../src/client/transport.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import {
  GuardedStoreService,
  PutResponseSchema,
} from "../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { EventType, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import type { FenceClaim } from "../src/guarded/headers.js";
import {
  fencedCallKey,
  fencingInterceptor as serverFencingInterceptor,
} from "../src/guarded/interceptor.js";
import { listen } from "../src/host/listener.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { startTcpProxy } from "./support/tcp-proxy.js";

const { db, server, defer, libraryClient: client } = useTestServer();

/** A port nothing listens on: bound, then closed. */
async function deadUrl(): Promise<string> {
  const s = http2.createServer();
  s.listen(0, "127.0.0.1");
  await once(s, "listening");
  const port = (s.address() as net.AddressInfo).port;
  await new Promise((r) => s.close(r));
  return `http://127.0.0.1:${port}`;
}

const transports = [
  { name: "Connect over HTTP/2", options: { protocol: "connect" as const } },
  {
    name: "Connect over HTTP/1.1",
    options: { protocol: "connect" as const, httpVersion: "1.1" as const },
  },
  { name: "gRPC", options: { protocol: "grpc" as const } },
];

describe.each(transports)("typed methods ($name)", ({ options }) => {
  it("S3, S5: acquire, a blocked acquire naming the holder, renew, get, list, release", async () => {
    const c = client(options);
    const key = freshKey("typed");
    const a = await c.acquire({ key, ttl: durationFromMs(30_000), holder: "desktop" });
    expect(a.acquired).toBe(true);
    const runId = a.lease?.runId ?? "";
    expect(runId).toMatch(/^[0-9a-f-]{36}$/);

    const b = await c.acquire({ key, ttl: durationFromMs(30_000), holder: "browser" });
    expect(b.acquired).toBe(false);
    expect(b.current?.holder).toBe("desktop");

    const renewed = await c.renew({ key, runId });
    expect(renewed.lease?.fencingToken).toBe(a.lease?.fencingToken);
    expect((await c.get({ key })).lease?.runId).toBe(runId);
    const listed = await c.list({ accountId: key.accountId, pageSize: 1000 });
    expect(listed.leases.map((l) => l.key?.sessionId)).toContain(key.sessionId);
    expect((await c.release({ key, runId })).released).toBe(true);
    expect((await c.release({ key, runId })).released).toBe(false);
    expect((await c.get({ key })).held).toBe(false);
  });
});

describe("typed errors", () => {
  it("S4: renewing a released lease throws LeaseNotHeldError with the cause, keeping the ConnectError", async () => {
    const c = client();
    const key = freshKey("err");
    const a = await c.acquire({ key, ttl: durationFromMs(30_000) });
    const runId = a.lease?.runId ?? "";
    await c.release({ key, runId });
    const error = await c.renew({ key, runId }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(LeaseNotHeldError);
    expect(error).toBeInstanceOf(LeaseholdError);
    expect((error as LeaseNotHeldError).lossCause).toBe("released");
    expect((error as LeaseNotHeldError).code).toBe(Code.FailedPrecondition);
    expect((error as LeaseNotHeldError).cause).toBeInstanceOf(ConnectError);
  });

  it("bad input: InvalidArgumentError names the field and the rule", async () => {
    const c = client({ protocol: "grpc" });
    const error = await c
      .acquire({ key: freshKey("bad"), ttl: durationFromMs(0) })
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect((error as InvalidArgumentError).field).toBe("ttl");
    expect((error as InvalidArgumentError).rule).toMatch(/between/);
  });

  it("an unreachable server is an UnavailableError, not a hang", async () => {
    const c = client({ baseUrl: await deadUrl() });
    const error = await c.get({ key: freshKey() }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UnavailableError);
    expect((error as UnavailableError).cause).toBeInstanceOf(ConnectError);
  });

  it("S7: ABORTED with ErrorInfo STALE_FENCING_TOKEN maps to StaleFencingTokenError with both tokens", () => {
    const wire = new ConnectError("stale", Code.Aborted, undefined, [
      {
        desc: ErrorInfoSchema,
        value: {
          reason: "STALE_FENCING_TOKEN",
          domain: "leasehold.dev",
          metadata: { presented_token: "4", highest_token: "9" },
        },
      },
    ]);
    const error = toLeaseholdError(wire);
    expect(error).toBeInstanceOf(StaleFencingTokenError);
    expect((error as StaleFencingTokenError).presentedToken).toBe(4n);
    expect((error as StaleFencingTokenError).highestToken).toBe(9n);
    expect(error.cause).toBe(wire);
  });

  it("a connection reset (ABORTED from connect-node, no ErrorInfo) is UNAVAILABLE, not a stale token", () => {
    const reset = Object.assign(new Error("read ECONNRESET"), { code: "ECONNRESET" });
    const wire = new ConnectError("read ECONNRESET", Code.Aborted, undefined, undefined, reset);
    const error = toLeaseholdError(wire);
    expect(error).toBeInstanceOf(UnavailableError);
    expect(error).not.toBeInstanceOf(StaleFencingTokenError);
  });

  it("fails over when the first instance's connection is reset under the call", async () => {
    const resetting = net.createServer((socket) =>
      socket.on("data", () => socket.resetAndDestroy()),
    );
    resetting.listen(0, "127.0.0.1");
    await once(resetting, "listening");
    const port = (resetting.address() as net.AddressInfo).port;
    const c = client({ baseUrls: [`http://127.0.0.1:${port}`, server.url] });
    const answer = await c.get({ key: freshKey() });
    expect(answer.held).toBe(false);
    await new Promise<void>((resolve) => resetting.close(() => resolve()));
  });

  it("NotAcquiredError carries the current holder", async () => {
    const c = client();
    const key = freshKey("held");
    await c.acquire({ key, ttl: durationFromMs(30_000), holder: "desktop" });
    const error = await c
      .runExclusive(key, () => "never", { ttlMs: 30_000 })
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(NotAcquiredError);
    expect((error as NotAcquiredError).holder).toBe("desktop");
    expect((error as NotAcquiredError).message).toMatch(/held by "desktop"/);
  });
});

describe("several base URLs", () => {
  it("unary calls fail over from an unreachable instance to the next", async () => {
    const c = client({ baseUrls: [await deadUrl(), server.url], protocol: "grpc" });
    const key = freshKey("failover");
    const a = await c.acquire({ key, ttl: durationFromMs(30_000) });
    expect(a.acquired).toBe(true);
    expect((await c.get({ key })).held).toBe(true);
  });

  it("reports each failover as an event naming the instance that failed and the next one", async () => {
    const dead = await deadUrl();
    const events: ClientEvent[] = [];
    const c = client({ baseUrls: [dead, server.url], onEvent: (e) => events.push(e) });
    await c.get({ key: freshKey() });
    const failovers = events.filter((e) => e.type === "failover");
    expect(failovers).toHaveLength(1);
    expect(failovers[0]).toMatchObject({ method: "Get", baseUrl: dead, nextBaseUrl: server.url });
  });

  it("a failover event handler that throws does not stop the call from failing over", async () => {
    const c = client({
      baseUrls: [await deadUrl(), server.url],
      onEvent: () => {
        throw new Error("a broken logger");
      },
    });
    expect((await c.get({ key: freshKey() })).held).toBe(false);
  });

  it("an error after a failover keeps its code and field, and names the instances tried", async () => {
    const dead = await deadUrl();
    const c = client({ baseUrls: [dead, server.url] });
    const error = await c
      .acquire({ key: freshKey(), ttl: { seconds: -1n } })
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect((error as InvalidArgumentError).field).toBe("ttl");
    expect((error as Error).message).toContain(`at ${server.url}, after ${dead}: `);
  });

  it("when no instance answers, UNAVAILABLE names each one and what it did", async () => {
    const [a, b] = [await deadUrl(), await deadUrl()];
    const events: ClientEvent[] = [];
    const error = await client({ baseUrls: [a, b], onEvent: (e) => events.push(e) })
      .get({ key: freshKey() })
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UnavailableError);
    const message = (error as Error).message;
    expect(message).toMatch(/^no instance answered: /);
    // Get is idempotent: each instance once, then each once more.
    const attempts = message.replace(/^no instance answered: /, "").split("; ");
    expect(attempts.map((attempt) => attempt.slice(0, a.length + 2))).toEqual(
      [a, b, a, b].map((url) => `${url}: `),
    );
    for (const attempt of attempts) expect(attempt).toMatch(/: Unavailable \(.+\)$/);
    expect(
      events.flatMap((e) => (e.type === "failover" ? [[e.baseUrl, e.nextBaseUrl]] : [])),
    ).toEqual([
      [a, b],
      [b, a],
      [a, b],
    ]);
  });

  it("when every instance says UNAVAILABLE, the error keeps what the last one said", async () => {
    // Two stand-ins for instances whose database is down: what is checked
    // is how the client reports their answers, not the database.
    const down = async () =>
      listen({
        host: "127.0.0.1",
        port: 0,
        handler: connectNodeAdapter({
          routes: (router: ConnectRouter) =>
            router.service(LeaseService, {
              get: () => {
                throw new ConnectError("the database is unavailable", Code.Unavailable, undefined, [
                  {
                    desc: ErrorInfoSchema,
                    value: { reason: "DATABASE_UNAVAILABLE", domain: "leasehold.dev" },
                  },
                ]);
              },
            }),
        }),
      });
    const [a, b] = [await down(), await down()];
    try {
      const urls = [a, b].map((l) => `http://127.0.0.1:${l.port}`);
      const error = await client({ baseUrls: urls })
        .get({ key: freshKey() })
        .catch((e: unknown) => e);
      expect(error).toBeInstanceOf(UnavailableError);
      expect((error as UnavailableError).reason).toBe("DATABASE_UNAVAILABLE");
      for (const url of urls) expect((error as Error).message).toContain(`${url}: Unavailable`);
    } finally {
      await Promise.all([a.close(0), b.close(0)]);
    }
  });

  it("S2: an Acquire sent twice (a failover retry) is idempotent: the client-chosen run_id keeps one token", async () => {
    const c = client();
    const key = freshKey("idem");
    const runId = crypto.randomUUID();
    const first = await c.acquire({ key, runId, ttl: durationFromMs(30_000) });
    const again = await c.acquire({ key, runId, ttl: durationFromMs(30_000) });
    expect(again.acquired).toBe(true);
    expect(again.lease?.fencingToken).toBe(first.lease?.fencingToken);
  });
});

// docs/clients.md, "An idempotent unary call … whose connection is reset is
// sent again": with one base URL there is no other instance, so the call goes
// to the same one once more; one that is not idempotent is not sent again.
// The proxy resets the connection as the call's HEADERS frame reaches it, so
// the server never sees that attempt.
describe.each([
  { name: "Connect over HTTP/2", options: { protocol: "connect" as const } },
  { name: "gRPC", options: { protocol: "grpc" as const } },
])("a connection reset under a call, one base URL ($name)", ({ options }) => {
  async function proxy() {
    const p = await startTcpProxy(server.url);
    defer(() => p.close());
    return p;
  }

  /** The session's History, oldest first, as "TYPE runId". */
  async function historyOf(key: SessionKeyInit): Promise<string[]> {
    const { events } = await client().history({ key, pageSize: 100 });
    return events.map((e) => `${EventType[e.type]} ${e.runId}`).reverse();
  }

  it("S5: a Release whose connection is reset is sent again to the same address and releases once", async () => {
    const p = await proxy();
    const events: ClientEvent[] = [];
    const c = client({ ...options, baseUrl: p.url, onEvent: (e) => events.push(e) });
    const key = freshKey("release-reset");
    const runId = (await c.acquire({ key, ttl: durationFromMs(30_000) })).lease?.runId ?? "";
    p.resetNextCall();
    expect((await c.release({ key, runId })).released).toBe(true);
    expect(p.resetCalls).toBe(1);
    expect(await historyOf(key)).toEqual([`ACQUIRED ${runId}`, `RELEASED ${runId}`]);
    expect((await c.get({ key })).held).toBe(false);
    expect(events.filter((e) => e.type === "failover")).toMatchObject([
      { method: "Release", baseUrl: p.url, nextBaseUrl: p.url },
    ]);
  });

  it("S2: an Acquire whose connection is reset is sent again with its run id, and granted once", async () => {
    const p = await proxy();
    const c = client({ ...options, baseUrl: p.url });
    await c.get({ key: freshKey() }); // the connection is up: the next HEADERS frame is the Acquire's
    const key = freshKey("acquire-reset");
    p.resetNextCall();
    const granted = await c.acquire({ key, ttl: durationFromMs(30_000) });
    expect(granted.acquired).toBe(true);
    expect(p.resetCalls).toBe(1);
    expect(await historyOf(key)).toEqual([`ACQUIRED ${granted.lease?.runId}`]);
  });

  const notIdempotent = [
    {
      method: "Revoke",
      call: (url: string, key: SessionKeyInit) =>
        client({ ...options, baseUrl: url }).revoke({ key, reason: "reset" }),
    },
    {
      method: "RequestHandoff",
      call: (url: string, key: SessionKeyInit) =>
        client({ ...options, baseUrl: url }).requestHandoff({
          key,
          requesterHolder: "browser",
          reason: "reset",
        }),
    },
    {
      // The client's acquire always fills in a run id; a bare transport
      // sends the request as given, and without a run id each Acquire
      // would be a new run.
      method: "Acquire without a run id",
      call: async (url: string, key: SessionKeyInit) => {
        const endpoint = createEndpoint(url, options);
        try {
          return await createClient(LeaseService, failoverTransport([endpoint])).acquire({
            key,
            ttl: durationFromMs(30_000),
          });
        } catch (error) {
          throw toLeaseholdError(error);
        } finally {
          endpoint.close();
        }
      },
    },
  ];
  it.each(notIdempotent)(
    "a $method whose connection is reset is not sent again: UNAVAILABLE naming the one attempt",
    async ({ call }) => {
      const p = await proxy();
      const key = freshKey("not-idempotent");
      // The lease is held, through the proxy, so that a Revoke or a
      // RequestHandoff sent again would leave its mark in History.
      const held = await client({ ...options, baseUrl: p.url }).acquire({
        key,
        runId: crypto.randomUUID(),
        ttl: durationFromMs(30_000),
      });
      const runId = held.lease?.runId ?? "";
      const before = await historyOf(key);
      p.resetNextCall();
      const error = await call(p.url, key).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(UnavailableError);
      expect(p.resetCalls).toBe(1);
      expect((error as Error).message.split(p.url)).toHaveLength(2);
      expect(await historyOf(key)).toEqual(before);
      expect((await client().get({ key })).lease?.runId).toBe(runId);
    },
  );
});

describe("fencing interceptor", () => {
  // A downstream Connect service fenced by the project's server-side
  // interceptor (src/guarded/interceptor.ts): it reads the three headers and
  // runs leasehold_fence in the service's database before the handler.
  async function fencedService() {
    const claims: FenceClaim[] = [];
    const routes = (router: ConnectRouter) =>
      router.service(GuardedStoreService, {
        put: (_req, ctx) => {
          const call = ctx.values.get(fencedCallKey);
          if (!call) throw new ConnectError("unfenced put", Code.Internal);
          claims.push(call.claim);
          return create(PutResponseSchema, { highestToken: call.highestToken });
        },
        get: () => {
          throw new ConnectError("unused", Code.Unimplemented);
        },
        list: () => {
          throw new ConnectError("unused", Code.Unimplemented);
        },
      });
    const listener = await listen({
      host: "127.0.0.1",
      port: 0,
      handler: connectNodeAdapter({
        routes,
        interceptors: [serverFencingInterceptor({ sql: db.sql })],
      }),
    });
    return { url: `http://127.0.0.1:${listener.port}`, claims, close: () => listener.close(0) };
  }

  it("S7, L2: calls made for a lease carry its token and key; stale tokens are refused; a lost run's calls are never sent", async () => {
    const service = await fencedService();
    const endpoint = createEndpoint(service.url, { interceptors: [fencingInterceptor()] });
    const store = createClient(GuardedStoreService, endpoint.transport);
    const key = freshKey("fence");
    const staleEndpoint = createEndpoint(service.url, {
      protocol: "grpc",
      interceptors: [fencingInterceptor({ key, fencingToken: 3n })],
    });
    try {
      const ac = new AbortController();
      const source = { key, fencingToken: 7n, signal: ac.signal };
      const callOptions = { contextValues: createContextValues().set(fencingContextKey, source) };

      const put = await store.put({ key, name: "transcript" }, callOptions);
      expect(put.highestToken).toBe(7n);
      expect(service.claims).toEqual([{ key, token: 7n }]);

      // A call without a lease passes through without fencing headers: the
      // fenced service refuses it, naming the missing header.
      const bare = await store
        .put({ key, name: "note" })
        .catch((e: unknown) => toLeaseholdError(e));
      expect(bare).toBeInstanceOf(InvalidArgumentError);
      expect((bare as InvalidArgumentError).field).toBe(fencingHeaderNames.fencingToken);

      // A bound source (a fixed lease) with an older token: refused (S7).
      const stale = createClient(GuardedStoreService, staleEndpoint.transport);
      const error = await stale.put({ key, name: "x" }).catch((e: unknown) => toLeaseholdError(e));
      expect(error).toBeInstanceOf(StaleFencingTokenError);
      expect((error as StaleFencingTokenError).highestToken).toBe(7n);
      expect((error as StaleFencingTokenError).presentedToken).toBe(3n);

      // L2: once the lease is lost, nothing is sent on its behalf.
      ac.abort(new LeaseLostError("lost", "taken_over"));
      const refused = await store
        .put({ key, name: "late" }, callOptions)
        .catch((e: unknown) => toLeaseholdError(e));
      expect(refused).toBeInstanceOf(LeaseLostError);
      expect(service.claims).toHaveLength(1);
    } finally {
      endpoint.close();
      staleEndpoint.close();
      await service.close();
    }
  });

  /** What `f` throws (undefined when it returns). */
  function thrownBy(f: () => unknown): unknown {
    try {
      f();
    } catch (error) {
      return error;
    }
    return undefined;
  }

  it("L2: a run's headers() and callOptions() refuse once its lease is revoked (its LeaseLostError) and once it has released", async () => {
    const c = client();
    const key = freshKey("headers");
    const revoked = await c.runExclusive(
      key,
      async (ctx) => {
        const held = ctx.headers();
        expect(held.get(fencingHeaderNames.fencingToken)).toBe(ctx.fencingToken.toString());
        expect(ctx.callOptions().signal).toBe(ctx.signal);
        await createLeaseStore(db.sql).revoke(key, "moved to the browser");
        if (!ctx.signal.aborted) await once(ctx.signal, "abort");
        return {
          ctx,
          headers: thrownBy(() => ctx.headers()),
          options: thrownBy(() => ctx.callOptions()),
        };
      },
      { ttlMs: 5_000 },
    );
    const lost = revoked.ctx.signal.reason as LeaseLostError;
    expect(lost).toBeInstanceOf(LeaseLostError);
    expect(lost.lossReason).toBe("revoked");
    expect(revoked.headers).toBe(lost);
    expect(revoked.options).toBe(lost);
    // After runExclusive has returned: still the loss, not a release.
    expect(thrownBy(() => revoked.ctx.headers())).toBe(lost);

    const ended = await c.runExclusive(freshKey("headers-released"), (ctx) => ctx);
    for (const refusal of [thrownBy(() => ended.headers()), thrownBy(() => ended.callOptions())]) {
      expect(refusal).toBeInstanceOf(LeaseLostError);
      expect((refusal as LeaseLostError).lossReason).toBe("released");
      expect((refusal as LeaseLostError).message).toBe("the run ended and released its lease");
    }
  });

  it("L2: a call through fencingInterceptor with the event loop blocked past the local deadline is not sent: the clock decides, not the timer", async () => {
    const service = await fencedService();
    const endpoint = createEndpoint(service.url, { interceptors: [fencingInterceptor()] });
    const store = createClient(GuardedStoreService, endpoint.transport);
    const key = freshKey("blocked");
    try {
      const result = await client().runExclusive(
        key,
        async (ctx) => {
          // The context value alone (no signal in the call options): what
          // the interceptor itself decides.
          const options = { contextValues: createContextValues().set(fencingContextKey, ctx) };
          await store.put({ key, name: "before" }, options);
          // Block the event loop past the local deadline and on past the
          // lease's deadline in the database, which is later by the margin
          // (150 ms) and the last counted renewal's way to the database (an
          // answer later than the renew interval, 450 ms, is a stalled
          // stream's, not counted): no timer runs meanwhile, so the signal
          // has not aborted when the call is made.
          const blockedUntil = performance.now() + ctx.remainingMs() + 1_000;
          while (performance.now() < blockedUntil) {
            // busy: the event loop is blocked
          }
          const abortedBeforeCall = ctx.signal.aborted;
          const refused = await store
            .put({ key, name: "after" }, options)
            .catch((e: unknown) => toLeaseholdError(e));
          return { abortedBeforeCall, refused, reason: ctx.signal.reason as unknown };
        },
        { ttlMs: 1_500 },
      );
      expect(result.abortedBeforeCall).toBe(false);
      expect(result.refused).toBeInstanceOf(LeaseLostError);
      expect((result.refused as LeaseLostError).lossReason).toBe("deadline");
      // The run's own loss: the call made it, and the signal carries it.
      expect(result.refused).toBe(result.reason);
      // The second call never reached the service: no headers were sent.
      expect(service.claims).toHaveLength(1);
      const [row] = await db.sql<{ valid: boolean }[]>`
        SELECT expires_at > clock_timestamp() AS valid FROM leases
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
      expect(row?.valid).toBe(false);
    } finally {
      endpoint.close();
      await service.close();
    }
  });
});
