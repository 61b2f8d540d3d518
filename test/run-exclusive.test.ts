// runExclusive against real servers, through a real TCP proxy that drops,
// stalls or delays the connection. The property under test is L2: the work's
// signal aborts before the server-side deadline (read from the database's
// own expires_at and clock), and a grant that arrives too late is not used.

import { randomUUID } from "node:crypto";
import { once } from "node:events";
import { Code, createClient } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import {
  type ClientEvent,
  createEndpoint,
  durationFromMs,
  fencingInterceptor,
  LateGrantError,
  type LeaseClient,
  LeaseLostError,
  StaleFencingTokenError,
  toLeaseholdError,
} from "../src/client/index.js";
import { GuardedStoreService } from "../src/gen/leasehold/guarded/v1/guarded_pb.js";
import type { HandoffRequested } from "../src/gen/leasehold/v1/lease_pb.js";
import type { SessionKey } from "../src/lease/types.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { openTransaction } from "./support/db.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { startTcpProxy, type TcpProxy } from "./support/tcp-proxy.js";
import { waitFor } from "./support/wait.js";

const {
  db,
  server,
  libraryClient: client,
  defer,
  startServer,
  spawnServer,
  startGuardedServer,
} = useTestServer();

async function proxyTo(url: string): Promise<TcpProxy> {
  const proxy = await startTcpProxy(url);
  defer(() => proxy.close());
  return proxy;
}

/** Milliseconds until the lease's server-side deadline, on the database clock. */
async function serverSideLeftMs(key: SessionKey): Promise<number> {
  const [row] = await db.sql<{ leftMs: number }[]>`
    SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8 AS left_ms
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  if (!row) throw new Error("no lease row");
  return row.leftMs;
}

/** Waits on the database clock until `ms` past the lease's current expires_at. */
async function untilPastCurrentDeadline(key: SessionKey, ms: number): Promise<void> {
  await db.sql`
    SELECT pg_sleep_until(expires_at + ${ms}::int * interval '1 millisecond')
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
}

/** The stored row: who holds the key and whether the lease is valid now. */
async function storedLease(key: SessionKey) {
  const [row] = await db.sql<
    { runId: string; fencingToken: bigint; valid: boolean; ended: string | null }[]
  >`
    SELECT run_id::text, fencing_token, expires_at > clock_timestamp() AS valid, ended
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  return row;
}

/** Resolves once `signal` has aborted (at once if it already has). */
function aborted(signal: AbortSignal): Promise<unknown> {
  return signal.aborted ? Promise.resolve() : once(signal, "abort");
}

/**
 * Runs work that waits for its signal to abort and, at that moment, reads the
 * server-side time left; resolves with the abort reason and that reading.
 */
async function abortedWhen(
  c: LeaseClient,
  key: SessionKey,
  ttlMs: number,
  onHeld: () => unknown,
  extra: { safetyMarginMs?: number } = {},
) {
  return c.runExclusive(
    key,
    async (ctx) => {
      await onHeld();
      await aborted(ctx.signal);
      const leftMs = await serverSideLeftMs(key);
      return { reason: ctx.signal.reason as unknown, leftMs, runId: ctx.runId };
    },
    { ttlMs, ...extra },
  );
}

/**
 * Runs `keys` with runExclusive (TTL 1.5 s: its 500 ms renew interval leaves
 * room for a stalled event loop on a loaded machine, the server running in
 * this process), each waiting on the database clock past its first grant's
 * deadline (renewals keep acquired_at); what each run saw then, and its
 * stored row before and after.
 */
function holdPastFirstDeadline(c: LeaseClient, keys: SessionKey[]) {
  return Promise.all(
    keys.map((key) =>
      c.runExclusive(
        key,
        async (ctx) => {
          const first = await storedLease(key);
          await db.sql`
            SELECT pg_sleep_until(acquired_at + ttl + interval '50 milliseconds')
            FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
          const now = await storedLease(key);
          return { aborted: ctx.signal.aborted, first, now, token: ctx.fencingToken };
        },
        { ttlMs: 1_500 },
      ),
    ),
  );
}

describe("runExclusive keeps the lease alive", () => {
  it("L2, S6: renewals carry two runs past their TTL on one shared KeepAlive stream, same tokens", async () => {
    const events: ClientEvent[] = [];
    const c = client({ onEvent: (e) => events.push(e) });
    const keys = [freshKey("shared"), freshKey("shared")];
    for (const r of await holdPastFirstDeadline(c, keys)) {
      expect(r.aborted).toBe(false);
      expect(r.now?.valid).toBe(true);
      expect(r.now?.runId).toBe(r.first?.runId);
      expect(r.now?.fencingToken).toBe(r.token);
    }
    expect(events.filter((e) => e.type === "keepalive-open")).toHaveLength(1);
    for (const key of keys) expect((await storedLease(key))?.ended).toBe("released");
  });

  it("L2: a run id given in upper case is the same run: renewed past its TTL, and ctx.runId is as the server prints it", async () => {
    const c = client();
    const key = freshKey("upper");
    const runId = randomUUID().toUpperCase();
    const seen = await c.runExclusive(
      key,
      async (ctx) => {
        await db.sql`
          SELECT pg_sleep_until(acquired_at + ttl + interval '50 milliseconds')
          FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
        return { aborted: ctx.signal.aborted, runId: ctx.runId, now: await storedLease(key) };
      },
      { ttlMs: 600, runId },
    );
    expect(seen.aborted).toBe(false);
    expect(seen.runId).toBe(runId.toLowerCase());
    expect(seen.now).toMatchObject({ runId: runId.toLowerCase(), valid: true });
  });

  it("L2: more leases than a server lets one stream carry are renewed over more streams", async () => {
    // The server ends a stream carrying a third lease with RESOURCE_EXHAUSTED.
    const bounded = await startServer(["--max-leases-per-stream", "2"]);
    const events: ClientEvent[] = [];
    const c = client({
      baseUrl: bounded.url,
      maxLeasesPerStream: 2,
      onEvent: (e) => events.push(e),
    });
    const keys = Array.from({ length: 5 }, () => freshKey("lanes"));
    for (const r of await holdPastFirstDeadline(c, keys)) {
      expect(r.aborted).toBe(false);
      expect(r.now?.valid).toBe(true);
      expect(r.now?.runId).toBe(r.first?.runId);
    }
    // Three streams, none refused for its lease count; a renewal unanswered
    // for a renew interval (a loaded machine) reconnects a stream, once per
    // failure.
    const opened = events.filter((e) => e.type === "keepalive-open");
    const failed = events.filter((e) => e.type === "keepalive-failed");
    expect(failed.filter((e) => e.error.code === Code.ResourceExhausted)).toEqual([]);
    expect(opened.length - failed.length).toBe(3);
  });

  it("L2: a client that does not know the server's bound learns it from the first refused stream and spreads its leases over more streams", async () => {
    const bounded = await startServer(["--max-leases-per-stream", "2"]);
    const events: ClientEvent[] = [];
    const c = client({ baseUrl: bounded.url, onEvent: (e) => events.push(e) });
    const keys = Array.from({ length: 5 }, () => freshKey("learned"));
    for (const r of await holdPastFirstDeadline(c, keys)) {
      expect(r.aborted).toBe(false);
      expect(r.now?.valid).toBe(true);
      expect(r.now?.runId).toBe(r.first?.runId);
    }
    // One stream was refused (its third lease), and none again after.
    const refused = events.filter(
      (e) => e.type === "keepalive-failed" && e.error.code === Code.ResourceExhausted,
    );
    expect(refused).toHaveLength(1);
    expect(refused[0]).toMatchObject({
      error: {
        code: Code.ResourceExhausted,
        metadata: { limit: "max-leases-per-stream", max: "2" },
      },
    });
  });
});

describe("L2: the signal aborts before the server-side deadline", () => {
  it("L2: when the connection is dropped (reset, and new connections refused)", async () => {
    const proxy = await proxyTo(server.url);
    const c = client({ baseUrl: proxy.url });
    const key = freshKey("drop");
    const result = await abortedWhen(c, key, 2_000, () => proxy.drop(), { safetyMarginMs: 800 });
    expect(result.reason).toBeInstanceOf(LeaseLostError);
    expect((result.reason as LeaseLostError).lossReason).toBe("deadline");
    expect(result.leftMs).toBeGreaterThan(0);
  });

  it("L2: when the connection stalls (bytes held, sockets open)", async () => {
    const proxy = await proxyTo(server.url);
    const c = client({ baseUrl: proxy.url });
    const key = freshKey("stall");
    const result = await abortedWhen(c, key, 2_000, () => proxy.stall(), { safetyMarginMs: 800 });
    expect((result.reason as LeaseLostError).lossReason).toBe("deadline");
    expect(result.leftMs).toBeGreaterThan(0);
  });

  it("L2: no Release is sent after a loss: a stalled run that lost at its local deadline leaves its lease to expire", async () => {
    const proxy = await proxyTo(server.url);
    const c = client({ baseUrl: proxy.url });
    const key = freshKey("no-release-after-loss");
    const result = await c.runExclusive(
      key,
      async (ctx) => {
        proxy.stall();
        await aborted(ctx.signal);
        // The route comes back before runExclusive ends: a Release would now
        // reach the server and end the lease the run no longer vouches for.
        proxy.pass();
        return { reason: ctx.signal.reason as unknown, runId: ctx.runId };
      },
      { ttlMs: 2_000, safetyMarginMs: 800 },
    );
    expect((result.reason as LeaseLostError).lossReason).toBe("deadline");
    // Asserted from the server: the audit trail has the grant and no release.
    const events = await db.sql<{ type: string }[]>`
      SELECT type FROM lease_events
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} AND run_id = ${result.runId}`;
    expect(events.map((e) => e.type)).toEqual(["acquired"]);
  });

  it("L2: when the server process is killed (SIGKILL)", async () => {
    const other = await spawnServer();
    const c = client({ baseUrl: other.url, protocol: "grpc" });
    const key = freshKey("killed");
    const result = await abortedWhen(c, key, 2_000, () => other.kill(), { safetyMarginMs: 800 });
    expect((result.reason as LeaseLostError).lossReason).toBe("deadline");
    expect(result.leftMs).toBeGreaterThan(0);
  });

  it("L2: when the lease is revoked, the stream's `lost` aborts it with the cause", async () => {
    const c = client();
    const key = freshKey("revoked");
    const store = createLeaseStore(db.sql);
    const result = await abortedWhen(c, key, 1_000, () => store.revoke(key, "test"));
    expect((result.reason as LeaseLostError).lossReason).toBe("revoked");
  });
});

describe("reconnecting", () => {
  it("L2: a dropped instance is replaced by the next base URL; the lease outlives its TTL", async () => {
    const second = await startServer();
    const proxy = await proxyTo(server.url);
    const events: ClientEvent[] = [];
    const c = client({ baseUrls: [proxy.url, second.url], onEvent: (e) => events.push(e) });
    const key = freshKey("failover");
    const outcome = await c.runExclusive(
      key,
      async (ctx) => {
        const before = await storedLease(key);
        proxy.drop();
        // Past the deadline the lease had when the first instance was cut.
        await untilPastCurrentDeadline(key, 50);
        const after = await storedLease(key);
        return { aborted: ctx.signal.aborted, before, after };
      },
      { ttlMs: 1_000 },
    );
    expect(outcome.aborted).toBe(false);
    expect(outcome.after?.valid).toBe(true);
    expect(outcome.after?.runId).toBe(outcome.before?.runId);
    expect(events).toContainEqual({ type: "keepalive-open", baseUrl: second.url });
  });
});

describe("a renewal the database did not decide", () => {
  // A server of its own whose renewal statements time out (statement_timeout
  // 150 ms) long before a run's stall watch (its renew interval, 500 ms)
  // would fire; a table lock held by another connection holds every
  // renewal statement up until it times out.
  async function slowServer() {
    return startServer(["--statement-timeout", "150ms", "--lock-timeout", "30s"]);
  }
  const lockRenewals = () => openTransaction(db, (tx) => tx`LOCK TABLE leases IN SHARE MODE`);
  const undecidedEvents = (events: ClientEvent[]) =>
    events.filter((e) => e.type === "keepalive-renewal-undecided");
  const reconnects = (events: ClientEvent[]) =>
    events.filter((e) => e.type === "keepalive-failed" || e.type === "keepalive-open").length - 1;

  it("L2: an undecided renewal keeps the stream and the lease; its local deadline does not move, and a later renewal renews it", async () => {
    const slow = await slowServer();
    const events: ClientEvent[] = [];
    const c = client({ baseUrl: slow.url, protocol: "grpc", onEvent: (e) => events.push(e) });
    const key = freshKey("undecided-kept");
    const outcome = await c.runExclusive(
      key,
      async (ctx) => {
        const lock = await lockRenewals();
        let before: typeof ctx.lease;
        let during: typeof ctx.lease;
        try {
          // Every renewal from the first undecided one on is held up by the
          // lock. Two rounds answered undecided: more than one renew
          // interval, which the stall watch took for a stalled connection.
          await waitFor(() => undecidedEvents(events).length >= 1, {
            what: "a renewal answered undecided",
          });
          before = ctx.lease;
          await waitFor(() => undecidedEvents(events).length >= 3, {
            what: "two more renewals answered undecided",
          });
          during = ctx.lease;
        } finally {
          await lock.end();
        }
        const stored = await storedLease(key);
        const expiry = (l: typeof ctx.lease) => `${l.expiresAt?.seconds}.${l.expiresAt?.nanos}`;
        await waitFor(() => expiry(ctx.lease) !== expiry(before), {
          what: "a renewal after the database is back",
        });
        return { aborted: ctx.signal.aborted, before, during, stored, runId: ctx.runId };
      },
      { ttlMs: 2_500, renewIntervalMs: 500 },
    );
    expect(outcome.aborted).toBe(false);
    // Undecided renewals left the lease as the server had it, and the run's view too.
    expect(outcome.during).toEqual(outcome.before);
    expect(outcome.stored?.valid).toBe(true);
    expect(outcome.stored?.runId).toBe(outcome.runId);
    const undecided = undecidedEvents(events)[0];
    expect(undecided).toMatchObject({
      baseUrl: slow.url,
      key: { accountId: key.accountId, sessionId: key.sessionId },
      runId: outcome.runId,
    });
    expect(undecided?.type === "keepalive-renewal-undecided" && undecided.error).toMatchObject({
      code: Code.Unavailable,
      reason: "DATABASE_UNAVAILABLE",
      metadata: { sql_state: "57014" },
    });
    // One stream throughout: never failed, never reopened.
    expect(reconnects(events)).toBe(0);
    expect(events.filter((e) => e.type === "keepalive-failed")).toEqual([]);
  });

  it("L2: a database that stays slow ends the lease at its local deadline, before the server-side one, on the same stream", async () => {
    const slow = await slowServer();
    const events: ClientEvent[] = [];
    const c = client({ baseUrl: slow.url, protocol: "grpc", onEvent: (e) => events.push(e) });
    const key = freshKey("undecided-lost");
    const lock: { end(): Promise<void> }[] = [];
    try {
      const result = await abortedWhen(
        c,
        key,
        2_000,
        async () => {
          lock.push(await lockRenewals());
        },
        { safetyMarginMs: 500 },
      );
      expect(result.reason).toBeInstanceOf(LeaseLostError);
      expect((result.reason as LeaseLostError).lossReason).toBe("deadline");
      expect(result.leftMs).toBeGreaterThan(0);
    } finally {
      for (const l of lock) await l.end();
    }
    expect(undecidedEvents(events).length).toBeGreaterThan(0);
    expect(events.filter((e) => e.type === "keepalive-failed")).toEqual([]);
  });
});

describe("a renewal held up longer than the stall watch", () => {
  it("L2: a renewal statement that runs past the renewal interval (the default statement_timeout 5 s against the default TTL's 3 s) is given up by the stall watch before its undecided answer: the client reopens its stream, and the lease is kept", async () => {
    // The default statement_timeout and TTL; a lock_timeout above the
    // statement's, so that a table lock holds the renewal statement up until
    // statement_timeout, as a slow database would.
    const slow = await startServer(["--lock-timeout", "30s"]);
    const events: ClientEvent[] = [];
    const c = client({ baseUrl: slow.url, protocol: "grpc", onEvent: (e) => events.push(e) });
    const key = freshKey("undecided-too-late");
    const outcome = await c.runExclusive(key, async (ctx) => {
      const lock = await openTransaction(db, (tx) => tx`LOCK TABLE leases IN SHARE MODE`);
      try {
        await waitFor(() => events.some((e) => e.type === "keepalive-failed"), {
          what: "the stall watch giving up the held-up renewal",
          timeoutMs: 10_000,
        });
      } finally {
        await lock.end();
      }
      return { aborted: ctx.signal.aborted, runId: ctx.runId };
    });
    const failed = events.find((e) => e.type === "keepalive-failed");
    expect(failed?.type === "keepalive-failed" && failed.error.message).toBe(
      "no answer to a renewal within 3000ms",
    );
    expect(events.some((e) => e.type === "keepalive-renewal-undecided")).toBe(false);
    expect(outcome.aborted).toBe(false);
  });
});

describe("late grants", () => {
  it("L2: a grant whose response arrives after its local deadline is not used, and is released", async () => {
    const proxy = await proxyTo(server.url);
    // Answers arrive 1.3 s late: past the local deadline (sent + 2 s − 1 s
    // margin) but before the server-side one, so the release still finds
    // the lease and ends it.
    proxy.delay(1_300, ["toClient"]);
    const c = client({ baseUrl: proxy.url });
    const key = freshKey("late");
    let ran = false;
    const error = await c
      .runExclusive(
        key,
        () => {
          ran = true;
        },
        { ttlMs: 2_000, safetyMarginMs: 1_000 },
      )
      .catch((e: unknown) => e);
    expect(ran).toBe(false);
    expect(error).toBeInstanceOf(LateGrantError);
    const row = await storedLease(key);
    expect(row?.runId).toBe((error as LateGrantError).lateLease?.runId);
    expect(row?.ended).toBe("released");
    expect(row?.valid).toBe(false);
  });

  it("L2, S6: a grant after a long wait is confirmed by an idempotent re-acquire before work starts", async () => {
    const c = client();
    const key = freshKey("waited");
    const first = await c.acquire({ key, ttl: durationFromMs(800), holder: "desktop" });
    const outcome = await c.runExclusive(
      key,
      async (ctx) => ({
        token: ctx.fencingToken,
        left: ctx.remainingMs(),
        row: await storedLease(key),
      }),
      { ttlMs: 500, waitMs: 5_000 },
    );
    expect(outcome.token).toBeGreaterThan(first.lease?.fencingToken ?? 0n);
    expect(outcome.left).toBeGreaterThan(0);
    expect(outcome.row?.fencingToken).toBe(outcome.token);
  });
});

describe("release", () => {
  it("S5: an error thrown by work still releases the lease, and runExclusive rethrows it", async () => {
    const c = client();
    const key = freshKey("throws");
    const boom = new Error("boom");
    const error = await c
      .runExclusive(key, async () => {
        throw boom;
      })
      .catch((e: unknown) => e);
    expect(error).toBe(boom);
    const row = await storedLease(key);
    expect(row?.ended).toBe("released");
    expect(row?.valid).toBe(false);
  });

  it("L2: the caller's signal aborts the work's signal; the lease is released and the result returned", async () => {
    const c = client();
    const key = freshKey("cancel");
    const caller = new AbortController();
    const result = await c.runExclusive(
      key,
      async (ctx) => {
        caller.abort(new Error("user pressed stop"));
        await aborted(ctx.signal);
        return (ctx.signal.reason as Error).message;
      },
      { signal: caller.signal },
    );
    expect(result).toBe("user pressed stop");
    expect((await storedLease(key))?.ended).toBe("released");
  });

  it("L2: after work settles, calls made with its context fail instead of presenting the lease", async () => {
    const c = client();
    const key = freshKey("after");
    const ctx = await c.runExclusive(key, (ctx) => ctx);
    expect(ctx.signal.aborted).toBe(true);
    expect((ctx.signal.reason as LeaseLostError).lossReason).toBe("released");
  });
});

describe("handoff", () => {
  it("a handoff request from another holder reaches the running work", async () => {
    const c = client();
    const other = client({ protocol: "grpc" });
    const key = freshKey("handoff");
    const request = await c.runExclusive(
      key,
      async (ctx) => {
        const received = new Promise<HandoffRequested>((resolve) =>
          ctx.onHandoffRequested(resolve),
        );
        // Ask once the stream has renewed this run (the server then knows
        // which stream to tell); ctx.lease is replaced by every renewal.
        const granted = ctx.lease;
        await waitFor(() => ctx.lease !== granted || ctx.signal.aborted, {
          what: "the KeepAlive stream to renew the run",
          intervalMs: 5,
        });
        const answer = await other.requestHandoff({
          key,
          requesterHolder: "browser",
          reason: "continue on this device",
        });
        expect(answer.delivered).toBe(true);
        return received;
      },
      { ttlMs: 5_000 },
    );
    expect(request.requesterHolder).toBe("browser");
    expect(request.reason).toBe("continue on this device");
  });
});

describe("writing to the guarded store", () => {
  it("S7, L2: a run writes with its token; once revoked it stops, its context sends nothing, and its late raw write is refused", async () => {
    const guarded = await startGuardedServer(["--lease-url", server.url]);
    const endpoint = createEndpoint(guarded.url, { interceptors: [fencingInterceptor()] });
    defer(() => endpoint.close());
    const store = createClient(GuardedStoreService, endpoint.transport);
    const text = (s: string) => new TextEncoder().encode(s);
    const key = freshKey("agent");
    const a = client();
    const b = client({ protocol: "grpc" });

    const runA = await a.runExclusive(
      key,
      async (ctx) => {
        await store.put(
          { key, name: "transcript", value: text("A1"), fencingToken: ctx.fencingToken },
          ctx.callOptions(),
        );
        await createLeaseStore(db.sql).revoke(key, "moved to the browser");
        await aborted(ctx.signal);
        // B takes over and writes while A is still "paused".
        await b.runExclusive(key, (next) =>
          store.put(
            { key, name: "transcript", value: text("B1"), fencingToken: next.fencingToken },
            next.callOptions(),
          ),
        );
        // ctx.callOptions() itself refuses once the lease is lost (it throws).
        const viaContext = await Promise.resolve()
          .then(() =>
            store.put(
              { key, name: "transcript", value: text("A2"), fencingToken: ctx.fencingToken },
              ctx.callOptions(),
            ),
          )
          .catch((e: unknown) => toLeaseholdError(e));
        const raw = await store
          .put({ key, name: "transcript", value: text("A2"), fencingToken: ctx.fencingToken })
          .catch((e: unknown) => toLeaseholdError(e));
        return { reason: ctx.signal.reason as unknown, viaContext, raw };
      },
      { ttlMs: 5_000 },
    );
    expect((runA.reason as LeaseLostError).lossReason).toBe("revoked");
    expect(runA.viaContext).toBeInstanceOf(LeaseLostError);
    expect(runA.raw).toBeInstanceOf(StaleFencingTokenError);
    const doc = await store.get({ key, name: "transcript" });
    expect(new TextDecoder().decode(doc.value)).toBe("B1");
  });
});
