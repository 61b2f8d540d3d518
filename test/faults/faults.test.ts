// The history-checked safety suite (issue 8): K client processes run seeded
// random lease operations on M shared keys through three lease server
// processes while the suite kills servers, restarts PostgreSQL, cuts,
// stalls and delays connections, freezes a client and holds a lease row
// lock. Each fault is a test of its own, which injects it and asserts its
// expected outcome; then the whole history goes through the checker, and
// each invariant it checks (S1, S4–S7, L2 and the audit trail) is a test of
// its own, so a failure names exactly what broke. A summary is written to
// test-results/.

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { createWriteStream, type WriteStream } from "node:fs";
import { mkdir, writeFile } from "node:fs/promises";
import path from "node:path";
import { createInterface } from "node:readline";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { Code, ConnectError } from "@connectrpc/connect";
import postgres from "postgres";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createLeaseClient, durationFromMs, LeaseholdError } from "../../src/client/index.js";
import { EventType, type WatchResponse } from "../../src/gen/leasehold/v1/lease_pb.js";
import { grpcClient, type LeaseClient, repoRoot } from "../support/server.js";
import { openWatch } from "../support/streams.js";
import { waitFor } from "../support/wait.js";
import {
  checkOperations,
  type Invariant,
  type LeaseEvent,
  type OperationsCheckResult,
  recordsFromHistory,
  type Violation,
} from "./checker.js";
import type { KeeperCheckResult } from "./checker-keepers.js";
import type { CountsLine, OperationKind, WorkerConfig } from "./client-worker.js";
import { type Cluster, startCluster } from "./cluster.js";
import { countOperations, type HistoryEvent } from "./op-history.js";
import { createPrng, soakBounds, suiteSeed } from "./prng.js";

const soak = process.env.LEASEHOLD_SOAK === "1";
const bounds = soakBounds();
const seed = suiteSeed();
const rng = createPrng(seed);
const ttlMs = 1_200;
// A soak runs four times the clients on four times the keys (so about as
// much contention per key as the default run's four on three), and their
// work holds a quarter as long, for more operations per minute. The default
// run keeps its shape and length.
const clientCount = soak ? 16 : 4;
const accountId = "faults";
const sessionIds = ["alpha", "beta", "gamma"];
if (soak) {
  sessionIds.push("delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu");
}
const holdScale = soak ? 0.25 : 1;
/** An operations-bounded soak without a time bound gives up after this long. */
const soakCapMinutes = 6 * 60;
/** Keys of the suite's own probes: another account, so they stay out of the clients' history. */
const probeAccount = "faults-probe";
const workerPath = fileURLToPath(new URL("./client-worker.ts", import.meta.url));
const wallUs = () => Math.round((performance.timeOrigin + performance.now()) * 1000);
/** The history's time 0, on the host's monotonic clock (the clients' `time` counts from it). */
const originNs = process.hrtime.bigint();

interface Worker {
  index: number;
  child: ChildProcess;
  /** Its latest counts line: outcomes by name, operations by kind (cumulative). */
  counts: Record<string, number>;
  operations: Record<OperationKind, number>;
  exited: Promise<number | null>;
}

/**
 * The clients' history: kept parsed for the checker (which needs all of it),
 * and written to test-results/faults-history.jsonl line by line as it
 * arrives, so a soak's history is never also built up as one string.
 */
interface History {
  events: HistoryEvent[];
  out: WriteStream;
}

function appendToHistory(history: History, event: HistoryEvent, line = JSON.stringify(event)) {
  history.events.push(event);
  history.out.write(`${line}\n`);
}

interface FaultOutcome {
  fault: string;
  detail: string;
  expected: string;
  /** "ok", or why the fault's expected outcome was not seen. */
  asserted: string;
}

/** One kind of fault: injected, its expected outcome asserted, then undone. */
interface Fault {
  name: string;
  expected: string;
  /** Injects the fault and asserts its outcome; returns where it struck. */
  inject(): Promise<string>;
}

/** What the checker checks, one test each. */
const invariantChecks: [Invariant, string][] = [
  ["S1", "one holder: no run is granted a key inside another run's held interval"],
  [
    "S4",
    "no resurrection: no renewal or same-run re-acquire is confirmed after its grant ended (deadline, release, revoke), and no run is granted twice",
  ],
  [
    "S5",
    "owner-checked release: a lease ends as released only when its own run asked, as revoked only by a recorded revoke",
  ],
  ["S6", "monotonic fencing: per key, tokens strictly increase in grant order"],
  ["S7", "fenced writes: no accepted write carries a lower token than one accepted before it"],
  ["L2", "stop on loss: every run stopped its work before its last confirmed deadline"],
  [
    "K1",
    "keepers: no keeper is renewed nor granted a lease after its leases expired or its close or revoke was answered; no keeper run writes after its keeper's confirmed deadline unless paused",
  ],
  [
    "K2",
    "lock-delay: a key whose keeper lease expired is granted to no other run before the keeper's deadline plus its lock-delay",
  ],
  [
    "E1",
    "one leader: per election, leadership intervals do not overlap and terms strictly increase",
  ],
  ["audit", "every grant a client saw is in lease_events exactly once, with its token and time"],
  ["get", "reads: no Get shows a token older than one granted and answered before the Get began"],
  [
    "history",
    "the history is well formed: a process does one operation at a time, none after an info",
  ],
];

function startWorker(
  index: number,
  cluster: Cluster,
  durationMs: number,
  history: History,
): Worker {
  const proxies = cluster.instances.map((i) => i.proxy.url);
  // Each client prefers another instance first, so load spreads over all three.
  const baseUrls = proxies.map((_, i) => proxies[(i + index) % proxies.length] as string);
  const config: WorkerConfig = {
    client: index,
    clients: clientCount,
    originNs: originNs.toString(),
    seed: (seed + index * 0x9e37_79b9) >>> 0,
    baseUrls,
    guardedUrl: cluster.guardedUrl,
    databaseUrl: cluster.databaseUrl,
    accountId,
    sessionIds,
    durationMs,
    ttlMs,
    // Half the clients speak gRPC (the client's own transport), half Connect.
    protocol: index % 2 === 1 ? "grpc" : "connect",
    holdScale,
  };
  const child = spawn(process.execPath, ["--import", "tsx", workerPath, JSON.stringify(config)], {
    cwd: repoRoot,
    stdio: ["pipe", "pipe", "inherit"],
  });
  const worker: Worker = {
    index,
    child,
    counts: {},
    operations: { acquire: 0, renew: 0, release: 0, write: 0, revoke: 0, keeper: 0, campaign: 0 },
    // "close", not "exit": only then has every line of its stdout been read.
    exited: once(child, "close").then(([code]) => code as number | null),
  };
  createInterface({ input: child.stdout as NodeJS.ReadableStream }).on("line", (line) => {
    const parsed = JSON.parse(line) as HistoryEvent | CountsLine;
    if (parsed.type === "counts") {
      worker.counts = parsed.counts;
      worker.operations = parsed.operations;
    } else appendToHistory(history, parsed, line);
  });
  return worker;
}

const operationKinds: OperationKind[] = [
  "acquire",
  "renew",
  "release",
  "write",
  "revoke",
  "keeper",
  "campaign",
];

/** The clients' operations so far, by kind and in total. */
function operationsOf(workers: readonly Worker[]) {
  const byKind = Object.fromEntries(operationKinds.map((k) => [k, 0])) as Record<
    OperationKind,
    number
  >;
  for (const w of workers) for (const k of operationKinds) byKind[k] += w.operations[k];
  return { total: operationKinds.reduce((n, k) => n + byKind[k], 0), byKind };
}

/** A soak's bounds in words, for test names and the summary. */
function describeBounds(): string {
  const parts = [
    bounds.operations !== undefined ? `${bounds.operations} operations` : undefined,
    bounds.minutes !== undefined ? `${bounds.minutes} minutes` : undefined,
  ].filter((p) => p !== undefined);
  return parts.length > 1 ? `${parts.join(" or ")}, whichever comes first` : (parts[0] as string);
}

/** The gRPC code of an error of either client: the library's LeaseholdError or a ConnectError. */
function errorCode(error: unknown): Code {
  return error instanceof LeaseholdError ? error.code : ConnectError.from(error).code;
}

async function codeOf(call: Promise<unknown>): Promise<Code | "ok"> {
  try {
    await call;
    return "ok";
  } catch (error) {
    return errorCode(error);
  }
}

/** Retries a call while the server answers UNAVAILABLE (it is reconnecting), up to a bound. */
async function untilAvailable<T>(call: () => Promise<T>, boundMs = 30_000): Promise<T> {
  const giveUpAt = performance.now() + boundMs;
  for (let attempt = 0; ; attempt++) {
    try {
      return await call();
    } catch (error) {
      const code = errorCode(error);
      if (code !== Code.Unavailable || performance.now() > giveUpAt) throw error;
      await sleep(Math.min(50 * 2 ** attempt, 500));
    }
  }
}

/** Waits until an instance's /metrics says its LISTEN connection is in place, up to a bound. */
async function untilListening(baseUrl: string, boundMs = 30_000): Promise<void> {
  await waitFor(
    async () => {
      const text = await (await fetch(`${baseUrl}/metrics`)).text();
      return text.split("\n").includes("leasehold_notification_listening 1");
    },
    { what: `${baseUrl} to listen for notifications`, timeoutMs: boundMs, intervalMs: 50 },
  );
}

const eventOf = (type: EventType) => (m: WatchResponse) =>
  m.kind.case === "event" && m.kind.value.type === type;

describe.sequential("fault injection under a checked history", () => {
  let cluster: Cluster;
  const workers: Worker[] = [];
  const faults: FaultOutcome[] = [];
  let history: History;
  let startedAt = 0;
  /** Fault cycles run: the first is declared as tests below; a soak adds more. */
  let cycles = 1;
  /** Set once the clients have finished and the history went through the checker. */
  let result: OperationsCheckResult | undefined;
  let probe = 0;
  const probeKey = (what: string) => ({ accountId: probeAccount, sessionId: `${what}-${++probe}` });
  const direct = (i: number): LeaseClient =>
    grpcClient((cluster.instances[i] as (typeof cluster.instances)[number]).directUrl);
  const instance = (i: number) => cluster.instances[i] as (typeof cluster.instances)[number];

  beforeAll(async () => {
    console.log(
      `fault suite seed ${seed} (replay: LEASEHOLD_FAULT_SEED=${seed} npm run test:faults)`,
    );
    const results = path.join(repoRoot, "test-results");
    await mkdir(results, { recursive: true });
    history = { events: [], out: createWriteStream(path.join(results, "faults-history.jsonl")) };
    cluster = await startCluster(3);
    startedAt = performance.now();
    const budgetMs = soak ? (bounds.minutes ?? soakCapMinutes) * 60_000 : 0;
    for (let i = 0; i < clientCount; i++) {
      workers.push(startWorker(i, cluster, budgetMs + 600_000, history));
    }
    // Part of the schedule, not a wait for something: a quiet start, so that
    // every client holds and writes before the first fault.
    await sleep(2 * ttlMs);
  });

  afterAll(async () => {
    for (const w of workers) {
      if (w.child.exitCode === null) {
        w.child.kill("SIGCONT");
        w.child.kill("SIGKILL");
      }
    }
    await cluster?.close();
    if (history && !history.out.closed) {
      history.out.end();
      await once(history.out, "close");
    }
  });

  // SIGKILL of one instance: clients go on through the others; it comes back on its port.
  async function killAndRestart() {
    const victim = rng.int(0, 2);
    await cluster.killInstance(victim);
    const keys: ReturnType<typeof probeKey>[] = [];
    try {
      const order = [victim, (victim + 1) % 3, (victim + 2) % 3].map((i) => instance(i).proxy.url);
      for (const protocol of ["connect", "grpc"] as const) {
        const sentAt = performance.now();
        const failovers: string[] = [];
        // What is checked is that the call fails over, not how fast: the
        // deadline leaves room for a machine loaded by the rest of the suite.
        const client = createLeaseClient({
          baseUrls: order,
          protocol,
          defaultTimeoutMs: 10_000,
          onEvent: (e) => {
            if (e.type === "failover") {
              failovers.push(
                `${Math.round(performance.now() - sentAt)} ms: ${e.baseUrl} ${e.error.message}`,
              );
            }
          },
        });
        const key = probeKey("kill");
        keys.push(key);
        try {
          const granted = await client
            .acquire({ key, ttl: durationFromMs(ttlMs) })
            .catch((error: unknown) => {
              throw new Error(
                `${protocol} failover acquire after killing instance ${victim} failed at ${Math.round(performance.now() - sentAt)} ms; failovers: [${failovers.join(" | ")}]`,
                { cause: error },
              );
            });
          expect(
            granted.acquired,
            `a ${protocol} client listing the killed instance first fails over`,
          ).toBe(true);
          await client.release({ key, runId: granted.lease?.runId ?? "" });
        } finally {
          client.close();
        }
      }
    } finally {
      await cluster.restartInstance(victim);
    }
    for (const key of keys) {
      const after = await direct(victim).get({ key });
      expect(after.held, "the restarted instance serves the database's state").toBe(false);
    }
    return `instance ${victim}`;
  }

  // Connections reset (and refused) by the proxy: the client fails over.
  async function dropConnections() {
    const victim = rng.int(0, 2);
    const proxy = instance(victim).proxy;
    proxy.drop();
    try {
      for (const protocol of ["connect", "grpc"] as const) {
        const only = createLeaseClient({ baseUrl: proxy.url, protocol, defaultTimeoutMs: 3_000 });
        const code = await codeOf(only.get({ key: probeKey("drop") }));
        only.close();
        expect(code, `a ${protocol} call through a dropped connection fails as UNAVAILABLE`).toBe(
          Code.Unavailable,
        );
      }
      const order = [victim, (victim + 1) % 3].map((i) => instance(i).proxy.url);
      const failover = createLeaseClient({ baseUrls: order, defaultTimeoutMs: 10_000 });
      const key = probeKey("drop");
      const granted = await failover.acquire({ key, ttl: durationFromMs(ttlMs) });
      expect(granted.acquired, "the next instance grants").toBe(true);
      await failover.release({ key, runId: granted.lease?.runId ?? "" });
      failover.close();
      // The fault's length: the cut stays a while under load, so that
      // streams on it must reconnect elsewhere.
      await sleep(rng.int(ttlMs / 2, 2 * ttlMs));
    } finally {
      proxy.pass();
    }
    return `instance ${victim}`;
  }

  // A half-open connection: nothing moves, nothing is closed.
  async function stallConnections() {
    const victim = rng.int(0, 2);
    const proxy = instance(victim).proxy;
    const stallMs = rng.int(ttlMs, 3 * ttlMs);
    proxy.stall();
    try {
      const only = grpcClient(proxy.url);
      const code = await codeOf(only.get({ key: probeKey("stall") }, { timeoutMs: 300 }));
      expect(code, "a call through a stalled connection runs into its deadline").toBe(
        Code.DeadlineExceeded,
      );
      await sleep(stallMs);
    } finally {
      proxy.pass();
    }
    const after = await untilAvailable(() => grpcClient(proxy.url).get({ key: probeKey("stall") }));
    expect(after.held).toBe(false);
    return `instance ${victim}, ${stallMs} ms`;
  }

  // Late bytes, in order, both ways.
  async function delayConnections() {
    const victim = rng.int(0, 2);
    const proxy = instance(victim).proxy;
    const delayMs = rng.int(50, ttlMs / 4);
    proxy.delay(delayMs);
    try {
      const got = await grpcClient(proxy.url).get({ key: probeKey("delay") });
      expect(got.held, "a delayed connection still answers correctly").toBe(false);
      await sleep(2 * ttlMs);
    } finally {
      proxy.delay(0);
    }
    return `instance ${victim}, ${delayMs} ms`;
  }

  // SIGSTOP of one client process for up to 2.5 TTLs: its leases expire meanwhile.
  async function freezeClient() {
    const worker = workers[rng.int(0, workers.length - 1)] as Worker;
    const pauseMs = rng.int(ttlMs / 2, (5 * ttlMs) / 2);
    const fromUs = wallUs();
    worker.child.kill("SIGSTOP");
    try {
      await sleep(pauseMs);
    } finally {
      worker.child.kill("SIGCONT");
      appendToHistory(history, {
        type: "info",
        process: "nemesis",
        f: "pause",
        client: worker.index,
        fromUs,
        toUs: wallUs(),
      });
    }
    expect(worker.child.exitCode, "the frozen client resumes").toBe(null);
    return `client ${worker.index}, ${pauseMs} ms`;
  }

  // PostgreSQL stopped and started again on the same port.
  async function restartDatabase() {
    const held = probeKey("kept");
    const before = await direct(0).acquire({ key: held, ttl: durationFromMs(120_000) });
    expect(before.acquired).toBe(true);
    await cluster.stopDatabase();
    const downFor = rng.int(ttlMs, 2 * ttlMs);
    try {
      const downCodes = await Promise.all(
        [0, 1, 2].map((i) =>
          codeOf(direct(i).acquire({ key: probeKey("down"), ttl: durationFromMs(ttlMs) })),
        ),
      );
      expect(downCodes, "every instance answers UNAVAILABLE while the database is down").toEqual([
        Code.Unavailable,
        Code.Unavailable,
        Code.Unavailable,
      ]);
      await sleep(downFor);
    } finally {
      await cluster.startDatabase();
    }
    for (const i of [0, 1, 2]) await untilAvailable(() => direct(i).get({ key: held }));
    // Every instance listens again (its LISTEN connection is replaced with
    // backoff while the database is down), so a grant now travels as an event.
    for (const i of [0, 1, 2]) await untilListening(instance(i).directUrl);
    const kept = await direct(1).get({ key: held });
    expect(kept.lease?.runId, "a grant made before the restart is still there").toBe(
      before.lease?.runId,
    );
    expect(kept.lease?.fencingToken).toBe(before.lease?.fencingToken);
    await direct(2).release({ key: held, runId: before.lease?.runId ?? "" });

    // LISTEN resumed on every instance: a grant through one reaches watchers on all.
    const key = probeKey("listen");
    const watches = [0, 1, 2].map((i) => openWatch(direct(i), key));
    try {
      for (const w of watches) await w.reader.next((m) => m.kind.case === "snapshot");
      const granted = await direct(rng.int(0, 2)).acquire({ key, ttl: durationFromMs(ttlMs) });
      const token = granted.lease?.fencingToken;
      for (const w of watches) {
        // As its event, or in a snapshot: an instance that resynchronises
        // (its LISTEN connection replaced once more) sends one in its place.
        const seen = await w.reader.next(
          (m) =>
            eventOf(EventType.ACQUIRED)(m) ||
            (m.kind.case === "snapshot" &&
              m.kind.value.leases.some((l) => l.fencingToken === token)),
        );
        expect(
          seen.kind.case === "event"
            ? seen.kind.value.fencingToken
            : seen.kind.value?.leases.find((l) => l.fencingToken === token)?.fencingToken,
        ).toBe(token);
      }
    } finally {
      for (const w of watches) w.abort();
    }
    return `down ${downFor} ms`;
  }

  // kill -9 of the primary mid-load, the synchronous standby promoted and the
  // database endpoint moved to it; the servers' new connections reach it.
  // Then a new standby is rebuilt, so the fault can come round again.
  async function failOverDatabase() {
    const held = probeKey("kept");
    const before = await direct(0).acquire({ key: held, ttl: durationFromMs(120_000) });
    expect(before.acquired).toBe(true);
    const sql = postgres(cluster.databaseUrl, { max: 1, onnotice: () => {} });
    let detail = "";
    try {
      const [{ killClock } = { killClock: "" }] = await sql<{ killClock: string }[]>`
        SELECT clock_timestamp()::text AS "killClock"`;
      const killedAt = performance.now();
      const { killToPromotedMs } = await cluster.failoverDatabase();
      try {
        // Every instance grants again, within the probes' deadline.
        const servedAfter: number[] = [];
        const tokensAfter: bigint[] = [];
        for (const i of [0, 1, 2]) {
          const granted = await untilAvailable(() =>
            direct(i).acquire({ key: probeKey("failover"), ttl: durationFromMs(ttlMs) }),
          );
          servedAfter.push(Math.round(performance.now() - killedAt));
          expect(granted.acquired, `instance ${i} grants after the failover`).toBe(true);
          tokensAfter.push(granted.lease?.fencingToken ?? 0n);
        }
        // No grant acknowledged before the kill is lost, nor its token reused.
        const kept = await direct(1).get({ key: held });
        expect(kept.lease?.runId, "a grant made before the kill is on the new primary").toBe(
          before.lease?.runId,
        );
        expect(kept.lease?.fencingToken).toBe(before.lease?.fencingToken);
        const [{ maxBefore } = { maxBefore: "0" }] = await sql<{ maxBefore: string }[]>`
          SELECT coalesce(max(fencing_token), 0)::text AS "maxBefore"
          FROM lease_events WHERE at <= ${killClock}::timestamptz`;
        const highestBefore = [BigInt(maxBefore), before.lease?.fencingToken ?? 0n].reduce(
          (a, b) => (a > b ? a : b),
        );
        for (const token of tokensAfter) {
          expect(
            token > highestBefore,
            `token ${token} > every token before (${highestBefore})`,
          ).toBe(true);
        }
        for (const i of [0, 1, 2]) await untilListening(instance(i).directUrl);
        // A pooled connection still open to the old primary answers its next
        // statement 57P01 (UNAVAILABLE) once; the release is tried again.
        await untilAvailable(() =>
          direct(2).release({ key: held, runId: before.lease?.runId ?? "" }),
        );
        detail = `promoted ${killToPromotedMs} ms after the kill; instances served at ${servedAfter.join("/")} ms; tokens > ${highestBefore}`;
      } finally {
        const rebuildFrom = performance.now();
        await cluster.rebuildStandby();
        detail += `; standby rebuilt in ${Math.round(performance.now() - rebuildFrom)} ms`;
      }
    } finally {
      await sql.end({ timeout: 1 });
    }
    return detail;
  }

  // A transaction holding a lease row lock past lock_timeout (1 s).
  async function holdRowLock() {
    const stuck = probeKey("locked");
    const free = probeKey("free");
    const first = await direct(0).acquire({ key: stuck, ttl: durationFromMs(ttlMs) });
    await direct(0).release({ key: stuck, runId: first.lease?.runId ?? "" });
    const chaosKey = rng.pick(sessionIds);
    const sql = postgres(cluster.databaseUrl, { max: 1, onnotice: () => {} });
    let unlock = () => {};
    const gate = new Promise<void>((resolve) => {
      unlock = resolve;
    });
    let locked = () => {};
    const lockTaken = new Promise<void>((resolve) => {
      locked = resolve;
    });
    const holding = sql.begin(async (tx) => {
      await tx`SELECT 1 FROM leases WHERE account_id = ${probeAccount} AND session_id = ${stuck.sessionId} FOR UPDATE`;
      // The clients' key too, for the length of this fault: their calls fail and go on.
      await tx`SELECT 1 FROM leases WHERE account_id = ${accountId} AND session_id = ${chaosKey} FOR UPDATE`;
      locked();
      await gate;
    });
    try {
      await lockTaken;
      const [stuckCode, freeAnswer] = await Promise.all([
        codeOf(
          direct(1).acquire({ key: stuck, ttl: durationFromMs(ttlMs) }, { timeoutMs: 10_000 }),
        ),
        direct(2).acquire({ key: free, ttl: durationFromMs(ttlMs) }),
      ]);
      expect(stuckCode, "S8: the locked key fails fast with UNAVAILABLE").toBe(Code.Unavailable);
      expect(freeAnswer.acquired, "S8: another key is granted meanwhile").toBe(true);
    } finally {
      unlock();
      await holding;
      await sql.end({ timeout: 1 });
    }
    const after = await direct(1).acquire({ key: stuck, ttl: durationFromMs(ttlMs) });
    expect(after.acquired, "the key is granted once the lock is gone").toBe(true);
    return `probe key and ${accountId}/${chaosKey}`;
  }

  const cycle: Fault[] = [
    {
      name: "kill -9 server",
      expected: "a failover acquire is granted; the restarted instance serves",
      inject: killAndRestart,
    },
    {
      name: "proxy drop",
      expected: "UNAVAILABLE through it; the next instance grants",
      inject: dropConnections,
    },
    {
      name: "proxy stall (half-open)",
      expected: "DEADLINE_EXCEEDED through it, then it serves",
      inject: stallConnections,
    },
    {
      name: "proxy delay",
      expected: "answers arrive, late and correct",
      inject: delayConnections,
    },
    {
      name: "SIGSTOP client",
      expected: "the client resumes; its expired leases are refused (checker)",
      inject: freezeClient,
    },
    {
      name: "PostgreSQL stop/start",
      expected: "UNAVAILABLE meanwhile; the grant is kept; LISTEN resumes on all instances",
      inject: restartDatabase,
    },
    {
      name: "PostgreSQL failover (sync standby)",
      expected:
        "every instance grants again; tokens after exceed every token before; no grant lost",
      inject: failOverDatabase,
    },
    {
      name: "row lock > lock_timeout",
      expected: "S8: UNAVAILABLE on that key; other keys granted",
      inject: holdRowLock,
    },
  ];

  /** The seed decides the order of the faults in each cycle. */
  function shuffled(): Fault[] {
    const order = [...cycle];
    for (let i = order.length - 1; i > 0; i--) {
      const j = rng.int(0, i);
      [order[i], order[j]] = [order[j] as Fault, order[i] as Fault];
    }
    return order;
  }

  /** Injects one fault and records its outcome; then plain load for a while (seeded). */
  async function inject(fault: Fault): Promise<void> {
    let detail = "";
    try {
      detail = await fault.inject();
      faults.push({ fault: fault.name, detail, expected: fault.expected, asserted: "ok" });
    } catch (error) {
      const why = error instanceof Error ? error.message.split("\n")[0] : String(error);
      faults.push({
        fault: fault.name,
        detail,
        expected: fault.expected,
        asserted: `FAILED: ${why}`,
      });
      throw error;
    } finally {
      await sleep(rng.int(ttlMs / 2, 2 * ttlMs));
    }
  }

  // The first cycle's order is drawn now, when the tests are declared, so
  // that each fault is a test of its own; the draws come first in the seed's
  // sequence, as they always did.
  for (const fault of shuffled()) {
    it(`fault: ${fault.name} — ${fault.expected}`, () => inject(fault));
  }

  if (soak) {
    const timeBoundMs = (bounds.minutes ?? soakCapMinutes) * 60_000;
    const reachedTarget = () =>
      bounds.operations !== undefined && operationsOf(workers).total >= bounds.operations;
    const timeUp = () => performance.now() - startedAt >= timeBoundMs;
    it(
      `soak: the fault cycle repeats until ${describeBounds()}, each fault's outcome asserted`,
      async () => {
        // Every fault kind in turn, checked after each fault, so the soak ends
        // within one fault (and its stretch of load) of its bound.
        cycling: while (!reachedTarget() && !timeUp()) {
          cycles += 1;
          const before = operationsOf(workers).total;
          for (const fault of shuffled()) {
            await inject(fault).catch((error: unknown) => {
              throw new Error(`fault "${fault.name}" in cycle ${cycles}`, { cause: error });
            });
            if (reachedTarget() || timeUp()) break cycling;
          }
          const done = operationsOf(workers).total;
          const seconds = (performance.now() - startedAt) / 1000;
          console.log(
            `soak cycle ${cycles}: ${done} operations in ${Math.round(seconds)} s (${Math.round(done / seconds)}/s)`,
          );
          // A cycle lasts tens of seconds: clients that made no operation in
          // all of it are stuck, and a soak by operations would never end.
          expect(
            operationsOf(workers).total,
            `the clients made operations during cycle ${cycles}`,
          ).toBeGreaterThan(before);
        }
        if (bounds.operations !== undefined && bounds.minutes === undefined) {
          expect(
            operationsOf(workers).total,
            `the clients made ${bounds.operations} operations within ${soakCapMinutes} minutes`,
          ).toBeGreaterThanOrEqual(bounds.operations);
        }
      },
      // The soak's time bound, and a cycle's worth beyond it.
      timeBoundMs + 600_000,
    );
  }

  it("the clients finish their runs; their history and lease_events go through the checker", async () => {
    // Part of the schedule: a quiet end, as the start.
    await sleep(2 * ttlMs);
    for (const w of workers) w.child.stdin?.end();
    const exitCodes = await Promise.all(workers.map((w) => w.exited));
    expect(exitCodes, "every client finished its run").toEqual(workers.map(() => 0));

    const sql = postgres(cluster.databaseUrl, { max: 1, onnotice: () => {} });
    const rows = await sql<
      {
        id: string;
        type: string;
        sessionId: string;
        runId: string | null;
        token: string | null;
        atUs: string;
      }[]
    >`
      SELECT id::text, type, session_id AS "sessionId", run_id::text AS "runId",
             fencing_token::text AS token, (extract(epoch FROM at) * 1000000)::bigint::text AS "atUs"
      FROM lease_events WHERE account_id = ${accountId} ORDER BY id`;
    await sql.end({ timeout: 1 });
    const events: LeaseEvent[] = rows.map((r) => ({
      id: Number(r.id),
      type: r.type,
      key: `${accountId}/${r.sessionId}`,
      runId: r.runId ?? "",
      token: Number(r.token ?? 0),
      atUs: Number(r.atUs),
    }));
    // The raw history ends with the audit trail, for reading a failure against it.
    for (const e of events)
      history.out.write(`${JSON.stringify({ ...e, type: `event:${e.type}` })}\n`);
    history.out.end();
    await once(history.out, "close");
    const checkStartedAt = performance.now();
    const checked = checkOperations(history.events, events);
    const checkMs = Math.round(performance.now() - checkStartedAt);
    // The records the lease rules read, for the figures below.
    const records = recordsFromHistory(history.events);
    const historyOperations = countOperations(history.events);
    result = checked;

    const counts: Record<string, number> = {};
    for (const w of workers)
      for (const [k, v] of Object.entries(w.counts)) counts[k] = (counts[k] ?? 0) + v;
    const operations = operationsOf(workers);
    let grants = 0;
    let writesAccepted = 0;
    let writesRefusedStale = 0;
    let writesUnknown = 0;
    for (const r of records) {
      if (r.type === "grant") grants += 1;
      else if (r.type === "write") {
        if (r.accepted === true) writesAccepted += 1;
        else if (r.accepted === false) writesRefusedStale += 1;
        else writesUnknown += 1;
      }
    }
    const faultsByKind: Record<string, { injected: number; failed: number }> = {};
    for (const f of faults) {
      const kind = faultsByKind[f.fault] ?? { injected: 0, failed: 0 };
      faultsByKind[f.fault] = kind;
      kind.injected += 1;
      if (f.asserted !== "ok") kind.failed += 1;
    }
    // Every invariant, so a clean run says 0 for each rather than nothing.
    const byInvariant = Object.fromEntries(invariantChecks.map(([i]) => [i, 0])) as Record<
      Invariant,
      number
    >;
    for (const v of checked.violations) byInvariant[v.invariant] += 1;
    const durationS = Math.round((performance.now() - startedAt) / 1000);
    const summary: Summary = {
      seed,
      soak,
      soakBounds: soak ? describeBounds() : "none (one fault cycle)",
      cycles,
      durationS,
      clients: clientCount,
      keys: sessionIds.length,
      instances: cluster.instances.length,
      operations: operations.total,
      operationsPerSecond: Math.round((10 * operations.total) / Math.max(durationS, 1)) / 10,
      historyEvents: history.events.length,
      getsChecked: checked.getsChecked,
      grants,
      auditEvents: events.length,
      unseenGrants: checked.unseenGrants,
      writesAccepted,
      writesRefusedStale,
      writesUnknown,
      l2Checked: checked.l2Checked,
      l2WithinLatency: checked.l2WithinLatency,
      l2ExcusedPaused: checked.l2Excused,
      checkerMs: checkMs,
      faultsInjected: faults.length,
      faultsFailed: faults.filter((f) => f.asserted !== "ok").length,
      violations: checked.violations.length,
      operationsByKind: operations.byKind,
      historyOperations,
      faultsByKind,
      violationsByInvariant: byInvariant,
      keeperRules: { ...checked.keepers, violations: checked.keepers.violations.length },
      faults,
      counts,
    };
    await writeSummary(summary, checked.violations);

    expect(grants, "the clients were granted leases").toBeGreaterThan(0);
    expect(writesAccepted, "the clients wrote to the guarded store").toBeGreaterThan(0);
    // The keeper and election rules had something to judge: keepers kept
    // leases that wrote, heartbeats were answered, candidates led.
    expect(checked.keepers.keepers, "keepers were opened").toBeGreaterThan(0);
    expect(checked.keepers.heartbeatsChecked, "keeper heartbeats were answered").toBeGreaterThan(0);
    expect(
      checked.keepers.keeperWritesChecked,
      "runs on keepers wrote to the guarded store",
    ).toBeGreaterThan(0);
    expect(checked.keepers.leaderships, "candidates were elected").toBeGreaterThan(0);
    // Revokes that ended a lease, not attempts (a Revoke that finds the key
    // free ends nothing): the beat's revoke holds the key first. Each must be
    // matched by the checker to the REVOKED row of the lease it ended.
    const revokesEnded = records.filter((r) => r.type === "revoke" && r.revoked === true).length;
    expect(revokesEnded, "Revoke answered revoked: true (it ended a lease)").toBeGreaterThan(0);
    expect(
      checked.revokesConfirmed,
      "the checker found each lease Revoke ended revoked in lease_events",
    ).toBe(revokesEnded);
    // A run whose lease ended is refused the session again, with the cause
    // docs/design.md documents for an ended lease: how it ended.
    const lateRefusals = Object.entries(counts).filter(([k]) =>
      k.startsWith("late-reacquire-not-held-"),
    );
    const endedCauses = ["released", "revoked", "expired"].map(
      (c) => `late-reacquire-not-held-${c}`,
    );
    expect(
      lateRefusals.filter(([k]) => endedCauses.includes(k)).reduce((n, [, v]) => n + v, 0),
      "late re-acquires of ended runs refused as LEASE_NOT_HELD (released, revoked or expired)",
    ).toBeGreaterThan(0);
    expect(
      Object.fromEntries(lateRefusals.filter(([k]) => !endedCauses.includes(k))),
      "late re-acquires refused with a cause an ended lease is never given",
    ).toEqual({});
    const sameRunAcquires = Object.entries(counts)
      .filter(([k]) => /^(late-)?reacquire-(ok|not-held-)/.test(k))
      .reduce((n, [, v]) => n + v, 0);
    expect(
      sameRunAcquires,
      "runs acquired their sessions again with their own run_id",
    ).toBeGreaterThan(0);
  });

  for (const [invariant, rule] of invariantChecks) {
    it(`${invariant}: ${rule}`, () => {
      if (!result) throw new Error("the history was not collected: see the test before");
      const broken = result.violations.filter((v) => v.invariant === invariant);
      expect(
        broken.map((v) => `${v.key}: ${v.message}`),
        `${invariant} violations (test-results/faults-summary.json lists them all)`,
      ).toEqual([]);
    });
  }
});

/** Scalar figures first (one table row each), then the breakdowns. */
interface Summary extends Record<string, unknown> {
  operationsByKind: Record<OperationKind, number>;
  /** The history's operations by kind and outcome. */
  historyOperations: Record<string, Record<string, number>>;
  faultsByKind: Record<string, { injected: number; failed: number }>;
  violationsByInvariant: Record<Invariant, number>;
  keeperRules: Omit<KeeperCheckResult, "violations"> & { violations: number };
  faults: FaultOutcome[];
  counts: Record<string, number>;
}

async function writeSummary(summary: Summary, violations: Violation[]) {
  const dir = path.join(repoRoot, "test-results");
  await mkdir(dir, { recursive: true });
  await writeFile(
    path.join(dir, "faults-summary.json"),
    `${JSON.stringify({ ...summary, violationList: violations }, null, 2)}\n`,
  );
  const breakdowns = new Set([
    "operationsByKind",
    "historyOperations",
    "faultsByKind",
    "violationsByInvariant",
    "faults",
    "counts",
  ]);
  const rows = Object.entries(summary)
    .filter(([k]) => !breakdowns.has(k))
    .map(([k, v]) => `| ${k} | ${String(v)} |`);
  // A soak injects hundreds of faults: list each one only when it failed, or
  // when there are few (one cycle); the table by kind counts them all.
  const listed =
    summary.faults.length <= 20
      ? summary.faults
      : summary.faults.filter((f) => f.asserted !== "ok");
  const md = [
    "# Fault suite summary",
    "",
    "| measure | value |",
    "| --- | --- |",
    ...rows,
    "",
    "| operation | count |",
    "| --- | --- |",
    ...Object.entries(summary.operationsByKind).map(([k, n]) => `| ${k} | ${n} |`),
    "",
    "| history operation | ok | fail | info | open |",
    "| --- | --- | --- | --- | --- |",
    ...Object.entries(summary.historyOperations).map(
      ([f, n]) => `| ${f} | ${n.ok} | ${n.fail} | ${n.info} | ${n.open} |`,
    ),
    "",
    "| invariant | violations |",
    "| --- | --- |",
    ...Object.entries(summary.violationsByInvariant).map(([k, n]) => `| ${k} | ${n} |`),
    "",
    "| fault | injected | failed |",
    "| --- | --- | --- |",
    ...Object.entries(summary.faultsByKind).map(
      ([k, f]) => `| ${k} | ${f.injected} | ${f.failed} |`,
    ),
    "",
    ...(listed.length > 0
      ? [
          "| fault | where | expected outcome | asserted |",
          "| --- | --- | --- | --- |",
          ...listed.map((f) => `| ${f.fault} | ${f.detail} | ${f.expected} | ${f.asserted} |`),
          "",
        ]
      : []),
    ...(violations.length > 0
      ? ["## Violations", "", ...violations.map((v) => `- ${v.invariant} ${v.key}: ${v.message}`)]
      : []),
    "",
  ].join("\n");
  await writeFile(path.join(dir, "faults-summary.md"), md);
  console.log(md);
}
