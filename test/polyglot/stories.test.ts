// Polyglot clients, proven: the Python (grpcio) and Go (grpc-go) example
// workers against `leasehold serve` and `leasehold guarded serve`, each its
// own OS process on a real socket and a real PostgreSQL. Each worker reaches
// the lease server through a TCP proxy of its own, so a test can cut one
// worker's KeepAlive stream and nobody else's. Every step waits for a line a
// worker printed, an answer of the lease server, or a row in the database.

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { msFromDuration } from "../../src/client/durations.js";
import {
  GuardedStoreService,
  PutResponseSchema,
} from "../../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { fenceClaimHeaders } from "../../src/guarded/headers.js";
import { fencedCallKey, fencingInterceptor } from "../../src/guarded/interceptor.js";
import { type Listener, listen } from "../../src/host/listener.js";
import type { SessionKey } from "../../src/lease/types.js";
import { durationFromMillis } from "../../src/server/rpc/convert.js";
import type { TestDatabase } from "../support/db.js";
import { useTestDatabase } from "../support/fixture.js";
import { freshKey } from "../support/leases.js";
import {
  type GuardedClient,
  grpcClient,
  guardedGrpcClient,
  type LeaseClient,
  type ServerProcess,
} from "../support/server.js";
import { startTcpProxy, type TcpProxy } from "../support/tcp-proxy.js";
import {
  type Language,
  languages,
  spawnWorker,
  token,
  type WorkerEvent,
  type WorkerOptions,
  type WorkerProcess,
} from "./workers.js";

// Short enough for a quick story, long enough that a loaded two-core
// machine keeps the renewals (every 667 ms) well inside the window. The
// margin is what L2 is checked against: a worker whose stream is stalled
// must stop at least this long before the database deadline.
const ttlMs = 3_000;
const marginMs = 1_000;
const takeoverWaitMs = 30_000;

const { anotherDatabase, spawnServer, spawnGuardedServer, defer } = useTestDatabase();
let leaseServer: ServerProcess;
let guardedServer: ServerProcess;
let headerStore: Listener;
/** The header-fenced store's own database. */
let headerDb: TestDatabase;
let leases: LeaseClient;
let store: GuardedClient;
let running: { workers: WorkerProcess[]; proxies: TcpProxy[] } = { workers: [], proxies: [] };
const measured: Record<string, Record<string, number>> = {};

const hostPort = (url: string) => new URL(url).host;

/**
 * A GuardedStoreService fenced by the request headers alone: the fencing
 * interceptor of src/guarded reads leasehold-fencing-token,
 * leasehold-account-id and leasehold-session-id and runs the fence in a
 * transaction; Put records what it was given on that transaction and never
 * looks at the token in the message. A worker whose headers are missing or
 * wrong cannot write here.
 */
function headerFencedRoutes() {
  return (router: ConnectRouter) => {
    router.service(GuardedStoreService, {
      put: async (req, ctx) => {
        const call = ctx.values.get(fencedCallKey);
        if (!call) throw new ConnectError("the fencing interceptor did not run", Code.Internal);
        await call.tx`
          INSERT INTO header_fenced_writes
            (account_id, session_id, header_token, message_token, name, value)
          VALUES (${call.claim.key.accountId}, ${call.claim.key.sessionId}, ${call.claim.token},
                  ${req.fencingToken}, ${req.name}, ${new TextDecoder().decode(req.value)})`;
        return create(PutResponseSchema, { highestToken: call.highestToken });
      },
    });
  };
}

beforeAll(async () => {
  let storeDb: TestDatabase;
  [storeDb, headerDb] = await Promise.all([anotherDatabase(), anotherDatabase()]);
  leaseServer = await spawnServer();
  // The store confirms with the lease server every write that raises a fence.
  guardedServer = await spawnGuardedServer(["--lease-url", leaseServer.url], {}, storeDb.url);
  leases = grpcClient(leaseServer.url);
  store = guardedGrpcClient(guardedServer.url);
  await headerDb.sql`
    CREATE TABLE header_fenced_writes (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      account_id text NOT NULL, session_id text NOT NULL, header_token bigint NOT NULL,
      message_token bigint NOT NULL, name text NOT NULL, value text NOT NULL
    )`;
  headerStore = await listen({
    host: "127.0.0.1",
    port: 0,
    handler: connectNodeAdapter({
      routes: headerFencedRoutes(),
      interceptors: [fencingInterceptor({ sql: headerDb.sql })],
    }),
  });
  defer(() => headerStore.close(0));
});

afterEach(async () => {
  const { workers, proxies } = running;
  running = { workers: [], proxies: [] };
  await Promise.all(workers.map((w) => w.kill()));
  await Promise.all(proxies.map((p) => p.close()));
});

afterAll(() => {
  for (const [story, values] of Object.entries(measured)) {
    console.info(`polyglot ${story}: ${JSON.stringify(values)}`);
  }
});

interface Started {
  worker: WorkerProcess;
  /** The TCP proxy between this worker and the lease server. */
  proxy: TcpProxy;
}

/** Starts a worker behind its own proxy and waits until it is connected. */
async function startWorker(
  lang: Language,
  holder: string,
  key: SessionKey,
  options: Partial<WorkerOptions> = {},
): Promise<Started> {
  const proxy = await startTcpProxy(leaseServer.url);
  running.proxies.push(proxy);
  const worker = spawnWorker({
    lang,
    server: hostPort(proxy.url),
    store: hostPort(guardedServer.url),
    key,
    holder,
    ttlMs,
    marginMs,
    ...options,
  });
  running.workers.push(worker);
  await worker.next("ready");
  return { worker, proxy };
}

/** The answer to the worker's first Acquire, the one without `wait`. */
const firstAnswer = (w: WorkerProcess) =>
  w.waitFor(
    "an answer to its first Acquire",
    (e) => (e.event === "acquired" || e.event === "not_acquired") && e.wait_ms === 0,
  );

/** The grant the worker got by waiting for the session. */
const waitedGrant = (w: WorkerProcess) =>
  w.next("acquired", (e) => Number(e.wait_ms) > 0, takeoverWaitMs);

/** A write accepted with the given token. */
const wroteWith = (w: WorkerProcess, t: bigint) =>
  w.next("wrote", (e) => token(e) === t && token(e, "highest_token") === t);

/** L2's local half: every write the worker sent began before it stopped. */
function expectNoWriteAfter(w: WorkerProcess, stopped: WorkerEvent) {
  for (const wrote of w.all("wrote")) {
    expect(Number(wrote.started_ms)).toBeLessThan(Number(stopped.at_ms));
  }
}

function expectStaleRefusal(late: WorkerEvent, presented: bigint, highest: bigint) {
  expect(late).toMatchObject({
    code: "ABORTED",
    reason: "STALE_FENCING_TOKEN",
    domain: "leasehold.dev",
    token: presented.toString(),
    metadata: { presented_token: presented.toString(), highest_token: highest.toString() },
  });
}

async function document(key: SessionKey) {
  const doc = await store.get({ key, name: "transcript" });
  return { text: new TextDecoder().decode(doc.value), token: doc.fencingToken };
}

describe.each(languages)("%s workers, one session", (lang) => {
  it("S1, S2, L2, S6, S7: two race and one wins; the winner's stream is stalled and it stops before the database deadline; the other takes over with a larger token; the old run's late write is ABORTED; a revoke reaches the new holder's stream as lost", async () => {
    const key = freshKey(`${lang}-race`);
    const times: Record<string, number> = {};
    measured[lang] = times;
    const [a, b] = await Promise.all([
      startWorker(lang, `${lang}-a`, key, { waitMs: takeoverWaitMs }),
      startWorker(lang, `${lang}-b`, key, { waitMs: takeoverWaitMs }),
    ]);

    // S1, S2: both ask at once, on their own connections; exactly one wins,
    // and the other is told who holds the session.
    a.worker.send("go");
    b.worker.send("go");
    const [answerA, answerB] = await Promise.all([firstAnswer(a.worker), firstAnswer(b.worker)]);
    expect([answerA.event, answerB.event].sort()).toEqual(["acquired", "not_acquired"]);
    const [winner, loser, grant, refusal] =
      answerA.event === "acquired" ? [a, b, answerA, answerB] : [b, a, answerB, answerA];
    expect(refusal.current).toMatchObject({
      run_id: grant.run_id,
      holder: winner.worker.options.holder,
      token: grant.token,
    });
    const t1 = token(grant);

    // The winner renews over its KeepAlive stream and writes with its token.
    await winner.worker.nth("renewed", 2);
    await wroteWith(winner.worker, t1);

    // The winner's connection to the lease server stalls: its renewals go
    // out and nothing comes back, and nothing tells it so. Only its local
    // deadline can stop it.
    const stalledAt = performance.now();
    winner.proxy.stall();
    const stopped = await winner.worker.next("stopped", () => true, ttlMs * 3);
    // L2: asked right after the line arrived, the database still counts the
    // winner's lease as valid: the worker stopped before the database deadline.
    const state = await leases.get({ key });
    times.stallToStopMs = Math.round(performance.now() - stalledAt);
    expect(stopped.reason).toBe("deadline");
    expect(state.held).toBe(true);
    expect(state.lease?.runId).toBe(grant.run_id);
    times.databaseTimeLeftAtStopMs = Math.round(msFromDuration(state.lease?.remaining));
    expect(times.databaseTimeLeftAtStopMs).toBeGreaterThan(0);
    expectNoWriteAfter(winner.worker, stopped);

    // S6: once the database deadline has passed, the waiting worker gets
    // the session with a strictly larger token, and writes with it.
    const takeover = await waitedGrant(loser.worker);
    times.stopToTakeoverMs = Math.round(performance.now() - stalledAt) - times.stallToStopMs;
    const t2 = token(takeover);
    expect(t2).toBeGreaterThan(t1);
    // Its Acquire waited longer than the lease's window, so the grant's
    // deadline, counted from when that request left, had passed on arrival:
    // the worker confirmed it with an Acquire of the same run_id (same token).
    expect(takeover.confirmed).toBe(true);
    await wroteWith(loser.worker, t2);

    // S7: the old run wakes up and sends the write it had ready, with its
    // old token. The guarded store has seen t2 and refuses it.
    winner.worker.send("late-write");
    expectStaleRefusal(await winner.worker.next("late_write_refused"), t1, t2);
    const doc = await document(key);
    expect(doc.token).toBe(t2);
    expect(doc.text).toMatch(
      new RegExp(`^${loser.worker.options.holder}: write \\d+ with token ${t2}$`),
    );

    // The stream's `lost` stops the new holder at once, long before any
    // deadline of its own, and its release then finds nothing to end (S5).
    const revokedAt = performance.now();
    const revoked = await leases.revoke({ key, reason: "polyglot test" });
    expect(revoked.revoked).toBe(true);
    const lost = await loser.worker.next("stopped");
    times.revokeToStopMs = Math.round(performance.now() - revokedAt);
    expect(lost).toMatchObject({ reason: "lost", cause: "LOSS_REASON_REVOKED" });
    expectNoWriteAfter(loser.worker, lost);
    await expect(loser.worker.next("released")).resolves.toMatchObject({ released: false });
  });

  it("S7: the worker's three fencing headers are what a header-fenced service checks", async () => {
    const key = freshKey(`${lang}-headers`);
    const headerStoreAddress = `127.0.0.1:${headerStore.port}`;
    const { worker: fenced } = await startWorker(lang, `${lang}-fenced`, key, {
      store: headerStoreAddress,
      writes: 3,
      writeEveryMs: 50,
    });
    fenced.send("go");
    const grant = await fenced.next("acquired");
    const t1 = token(grant);
    await expect(fenced.next("stopped")).resolves.toMatchObject({ reason: "finished", writes: 3 });
    await expect(fenced.next("released")).resolves.toMatchObject({ released: true });
    expect(fenced.all("wrote")).toHaveLength(3);

    const rows = await headerDb.sql<
      {
        accountId: string;
        sessionId: string;
        headerToken: bigint;
        messageToken: bigint;
        value: string;
      }[]
    >`
      SELECT account_id, session_id, header_token, message_token, value
      FROM header_fenced_writes WHERE session_id = ${key.sessionId} ORDER BY id`;
    expect(rows.map((r) => r.value)).toEqual(
      [1, 2, 3].map((n) => `${lang}-fenced: write ${n} with token ${t1}`),
    );
    for (const row of rows) {
      expect(row).toMatchObject({
        accountId: key.accountId,
        sessionId: key.sessionId,
        headerToken: t1,
        messageToken: t1,
      });
    }

    // A newer run writes there through the headers; the old run's late
    // write is refused by the interceptor, from its headers alone.
    const newer = await leases.acquire({ key, ttl: durationFromMillis(ttlMs), holder: "ts-test" });
    const t2 = newer.lease?.fencingToken ?? 0n;
    expect(t2).toBeGreaterThan(t1);
    await guardedGrpcClient(`http://${headerStoreAddress}`).put(
      { key, name: "transcript", value: new TextEncoder().encode("newer"), fencingToken: t2 },
      { headers: fenceClaimHeaders({ key, token: t2 }) },
    );
    fenced.send("late-write");
    expectStaleRefusal(await fenced.next("late_write_refused"), t1, t2);
  });
});

describe("a Python and a Go worker on one session", () => {
  it("S1, S3, S6, S7: each is refused naming the other as holder, takes over after a handoff and release, with a larger token; each one's late write is refused", async () => {
    const key = freshKey("interop");

    const python = await startWorker("python", "python-worker", key);
    python.worker.send("go");
    const pythonGrant = await python.worker.next("acquired");
    const tPython = token(pythonGrant);
    await wroteWith(python.worker, tPython);

    // The Go worker is refused, and told which Python run holds the session.
    const go = await startWorker("go", "go-worker", key, { waitMs: takeoverWaitMs });
    go.worker.send("go");
    const goRefused = await firstAnswer(go.worker);
    expect(goRefused).toMatchObject({
      event: "not_acquired",
      current: { holder: "python-worker", run_id: pythonGrant.run_id, token: tPython.toString() },
    });

    // Asked to hand off, the Python worker finishes its step and releases;
    // the waiting Go worker gets the session with a larger token.
    const handoff = await leases.requestHandoff({
      key,
      requesterHolder: "go-worker",
      reason: "continue in Go",
    });
    expect(handoff.delivered).toBe(true);
    await expect(python.worker.next("handoff_requested")).resolves.toMatchObject({
      requester_holder: "go-worker",
      reason: "continue in Go",
    });
    const pythonStopped = await python.worker.next("stopped");
    expect(pythonStopped.reason).toBe("handoff");
    expectNoWriteAfter(python.worker, pythonStopped);
    await expect(python.worker.next("released")).resolves.toMatchObject({ released: true });
    const goGrant = await waitedGrant(go.worker);
    const tGo = token(goGrant);
    expect(tGo).toBeGreaterThan(tPython);
    await wroteWith(go.worker, tGo);

    // The Python run's late write meets the token the Go run wrote with.
    python.worker.send("late-write");
    expectStaleRefusal(await python.worker.next("late_write_refused"), tPython, tGo);

    // And the other way round: a new Python run is refused naming the Go
    // run, takes over after its handoff, and the Go run's late write fails.
    const python2 = await startWorker("python", "python-worker-2", key, {
      waitMs: takeoverWaitMs,
    });
    python2.worker.send("go");
    await expect(firstAnswer(python2.worker)).resolves.toMatchObject({
      event: "not_acquired",
      current: { holder: "go-worker", run_id: goGrant.run_id, token: tGo.toString() },
    });
    await leases.requestHandoff({ key, requesterHolder: "python-worker-2" });
    const goStopped = await go.worker.next("stopped");
    expect(goStopped.reason).toBe("handoff");
    expectNoWriteAfter(go.worker, goStopped);
    await expect(go.worker.next("released")).resolves.toMatchObject({ released: true });
    const python2Grant = await waitedGrant(python2.worker);
    const tPython2 = token(python2Grant);
    expect(tPython2).toBeGreaterThan(tGo);
    await wroteWith(python2.worker, tPython2);
    go.worker.send("late-write");
    expectStaleRefusal(await go.worker.next("late_write_refused"), tGo, tPython2);

    const doc = await document(key);
    expect(doc.token).toBe(tPython2);
    expect(doc.text.startsWith("python-worker-2: write ")).toBe(true);
  });
});
