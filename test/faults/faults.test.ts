// The history-checked safety suite (issue 8): K client processes run seeded
// random lease operations on M shared keys through three lease server
// processes while the suite kills servers, restarts PostgreSQL, cuts,
// stalls and delays connections, freezes a client and holds a lease row
// lock. Each fault's own expected outcome is asserted when it happens; at
// the end the whole history goes through the checker (S1, S4–S7, L2 and the
// audit trail) and a summary is written to test-results/.

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
import { checkHistory, type HistoryRecord, type LeaseEvent, type Violation } from "./checker.js";
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
}

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
  const giveUpAt = performance.now() + boundMs;
  for (;;) {
    const text = await (await fetch(`${baseUrl}/metrics`)).text();
    if (text.split("\n").includes("leasehold_notification_listening 1")) return;
    if (performance.now() > giveUpAt) {
      throw new Error(`${baseUrl} is not listening for notifications ${boundMs} ms on`);
    }
    await sleep(50);
  }
}

const eventOf = (type: EventType) => (m: WatchResponse) =>
  m.kind.case === "event" && m.kind.value.type === type;

describe("fault injection under a checked history", () => {
  let cluster: Cluster;
  const workers: Worker[] = [];
  const faults: FaultOutcome[] = [];
  const pauses: HistoryRecord[] = [];
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
    const order = [victim, (victim + 1) % 3, (victim + 2) % 3].map((i) => instance(i).proxy.url);
    const keys: ReturnType<typeof probeKey>[] = [];
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
      client.close();
    }
    await cluster.restartInstance(victim);
    for (const key of keys) {
      const after = await direct(victim).get({ key });
      expect(after.held, "the restarted instance serves the database's state").toBe(false);
    }
    faults.push({
      fault: "kill -9 server",
      detail: `instance ${victim}`,
      expected: "failover acquire granted; restarted instance serves",
    });
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
      // Keep the cut a while under load: streams on it must reconnect elsewhere.
      await sleep(rng.int(ttlMs / 2, 2 * ttlMs));
    } finally {
      proxy.pass();
    }
    faults.push({
      fault: "proxy drop",
      detail: `instance ${victim}`,
      expected: "UNAVAILABLE, failover grants",
    });
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
    faults.push({
      fault: "proxy stall (half-open)",
      detail: `instance ${victim}, ${stallMs} ms`,
      expected: "DEADLINE_EXCEEDED, then serves",
    });
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
    faults.push({
      fault: "proxy delay",
      detail: `instance ${victim}, ${delayMs} ms`,
      expected: "answers arrive, late",
    });
  }

  // SIGSTOP of one client process for up to 2.5 TTLs: its leases expire meanwhile.
  async function freezeClient() {
    const worker = workers[rng.int(0, workers.length - 1)] as Worker;
    const pauseMs = rng.int(ttlMs / 2, (5 * ttlMs) / 2);
    const fromUs = wallUs();
    worker.child.kill("SIGSTOP");
    await sleep(pauseMs);
    worker.child.kill("SIGCONT");
    pauses.push({ type: "pause", client: worker.index, fromUs, toUs: wallUs() });
    expect(worker.child.exitCode, "the frozen client resumes").toBe(null);
    faults.push({
      fault: "SIGSTOP client",
      detail: `client ${worker.index}, ${pauseMs} ms`,
      expected: "resumes; its expired leases are refused",
    });
  }

  // PostgreSQL stopped and started again on the same port.
  async function restartDatabase() {
    const held = probeKey("kept");
    const before = await direct(0).acquire({ key: held, ttl: durationFromMs(120_000) });
    expect(before.acquired).toBe(true);
    await cluster.stopDatabase();
    const downFor = rng.int(ttlMs, 2 * ttlMs);
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
    await cluster.startDatabase();
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
    for (const w of watches) await w.reader.next((m) => m.kind.case === "snapshot");
    const granted = await direct(rng.int(0, 2)).acquire({ key, ttl: durationFromMs(ttlMs) });
    for (const w of watches) {
      const seen = await w.reader.next(eventOf(EventType.ACQUIRED));
      expect(seen.kind.case === "event" && seen.kind.value.fencingToken).toBe(
        granted.lease?.fencingToken,
      );
      w.abort();
    }
    faults.push({
      fault: "PostgreSQL stop/start",
      detail: `down ${downFor} ms`,
      expected: "UNAVAILABLE meanwhile; grant kept; LISTEN resumes on all instances",
    });
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
    faults.push({
      fault: "row lock > lock_timeout",
      detail: `probe key and ${accountId}/${chaosKey}`,
      expected: "UNAVAILABLE on that key; other keys granted",
    });
  }

  it("S1, S4, S5, S6, S7, L2: the clients' history under faults breaks no invariant, and agrees with lease_events", async () => {
    const startedAt = performance.now();
    const budgetMs = soak ? soakMinutes * 60_000 : 0;
    for (let i = 0; i < clientCount; i++) workers.push(startWorker(i, cluster, budgetMs + 600_000));
    // A quiet start: every client holds and writes before the first fault.
    await sleep(2 * ttlMs);
    const cycle = [
      killAndRestart,
      dropConnections,
      stallConnections,
      delayConnections,
      freezeClient,
      restartDatabase,
      holdRowLock,
    ];
    let cycles = 0;
    do {
      // The seed decides the order of the faults in each cycle.
      const order = [...cycle];
      for (let i = order.length - 1; i > 0; i--) {
        const j = rng.int(0, i);
        [order[i], order[j]] = [
          order[j] as (typeof order)[number],
          order[i] as (typeof order)[number],
        ];
      }
      for (const fault of order) {
        await fault();
        await sleep(rng.int(ttlMs / 2, 2 * ttlMs));
      }
      cycles += 1;
    } while (performance.now() - startedAt < budgetMs);
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
    const result = checkHistory(records, events);

    const counts: Record<string, number> = {};
    for (const w of workers)
      for (const [k, v] of Object.entries(w.counts)) counts[k] = (counts[k] ?? 0) + v;
    const grants = records.filter((r) => r.type === "grant").length;
    const writes = records.filter((r) => r.type === "write");
    const byInvariant: Record<string, number> = {};
    for (const v of result.violations)
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
      unseenGrants: result.unseenGrants,
      writesAccepted: writes.filter((w) => w.type === "write" && w.accepted === true).length,
      writesRefusedStale: writes.filter((w) => w.type === "write" && w.accepted === false).length,
      l2Checked: result.l2Checked,
      l2WithinLatency: result.l2WithinLatency,
      l2ExcusedPaused: result.l2Excused,
      faultsInjected: faults.length,
      faults,
      violations: result.violations.length,
      violationsByInvariant: byInvariant,
      counts,
    };
    await writeSummary(summary, result.violations);
    // The raw history, for reading a failure against lease_events.
    await writeFile(
      path.join(repoRoot, "test-results", "faults-history.jsonl"),
      [...records, ...events.map((e) => ({ ...e, type: `event:${e.type}` }))]
        .map((r) => JSON.stringify(r))
        .join("\n"),
    );

    expect(grants, "the clients were granted leases").toBeGreaterThan(0);
    expect(summary.writesAccepted, "the clients wrote to the guarded store").toBeGreaterThan(0);
    expect(result.violations).toEqual([]);
  });
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
  const faultRows = summary.faults.map((f) => `| ${f.fault} | ${f.detail} | ${f.expected} | ok |`);
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
