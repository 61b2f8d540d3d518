// Memory soak: does the lease server's memory level off under churn, or grow?
//
// Starts an embedded PostgreSQL and one `leasehold serve` process, then, for
// the whole duration, churns through the client library (src/client) the way
// long-lived deployments do: acquire/release cycles on fresh sessions,
// KeepAlive streams that end cleanly or whose connection is reset under them,
// Watch streams on accounts and sessions that are cancelled or cut, and
// waiting acquires that time out, are cancelled, or are woken by a release.
// Every few seconds it reads the server's RSS (/proc/PID/status) and V8 heap
// (the server's /metrics), and at the end prints the figures after warm-up,
// the slope of a linear fit over the second half, and a verdict.
//
//   npm run soak:memory -- [--minutes 30] [--help]
//
// Not part of `npm test`: it takes half an hour by default.

import { once } from "node:events";
import { mkdir, mkdtemp, readdir, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";
import {
  createLeaseClient,
  durationFromMs,
  type LeaseClient,
  type Protocol,
  type SessionKeyInit,
} from "../src/client/index.js";
import { type ServerProcess, spawnLeasehold } from "../test/support/server-process.js";
import { startTcpProxy, type TcpProxy } from "../test/support/tcp-proxy.js";
import { describeMachine, machineLine, packageVersions } from "./machine.js";
import { type BenchPostgres, startBenchPostgres } from "./postgres.js";
import { processRssMiB } from "./process-stats.js";
import { cleanupsOnSignal } from "./support/cleanups.js";
import { floors, type Point, type SeriesSummary, summarizeSeries } from "./support/memory-trend.js";

/** The verdict's thresholds, in MiB per 10 minutes of the second half's linear fit. */
// Heap in use saws by tens of MiB between collections, so the verdict reads its per-minute floor.
const floorWindowSeconds = 60;
const heapSlopeLimit = 2;
const rssSlopeLimit = 5;

const usage = `Usage: npm run soak:memory -- [flags]

Churns a lease server (its own process, on an embedded PostgreSQL) through the
client library and samples its memory; prints the figures after warm-up and a
verdict, and writes JSON to bench/results/soak-memory.json.

  --minutes N          how long to churn (default 30)
  --warmup-minutes N   samples before this are not judged (default 5, or a fifth
                       of --minutes when that is shorter; at most half the run)
  --sample-seconds N   time between memory samples (default 3)
  --cycles N           concurrent acquire→release loops (default 4)
  --keepalives N       concurrent KeepAlive churn loops (default 4; every second one cuts connections)
  --watchers N         concurrent Watch churn loops (default 6)
  --waiters N          concurrent waiting-acquire loops (default 3)
  --heap-snapshots     write a V8 heap snapshot of the server at the end of warm-up
                       and at the end of the run (each pauses the server for seconds)
  --out FILE           where to write the JSON (default bench/results/soak-memory.json)
  --help               print this and exit

Verdict: "bounded plateau" when, over the second half of the run, the linear
fit of the heap floor (the lowest heap in use of each minute: what garbage
collection could not free) rises by less than ${heapSlopeLimit} MiB per 10 minutes and that
of the RSS by less than ${rssSlopeLimit} MiB per 10 minutes; "growing" otherwise.
`;

const resultsDir = new URL("results/", import.meta.url);
/** How long the churn loops get to finish their iteration once the run is over. */
const loopStopGraceMs = 20_000;

interface Options {
  minutes: number;
  warmupMinutes: number;
  sampleSeconds: number;
  cycles: number;
  keepalives: number;
  watchers: number;
  waiters: number;
  heapSnapshots: boolean;
  out: string;
}

function readOptions(): Options | undefined {
  const { values } = parseArgs({
    options: {
      minutes: { type: "string", default: "30" },
      "warmup-minutes": { type: "string" },
      "sample-seconds": { type: "string", default: "3" },
      cycles: { type: "string", default: "4" },
      keepalives: { type: "string", default: "4" },
      watchers: { type: "string", default: "6" },
      waiters: { type: "string", default: "3" },
      "heap-snapshots": { type: "boolean", default: false },
      out: { type: "string" },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help) return undefined;
  const positive = (name: string, text: string, integer: boolean) => {
    const n = Number(text);
    if (!Number.isFinite(n) || n <= 0 || (integer && !Number.isInteger(n))) {
      throw new Error(`--${name} must be a positive ${integer ? "integer" : "number"}`);
    }
    return n;
  };
  const minutes = positive("minutes", values.minutes, false);
  const warmupMinutes =
    values["warmup-minutes"] === undefined
      ? Math.min(5, minutes / 5)
      : positive("warmup-minutes", values["warmup-minutes"], false);
  if (warmupMinutes > minutes / 2) {
    throw new Error("--warmup-minutes must be at most half of --minutes");
  }
  return {
    minutes,
    warmupMinutes,
    sampleSeconds: positive("sample-seconds", values["sample-seconds"], false),
    cycles: positive("cycles", values.cycles, true),
    keepalives: positive("keepalives", values.keepalives, true),
    watchers: positive("watchers", values.watchers, true),
    waiters: positive("waiters", values.waiters, true),
    heapSnapshots: values["heap-snapshots"],
    out: values.out ?? new URL("soak-memory.json", resultsDir).pathname,
  };
}

const sleep = (ms: number, signal?: AbortSignal) =>
  new Promise<void>((resolve) => {
    if (signal?.aborted) return resolve();
    const timer = setTimeout(done, ms);
    function done() {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });

const between = (lo: number, hi: number) => lo + Math.random() * (hi - lo);

/** What each churn loop did, and what went wrong that the churn did not ask for. */
class Tally {
  readonly counts = new Map<string, number>();
  readonly unexpected = new Map<string, { count: number; example: string }>();

  add(what: string, n = 1): void {
    this.counts.set(what, (this.counts.get(what) ?? 0) + n);
  }

  error(where: string, error: unknown): void {
    const name = error instanceof Error ? error.constructor.name : typeof error;
    const key = `${where}: ${name}`;
    const entry = this.unexpected.get(key) ?? {
      count: 0,
      example: error instanceof Error ? error.message.slice(0, 300) : String(error),
    };
    entry.count += 1;
    this.unexpected.set(key, entry);
  }

  unexpectedTotal(): number {
    let n = 0;
    for (const e of this.unexpected.values()) n += e.count;
    return n;
  }
}

interface Churn {
  serverUrl: string;
  stop: AbortSignal;
  tally: Tally;
  /** Wait loops, each with a session of its own: `w-0` … */
  waitLoops: number;
  /** A session id never used before, so that state kept per session would show up as growth. */
  freshSession(): string;
}

/**
 * Most churn stays on a bounded set of keys (as real accounts reuse their
 * sessions): the database reaches a steady state after warm-up (every key
 * has its row or tombstone), so what the server keeps should level off too.
 * One cycle loop takes fresh sessions instead, in an account no one watches
 * as a whole, so that state kept per session shows up as growth.
 */
const cycleAccounts = 8;
const sessionsPerCycleAccount = 512;
const freshAccount = "soak-fresh";
const cycleAccount = (n: number) => `soak-c${n % cycleAccounts}`;

/** Alternates the wire protocol, so both of the server's stream paths (gRPC and Connect) are churned. */
const protocolOf = (i: number): Protocol => (i % 2 === 0 ? "grpc" : "connect");

function clientFor(baseUrl: string, protocol: Protocol): LeaseClient {
  return createLeaseClient({
    baseUrl,
    protocol,
    defaultTimeoutMs: 5_000,
    reconnectBackoff: { initialMs: 50, maxMs: 200 },
  });
}

/**
 * Acquire → release with a fresh run id each time; one long-lived client per
 * loop. Loop 0 takes fresh sessions, the others random keys of the cycle
 * accounts (a key held by another loop at that moment is "not acquired").
 */
async function cycleLoop(churn: Churn, worker: number): Promise<void> {
  const client = clientFor(churn.serverUrl, protocolOf(worker));
  try {
    while (!churn.stop.aborted) {
      const key =
        worker === 0
          ? { accountId: freshAccount, sessionId: churn.freshSession() }
          : {
              accountId: cycleAccount(Math.floor(Math.random() * cycleAccounts)),
              sessionId: `s-${Math.floor(Math.random() * sessionsPerCycleAccount)}`,
            };
      try {
        const res = await client.acquire({ key, ttl: durationFromMs(30_000), holder: "soak" });
        if (!res.acquired) {
          churn.tally.add("cycle not acquired");
          continue;
        }
        await client.release({ key, runId: res.lease?.runId ?? "" });
        churn.tally.add("acquire→release cycles");
      } catch (error) {
        churn.tally.error("cycle", error);
        await sleep(100);
      }
    }
  } finally {
    client.close();
  }
}

/**
 * KeepAlive churn, each iteration on a client (and so a connection) of its
 * own. Clean: runExclusive holds a lease over the client's KeepAlive stream
 * for a few renewals and releases it, or a raw KeepAlive stream whose
 * requests end (a half-close the server answers by ending the stream). Cut:
 * the connection is reset under a runExclusive lease (through a TCP proxy),
 * so the server sees the stream die and the lease run out its TTL.
 */
async function keepAliveLoop(churn: Churn, worker: number): Promise<void> {
  for (let i = 0; !churn.stop.aborted; i++) {
    const protocol = protocolOf(worker + i);
    const kind = worker % 2 === 1 ? "cut" : i % 2 === 0 ? "runExclusive" : "raw";
    let proxy: TcpProxy | undefined;
    let client: LeaseClient | undefined;
    try {
      proxy = kind === "cut" ? await startTcpProxy(churn.serverUrl) : undefined;
      client = clientFor(proxy?.url ?? churn.serverUrl, protocol);
      // The loop's own keys, reused after 64 iterations: long after a cut lease's TTL ran out.
      const key = { accountId: "soak-keepalive", sessionId: `k${worker}-${i % 64}` };
      if (kind === "runExclusive") {
        await client.runExclusive(key, (ctx) => sleep(between(1_500, 3_500), ctx.signal), {
          ttlMs: 2_000,
        });
        churn.tally.add("KeepAlive via runExclusive, released");
      } else if (kind === "raw") {
        await rawKeepAlive(client, key);
        churn.tally.add("KeepAlive raw stream, half-closed");
      } else {
        const p = proxy as TcpProxy;
        const outcome = await client
          .runExclusive(
            key,
            async (ctx) => {
              const first = ctx.lease;
              // Cut after a confirmed renewal, so the stream is well under way.
              while (ctx.lease === first && !ctx.signal.aborted) await sleep(20);
              p.drop();
              // The signal may have aborted already (a renewal lost before the cut): once() would wait forever.
              if (!ctx.signal.aborted) await once(ctx.signal, "abort");
              return "cut";
            },
            { ttlMs: 1_500 },
          )
          .catch((error: unknown) => (error instanceof Error ? error.constructor.name : "error"));
        churn.tally.add(`KeepAlive cut by connection reset (${outcome})`);
      }
    } catch (error) {
      churn.tally.error(`keepalive ${kind}`, error);
      await sleep(100);
    } finally {
      client?.close();
      await proxy?.close();
    }
  }
}

/** Acquire, renew a few times over a raw KeepAlive stream, end the requests, release. */
async function rawKeepAlive(client: LeaseClient, key: SessionKeyInit): Promise<void> {
  const res = await client.acquire({ key, ttl: durationFromMs(2_000) });
  if (!res.acquired || !res.lease) throw new Error("raw KeepAlive: fresh session not acquired");
  const runId = res.lease.runId;
  const renewals = 3;
  async function* requests() {
    for (let i = 0; i < renewals; i++) {
      yield { key, runId, ttl: durationFromMs(2_000) };
      await sleep(400);
    }
  }
  let answers = 0;
  for await (const answer of client.keepAlive(requests(), { timeoutMs: 10_000 })) {
    if (answer.result.case !== "lease") throw new Error(`raw KeepAlive: ${answer.result.case}`);
    answers += 1;
  }
  if (answers !== renewals) throw new Error(`raw KeepAlive: ${answers} of ${renewals} answers`);
  await client.release({ key, runId });
}

const watchedAccounts = [
  ...Array.from({ length: cycleAccounts }, (_, i) => cycleAccount(i)),
  "soak-keepalive",
  "soak-waits",
];

/**
 * Watch churn: streams on a whole account or on one session, kept open for
 * a second or a few, then cancelled (three in four, on the loop's shared
 * connection) or cut with their connection (through a TCP proxy).
 */
async function watchLoop(churn: Churn, worker: number): Promise<void> {
  const shared = clientFor(churn.serverUrl, protocolOf(worker));
  try {
    for (let i = 0; !churn.stop.aborted; i++) {
      const cut = i % 4 === 3;
      const accountId = watchedAccounts[(worker + i) % watchedAccounts.length] as string;
      // Waiters hold their session for seconds, KeepAlive loops for a few renewals;
      // a cycle account's session changes hands a few times a minute.
      const sessionId =
        i % 2 === 0
          ? ""
          : accountId === "soak-waits"
            ? `w-${i % churn.waitLoops}`
            : accountId === "soak-keepalive"
              ? `k${i % 4}-${i % 64}`
              : `s-${i % sessionsPerCycleAccount}`;
      let proxy: TcpProxy | undefined;
      let client = shared;
      const cancel = new AbortController();
      try {
        if (cut) {
          proxy = await startTcpProxy(churn.serverUrl);
          client = clientFor(proxy.url, protocolOf(worker + i));
        }
        const stream = client.watch(
          { key: { accountId, sessionId }, includeRenewals: i % 3 === 0 },
          { signal: cancel.signal },
        );
        const ends = sleep(between(1_000, 4_000), churn.stop).then(() =>
          cut ? proxy?.drop() : cancel.abort(),
        );
        let messages = 0;
        try {
          for await (const _ of stream) messages += 1;
        } catch {
          // The end this loop asked for: a cancel or a reset connection.
        }
        await ends;
        if (messages === 0) throw new Error("watch ended without its snapshot");
        churn.tally.add(cut ? "Watch cut by connection reset" : "Watch cancelled");
        churn.tally.add("Watch messages received", messages);
      } catch (error) {
        churn.tally.error(`watch ${cut ? "cut" : "cancelled"}`, error);
        await sleep(100);
      } finally {
        if (client !== shared) client.close();
        await proxy?.close();
      }
    }
  } finally {
    shared.close();
  }
}

/**
 * One account-wide Watch on a cycle account for the whole run, as a
 * dashboard would keep open: what it keeps per key must stay bounded too.
 */
async function longWatch(churn: Churn): Promise<void> {
  const client = clientFor(churn.serverUrl, "grpc");
  try {
    while (!churn.stop.aborted) {
      try {
        const stream = client.watch(
          { key: { accountId: cycleAccount(0), sessionId: "" } },
          { signal: churn.stop },
        );
        for await (const _ of stream) churn.tally.add("long-lived Watch messages");
      } catch (error) {
        if (!churn.stop.aborted) {
          churn.tally.error("long-lived watch", error);
          await sleep(100);
        }
      }
    }
  } finally {
    client.close();
  }
}

/**
 * Waiting acquires on a held session: some time out on the server (wait
 * runs out), one is cancelled by the caller, one is woken by the holder's
 * release and granted.
 */
async function waitLoop(churn: Churn, worker: number): Promise<void> {
  const client = clientFor(churn.serverUrl, protocolOf(worker));
  const key = { accountId: "soak-waits", sessionId: `w-${worker}` };
  try {
    while (!churn.stop.aborted) {
      try {
        const holder = await client.acquire({ key, ttl: durationFromMs(60_000), holder: "holder" });
        if (!holder.acquired || !holder.lease)
          throw new Error("the wait loop's own session was held");
        for (let i = 0; i < 4 && !churn.stop.aborted; i++) {
          const res = await client.acquire({
            key,
            ttl: durationFromMs(5_000),
            wait: durationFromMs(between(300, 1_200)),
          });
          if (res.acquired) throw new Error("a waiting acquire was granted a held session");
          churn.tally.add("waiting acquire timed out");
        }
        const cancel = new AbortController();
        setTimeout(() => cancel.abort(), between(100, 400));
        await client
          .acquire(
            { key, ttl: durationFromMs(5_000), wait: durationFromMs(5_000) },
            { signal: cancel.signal },
          )
          .then(
            () => churn.tally.error("wait cancel", new Error("a cancelled wait was answered")),
            () => churn.tally.add("waiting acquire cancelled"),
          );
        const woken = client.acquire({
          key,
          ttl: durationFromMs(5_000),
          wait: durationFromMs(5_000),
        });
        await sleep(between(50, 300));
        await client.release({ key, runId: holder.lease.runId });
        const granted = await woken;
        if (!granted.acquired || !granted.lease)
          throw new Error("a release did not wake the waiter");
        churn.tally.add("waiting acquire woken by release");
        await client.release({ key, runId: granted.lease.runId });
      } catch (error) {
        churn.tally.error("wait", error);
        await sleep(100);
      }
    }
  } finally {
    client.close();
  }
}

interface Sample {
  /** Seconds since the churn started. */
  t: number;
  rssMiB: number;
  heapUsedMiB: number;
  heapTotalMiB: number;
  oldSpaceUsedMiB: number;
  externalMiB: number;
  activeHandles: number;
}

const metricNames = {
  heapUsed: "leasehold_nodejs_heap_size_used_bytes",
  heapTotal: "leasehold_nodejs_heap_size_total_bytes",
  external: "leasehold_nodejs_external_memory_bytes",
  oldSpace: 'leasehold_nodejs_heap_space_size_used_bytes{space="old"}',
};

/** Active handles of every type: the sum of the gauge's series (one per handle type). */
const handlesSeries = "leasehold_nodejs_active_handles{";

function activeHandles(m: Map<string, number>): number {
  let sum = 0;
  let seen = false;
  for (const [series, v] of m) {
    if (!series.startsWith(handlesSeries)) continue;
    sum += v;
    seen = true;
  }
  return seen ? sum : Number.NaN;
}

/** The server's own view of its heap, from prom-client's default metrics on /metrics. */
async function readServerMetrics(serverUrl: string): Promise<Map<string, number>> {
  const res = await fetch(new URL("/metrics", serverUrl), { signal: AbortSignal.timeout(10_000) });
  if (!res.ok) throw new Error(`/metrics answered ${res.status}`);
  const out = new Map<string, number>();
  for (const line of (await res.text()).split("\n")) {
    if (line.startsWith("#") || line === "") continue;
    const space = line.lastIndexOf(" ");
    out.set(line.slice(0, space), Number(line.slice(space + 1)));
  }
  return out;
}

const mib = (bytes: number | undefined) =>
  bytes === undefined ? Number.NaN : Math.round((bytes / 1048576) * 100) / 100;

/** Sends SIGUSR2 (the server runs with --heapsnapshot-signal) and waits for the file to be written. */
async function takeHeapSnapshot(server: ServerProcess, dir: string): Promise<string> {
  const before = new Set(await readdir(dir));
  server.child.kill("SIGUSR2");
  for (let waited = 0; waited < 300_000; waited += 500) {
    await sleep(500);
    const fresh = (await readdir(dir)).find((f) => !before.has(f) && f.endsWith(".heapsnapshot"));
    // Node writes the snapshot synchronously on its main thread: once /metrics answers, it is done.
    if (
      fresh &&
      (await readServerMetrics(server.url).then(
        () => true,
        () => false,
      ))
    ) {
      return path.join(dir, fresh);
    }
  }
  throw new Error("no heap snapshot appeared within 5 minutes");
}

function formatSeries(name: string, s: SeriesSummary): string {
  return (
    `${name.padEnd(16)} start ${s.start.toFixed(1)}  end ${s.end.toFixed(1)}  ` +
    `min ${s.min.toFixed(1)}  max ${s.max.toFixed(1)} MiB;  ` +
    `slope ${s.measuredSlopePer10Min.toFixed(2)} MiB/10 min after warm-up, ` +
    `${s.secondHalfSlopePer10Min.toFixed(2)} MiB/10 min over the second half (R² ${s.secondHalfR2.toFixed(2)})`
  );
}

async function main(): Promise<number> {
  const options = readOptions();
  if (!options) {
    process.stdout.write(usage);
    return 0;
  }
  const log = (line: string) => process.stderr.write(`${line}\n`);
  const machine = describeMachine();
  log(`machine: ${machineLine(machine)}`);

  const cleanups = cleanupsOnSignal(log, "the server and PostgreSQL");

  try {
    const postgres: BenchPostgres = await startBenchPostgres({ migrate: true });
    cleanups.push(() => postgres.stop());
    log(`postgres: ${postgres.version.split(" on ")[0]}`);
    const snapshotDir = await mkdtemp(path.join(os.tmpdir(), "leasehold-soak-heap-"));
    const serverArgs = ["--listen", "127.0.0.1:0", "--shutdown-grace", "2s"];
    // The signal lets anyone take a snapshot of the running server (kill -USR2 PID), not only --heap-snapshots.
    const nodeArgs = ["--heapsnapshot-signal=SIGUSR2", `--diagnostic-dir=${snapshotDir}`];
    const server = await spawnLeasehold({
      argv: ["serve", "--database-url", postgres.url, ...serverArgs],
      nodeArgs,
    });
    cleanups.push(() => server.stop());
    const pid = server.child.pid ?? 0;
    let serverExit: string | undefined;
    server.child.once("exit", (code, signal) => {
      serverExit = `server exited (code ${code}, signal ${signal})`;
    });
    log(`server: ${server.url} (pid ${pid}), node ${nodeArgs.join(" ")}`);
    log(
      `churn: ${options.minutes} min, warm-up ${options.warmupMinutes} min, a sample every ${options.sampleSeconds} s; ` +
        `${options.cycles} cycle loops, ${options.keepalives} KeepAlive loops, ${options.watchers} Watch loops, ${options.waiters} wait loops, 1 long-lived Watch`,
    );

    const stop = new AbortController();
    const tally = new Tally();
    let freshSessions = 0;
    const churn: Churn = {
      serverUrl: server.url,
      stop: stop.signal,
      tally,
      waitLoops: options.waiters,
      freshSession: () => `f-${(freshSessions++).toString(36)}`,
    };

    const durationSeconds = options.minutes * 60;
    const warmupSeconds = options.warmupMinutes * 60;
    const started = performance.now();
    const elapsed = () => (performance.now() - started) / 1000;
    const samples: Sample[] = [];
    const snapshots: { at: string; file: string }[] = [];

    const loops = [
      ...Array.from({ length: options.cycles }, (_, i) => cycleLoop(churn, i)),
      ...Array.from({ length: options.keepalives }, (_, i) => keepAliveLoop(churn, i)),
      ...Array.from({ length: options.watchers }, (_, i) => watchLoop(churn, i)),
      ...Array.from({ length: options.waiters }, (_, i) => waitLoop(churn, i)),
      longWatch(churn),
    ];

    let lastProgress = 0;
    let warmupSnapshotTaken = false;
    while (elapsed() < durationSeconds && serverExit === undefined) {
      const t = elapsed();
      try {
        const m = await readServerMetrics(server.url);
        samples.push({
          t: Math.round(t * 10) / 10,
          rssMiB: processRssMiB(pid),
          heapUsedMiB: mib(m.get(metricNames.heapUsed)),
          heapTotalMiB: mib(m.get(metricNames.heapTotal)),
          oldSpaceUsedMiB: mib(m.get(metricNames.oldSpace)),
          externalMiB: mib(m.get(metricNames.external)),
          activeHandles: activeHandles(m),
        });
      } catch (error) {
        tally.error("sample", error);
      }
      if (t - lastProgress >= 60) {
        lastProgress = t;
        const s = samples.at(-1);
        log(
          `[${(t / 60).toFixed(1)} min] rss ${s?.rssMiB} MiB, heap ${s?.heapUsedMiB} MiB used of ${s?.heapTotalMiB}, ` +
            `handles ${s?.activeHandles}; cycles ${tally.counts.get("acquire→release cycles") ?? 0}, ` +
            `unexpected errors ${tally.unexpectedTotal()}`,
        );
      }
      if (options.heapSnapshots && !warmupSnapshotTaken && t >= warmupSeconds) {
        warmupSnapshotTaken = true;
        const file = await takeHeapSnapshot(server, snapshotDir);
        snapshots.push({ at: "end of warm-up", file });
        log(`heap snapshot (end of warm-up): ${file}`);
      }
      await sleep(Math.max(0, options.sampleSeconds * 1000 - (elapsed() - t) * 1000));
    }
    stop.abort();
    if (options.heapSnapshots && serverExit === undefined) {
      const file = await takeHeapSnapshot(server, snapshotDir);
      snapshots.push({ at: "end of run", file });
      log(`heap snapshot (end of run): ${file}`);
    }
    // A loop stuck on a call must not cost the figures: they are reported whatever the loops do.
    const settled = await Promise.race([
      Promise.all(loops).then(() => true),
      sleep(loopStopGraceMs).then(() => false),
    ]);
    if (!settled)
      tally.error("stop", new Error(`churn loops still busy ${loopStopGraceMs} ms after the stop`));
    const ranSeconds = Math.round(elapsed());

    const secondHalfFrom = durationSeconds / 2;
    const series = (pick: (s: Sample) => number): Point[] =>
      samples.map((s) => ({ t: s.t, v: pick(s) })).filter((p) => Number.isFinite(p.v));
    const figures = {
      rss: summarizeSeries(
        series((s) => s.rssMiB),
        warmupSeconds,
        secondHalfFrom,
      ),
      heapUsed: summarizeSeries(
        series((s) => s.heapUsedMiB),
        warmupSeconds,
        secondHalfFrom,
      ),
      heapFloor: summarizeSeries(
        floors(
          series((s) => s.heapUsedMiB),
          0,
          floorWindowSeconds,
        ),
        warmupSeconds,
        secondHalfFrom,
      ),
      heapTotal: summarizeSeries(
        series((s) => s.heapTotalMiB),
        warmupSeconds,
        secondHalfFrom,
      ),
      oldSpaceUsed: summarizeSeries(
        series((s) => s.oldSpaceUsedMiB),
        warmupSeconds,
        secondHalfFrom,
      ),
      external: summarizeSeries(
        series((s) => s.externalMiB),
        warmupSeconds,
        secondHalfFrom,
      ),
      activeHandles: summarizeSeries(
        series((s) => s.activeHandles),
        warmupSeconds,
        secondHalfFrom,
      ),
    };
    const bounded =
      serverExit === undefined &&
      figures.heapFloor.secondHalfSlopePer10Min < heapSlopeLimit &&
      figures.rss.secondHalfSlopePer10Min < rssSlopeLimit;
    const verdict =
      serverExit !== undefined ? "server died" : bounded ? "bounded plateau" : "growing";
    const rule =
      `bounded plateau when the second half's linear fit rises by less than ${heapSlopeLimit} MiB/10 min ` +
      `for the heap floor (lowest heap in use of each ${floorWindowSeconds} s) and less than ` +
      `${rssSlopeLimit} MiB/10 min for the RSS; growing otherwise`;

    const out: string[] = [];
    out.push(`Leasehold memory soak — ${machineLine(machine)}`);
    out.push(
      `setup: 1 server process (${serverArgs.join(" ")}), embedded ${postgres.version.split(" on ")[0]}; ` +
        `${ranSeconds} s of churn, warm-up ${warmupSeconds} s, second half from ${secondHalfFrom} s, ` +
        `${samples.length} samples every ${options.sampleSeconds} s; loops: ${options.cycles} cycle, ` +
        `${options.keepalives} KeepAlive, ${options.watchers} Watch, ${options.waiters} wait`,
    );
    out.push("churn:");
    for (const [what, n] of [...tally.counts].sort()) {
      out.push(`  ${what}: ${n.toLocaleString("en-US")}`);
    }
    out.push(
      `unexpected errors: ${tally.unexpectedTotal()}${[...tally.unexpected]
        .map(([k, e]) => `\n  ${k} ×${e.count} (${e.example})`)
        .join("")}`,
    );
    out.push("server memory after warm-up:");
    out.push(`  ${formatSeries("RSS", figures.rss)}`);
    out.push(`  ${formatSeries("heap used", figures.heapUsed)}`);
    out.push(`  ${formatSeries("heap floor/min", figures.heapFloor)}`);
    out.push(`  ${formatSeries("heap total", figures.heapTotal)}`);
    out.push(`  ${formatSeries("old space used", figures.oldSpaceUsed)}`);
    out.push(`  ${formatSeries("external", figures.external)}`);
    const h = figures.activeHandles;
    out.push(
      `  active handles   start ${h.start}  end ${h.end}  min ${h.min}  max ${h.max}; ` +
        `slope ${h.secondHalfSlopePer10Min} per 10 min over the second half`,
    );
    for (const s of snapshots) out.push(`heap snapshot, ${s.at}: ${s.file}`);
    if (serverExit) out.push(serverExit);
    out.push(`verdict: ${verdict} (${rule})`);
    process.stdout.write(`${out.join("\n")}\n`);

    const results = {
      generatedAt: new Date().toISOString(),
      command: `npm run soak:memory -- ${process.argv.slice(2).join(" ")}`.trim(),
      machine: { ...machine, loadAverageAtEnd: Math.round((os.loadavg()[0] ?? 0) * 100) / 100 },
      versions: { ...packageVersions(), postgresql: postgres.version },
      settings: { ...options, serverArgs, nodeArgs, durationSeconds: ranSeconds },
      churn: Object.fromEntries(tally.counts),
      unexpectedErrors: Object.fromEntries(tally.unexpected),
      figures,
      verdict,
      rule,
      serverExit,
      snapshots,
      samples,
    };
    await mkdir(path.dirname(options.out), { recursive: true });
    await writeFile(options.out, `${JSON.stringify(results, null, 2)}\n`);
    process.stdout.write(`wrote ${options.out}\n`);
    return verdict === "server died" ? 1 : 0;
  } finally {
    await cleanups.run();
  }
}

main().then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(
      `\nsoak: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`,
    );
    process.exit(1);
  },
);
