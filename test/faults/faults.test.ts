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
  type CheckResult,
  checkHistory,
  type HistoryRecord,
  type Invariant,
  type LeaseEvent,
  type Violation,
} from "./checker.js";
import type { WorkerConfig } from "./client-worker.js";
import { type Cluster, startCluster } from "./cluster.js";
import { createPrng, suiteSeed } from "./prng.js";

const soak = process.env.LEASEHOLD_SOAK === "1";
const soakMinutes = Number(process.env.LEASEHOLD_SOAK_MINUTES ?? "10");
if (!(soakMinutes > 0 && Number.isFinite(soakMinutes))) {
  throw new RangeError(
    `LEASEHOLD_SOAK_MINUTES must be a positive number, got ${process.env.LEASEHOLD_SOAK_MINUTES}`,
  );
}
const seed = suiteSeed();
const rng = createPrng(seed);
const ttlMs = 1_200;
const clientCount = 4;
const accountId = "faults";
const sessionIds = ["alpha", "beta", "gamma"];
/** Keys of the suite's own probes: another account, so they stay out of the clients' history. */
const probeAccount = "faults-probe";
const workerPath = fileURLToPath(new URL("./client-worker.ts", import.meta.url));
const wallUs = () => Math.round((performance.timeOrigin + performance.now()) * 1000);

interface Worker {
  index: number;
  child: ChildProcess;
  records: HistoryRecord[];
  counts: Record<string, number>;
  exited: Promise<number | null>;
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
  ["S4", "no resurrection: no renewal is confirmed after its grant ended"],
  ["S5", "owner-checked release: a lease ends as released only when its own run asked"],
  ["S6", "monotonic fencing: per key, tokens strictly increase in grant order"],
  ["S7", "fenced writes: no accepted write carries a lower token than one accepted before it"],
  ["L2", "stop on loss: every run stopped its work before its last confirmed deadline"],
  ["audit", "every grant a client saw is in lease_events exactly once, with its token and time"],
];

function startWorker(index: number, cluster: Cluster, durationMs: number): Worker {
  const proxies = cluster.instances.map((i) => i.proxy.url);
  // Each client prefers another instance first, so load spreads over all three.
  const baseUrls = proxies.map((_, i) => proxies[(i + index) % proxies.length] as string);
  const config: WorkerConfig = {
    client: index,
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
  };
  const child = spawn(process.execPath, ["--import", "tsx", workerPath, JSON.stringify(config)], {
    cwd: repoRoot,
    stdio: ["pipe", "pipe", "inherit"],
  });
  const worker: Worker = {
    index,
    child,
    records: [],
    counts: {},
    // "close", not "exit": only then has every line of its stdout been read.
    exited: once(child, "close").then(([code]) => code as number | null),
  };
  createInterface({ input: child.stdout as NodeJS.ReadableStream }).on("line", (line) => {
    const parsed = JSON.parse(line) as
      | HistoryRecord
      | { type: "counts"; counts: Record<string, number> };
    if (parsed.type === "counts") worker.counts = parsed.counts;
    else worker.records.push(parsed);
  });
  return worker;
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
  const pauses: HistoryRecord[] = [];
  let startedAt = 0;
  /** Fault cycles run: the first is declared as tests below; a soak adds more. */
  let cycles = 1;
  /** Set once the clients have finished and the history went through the checker. */
  let result: CheckResult | undefined;
  let probe = 0;
  const probeKey = (what: string) => ({ accountId: probeAccount, sessionId: `${what}-${++probe}` });
  const direct = (i: number): LeaseClient =>
    grpcClient((cluster.instances[i] as (typeof cluster.instances)[number]).directUrl);
  const instance = (i: number) => cluster.instances[i] as (typeof cluster.instances)[number];

  beforeAll(async () => {
    console.log(
      `fault suite seed ${seed} (replay: LEASEHOLD_FAULT_SEED=${seed} npm run test:faults)`,
    );
    cluster = await startCluster(3);
    startedAt = performance.now();
    const budgetMs = soak ? soakMinutes * 60_000 : 0;
    for (let i = 0; i < clientCount; i++) workers.push(startWorker(i, cluster, budgetMs + 600_000));
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
      pauses.push({ type: "pause", client: worker.index, fromUs, toUs: wallUs() });
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
      for (const w of watches) {
        const seen = await w.reader.next(eventOf(EventType.ACQUIRED));
        expect(seen.kind.case === "event" && seen.kind.value.fencingToken).toBe(
          granted.lease?.fencingToken,
        );
      }
    } finally {
      for (const w of watches) w.abort();
    }
    return `down ${downFor} ms`;
  }

  // kill -9 of the primary mid-load, the synchronous standby promoted; the
  // servers follow the multi-host URL to it. Then a new standby is rebuilt.
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
        await direct(2).release({ key: held, runId: before.lease?.runId ?? "" });
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
    const soakMs = soakMinutes * 60_000;
    it(
      `soak: the fault cycle repeats for ${soakMinutes} minutes, each fault's outcome asserted`,
      async () => {
        while (performance.now() - startedAt < soakMs) {
          cycles += 1;
          for (const fault of shuffled()) {
            await inject(fault).catch((error: unknown) => {
              throw new Error(`fault "${fault.name}" in cycle ${cycles}`, { cause: error });
            });
          }
        }
      },
      // The soak's own length, and a cycle's worth beyond it.
      soakMs + 600_000,
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
    const records = [...workers.flatMap((w) => w.records), ...pauses];
    const checked = checkHistory(records, events);
    result = checked;

    const counts: Record<string, number> = {};
    for (const w of workers)
      for (const [k, v] of Object.entries(w.counts)) counts[k] = (counts[k] ?? 0) + v;
    const grants = records.filter((r) => r.type === "grant").length;
    const writes = records.filter((r) => r.type === "write");
    const byInvariant: Record<string, number> = {};
    for (const v of checked.violations)
      byInvariant[v.invariant] = (byInvariant[v.invariant] ?? 0) + 1;
    const summary = {
      seed,
      soak,
      cycles,
      durationS: Math.round((performance.now() - startedAt) / 1000),
      clients: clientCount,
      keys: sessionIds.length,
      instances: cluster.instances.length,
      operations: counts.operations ?? 0,
      historyRecords: records.length,
      grants,
      auditEvents: events.length,
      unseenGrants: checked.unseenGrants,
      writesAccepted: writes.filter((w) => w.type === "write" && w.accepted === true).length,
      writesRefusedStale: writes.filter((w) => w.type === "write" && w.accepted === false).length,
      l2Checked: checked.l2Checked,
      l2WithinLatency: checked.l2WithinLatency,
      l2ExcusedPaused: checked.l2Excused,
      faultsInjected: faults.length,
      faultsFailed: faults.filter((f) => f.asserted !== "ok").length,
      faults,
      violations: checked.violations.length,
      violationsByInvariant: byInvariant,
      counts,
    };
    await writeSummary(summary, checked.violations);
    // The raw history, for reading a failure against lease_events.
    await writeFile(
      path.join(repoRoot, "test-results", "faults-history.jsonl"),
      [...records, ...events.map((e) => ({ ...e, type: `event:${e.type}` }))]
        .map((r) => JSON.stringify(r))
        .join("\n"),
    );

    expect(grants, "the clients were granted leases").toBeGreaterThan(0);
    expect(summary.writesAccepted, "the clients wrote to the guarded store").toBeGreaterThan(0);
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

async function writeSummary(
  summary: Record<string, unknown> & { faults: FaultOutcome[] },
  violations: Violation[],
) {
  const dir = path.join(repoRoot, "test-results");
  await mkdir(dir, { recursive: true });
  await writeFile(
    path.join(dir, "faults-summary.json"),
    `${JSON.stringify({ ...summary, violationList: violations }, null, 2)}\n`,
  );
  const rows = Object.entries(summary)
    .filter(([k]) => !["faults", "counts", "violationsByInvariant"].includes(k))
    .map(([k, v]) => `| ${k} | ${String(v)} |`);
  const faultRows = summary.faults.map(
    (f) => `| ${f.fault} | ${f.detail} | ${f.expected} | ${f.asserted} |`,
  );
  const md = [
    "# Fault suite summary",
    "",
    "| measure | value |",
    "| --- | --- |",
    ...rows,
    "",
    "| fault | where | expected outcome | asserted |",
    "| --- | --- | --- | --- |",
    ...faultRows,
    "",
    ...(violations.length > 0
      ? ["## Violations", "", ...violations.map((v) => `- ${v.invariant} ${v.key}: ${v.message}`)]
      : []),
    "",
  ].join("\n");
  await writeFile(path.join(dir, "faults-summary.md"), md);
  console.log(md);
}
