// KeepAlive scenario: N leases with TTL 15 s, each renewed every 5 s over M
// multiplexed KeepAlive streams, against a Leasehold server running as its own
// process on an embedded PostgreSQL. Reports setup time, renewals per second,
// the renewal round trip (p50/p99, measured from send to answer on the
// client), database statements per second (pg_stat_statements), server CPU
// and memory. Then acquire throughput with the notification path on and off.
// With --inflight K it saturates instead: each stream keeps K renewals in
// flight, sending its next lease as each answer arrives.
//
//   npx tsx bench/keepalive.ts [--leases N] [--streams M] [--inflight K] [--measure 30s]
//     [--acquire-seconds 10] [--acquire-rounds 3] [--quick] [--json]
//
// `run(options)` is the same scenario for the benchmark harness.

import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { type Client, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import {
  EventType,
  type KeepAliveRequestSchema,
  LeaseService,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { parseDuration } from "../src/lease/limits.js";
import { machineBusySeconds } from "./process-stats.js";
import { createRenewalTally } from "./renewal-tally.js";
import { describeWaits, type StatementWaits, sampleRenewalWaits } from "./statement-waits.js";
import {
  type BenchDatabase,
  cpuSeconds,
  quantile,
  rssBytes,
  spawnLeasehold,
  startBenchDatabase,
  treeCpuSeconds,
} from "./support/environment.js";

export interface KeepAliveBenchOptions {
  leases: number;
  streams: number;
  ttlMs: number;
  renewEveryMs: number;
  /**
   * Saturation: renewals each stream keeps in flight, every answer sending
   * the stream's next lease at once (a closed loop: as fast as the server
   * answers). 0 renews each lease every renewEveryMs.
   */
  inflightPerStream: number;
  /** Length of the measured window, after one full renewal period of warm-up. */
  measureMs: number;
  /** Seconds per acquire-throughput phase (acquire+release pairs; off, on, watched); 0 skips it. */
  acquireSeconds: number;
  /** Concurrent acquires in the throughput phases. */
  acquireConcurrency: number;
  /** How many times each acquire mode runs (alternating); the median is reported. */
  acquireRounds: number;
  /** Another checkout's bin/leasehold.js to serve (to compare builds); default this one. */
  serverCli?: string;
  log: (line: string) => void;
}

export interface KeepAliveBenchResult {
  leases: number;
  streams: number;
  setup: { seconds: number; acquiresPerSecond: number };
  renewals: {
    perSecond: number;
    p50Ms: number;
    p99Ms: number;
    maxMs: number;
    lost: number;
    unanswered: number;
  };
  database: {
    statementsPerSecond: number;
    renewalStatementsPerSecond: number;
    /** Mean execution time of a renewal statement in PostgreSQL (pg_stat_statements; no commit). */
    renewalStatementMeanMs: number;
    /** WAL flushes per second, and their mean duration (NaN where the server does not report them). */
    walSyncsPerSecond: number;
    walSyncMeanMs: number;
    commitsPerSecond: number;
    cpuCores: number;
    /** The renewal statements as sampled in pg_stat_activity during the window. */
    renewalWaits: StatementWaits;
  };
  server: { cpuCores: number; rssMiB: number };
  loadGeneratorCpuCores: number;
  /** The machine's busy cores in the window, less the server, PostgreSQL and this process: the noise. */
  otherCpuCores: number;
  /** The measured window on the monotonic clock in µs, as CPU profiles stamp it. */
  windowMicros: [number, number];
  acquire?: {
    notificationsOffPerSecond: number;
    /** Published, and received by no other instance. */
    notificationsOnPerSecond: number;
    /** Published, and received and fanned out by a second instance on the same machine. */
    notificationsOnWatchedPerSecond: number;
    /** Share of the acquires of the "watched" phases that the watcher on the second instance saw. */
    deliveredToWatcher: number;
    /** Median CPU microseconds of the acquiring server per acquire+release pair, by mode. */
    serverCpuUsPerAcquire: Record<"off" | "on" | "watched", number>;
    /** Median CPU microseconds of PostgreSQL (all backends) per pair, by mode. */
    postgresCpuUsPerAcquire: Record<"off" | "on" | "watched", number>;
    /** Every phase's rate, by mode, in run order. */
    phases: Record<"off" | "on" | "watched", number[]>;
  };
}

const defaults: KeepAliveBenchOptions = {
  leases: 10_000,
  streams: 100,
  ttlMs: 15_000,
  renewEveryMs: 5_000,
  inflightPerStream: 0,
  measureMs: 30_000,
  acquireSeconds: 10,
  acquireConcurrency: 32,
  acquireRounds: 3,
  log: (line) => process.stderr.write(`${line}\n`),
};

type LeaseClient = Client<typeof LeaseService>;
type KeepAliveInit = MessageInitShape<typeof KeepAliveRequestSchema>;

const duration = (ms: number) =>
  create(DurationSchema, { seconds: BigInt(Math.floor(ms / 1000)), nanos: (ms % 1000) * 1e6 });

/** An async iterable of requests the generator pushes into. */
class RequestQueue implements AsyncIterable<KeepAliveInit> {
  private queue: KeepAliveInit[] = [];
  private wake: (() => void) | undefined;
  private ended = false;
  push(r: KeepAliveInit) {
    this.queue.push(r);
    this.wake?.();
  }
  end() {
    this.ended = true;
    this.wake?.();
  }
  async *[Symbol.asyncIterator]() {
    for (;;) {
      if (this.queue.length > 0) {
        const batch = this.queue;
        this.queue = [];
        yield* batch;
        continue;
      }
      if (this.ended) return;
      await new Promise<void>((r) => {
        this.wake = r;
      });
      this.wake = undefined;
    }
  }
}

function clients(url: string, count: number): LeaseClient[] {
  // One transport is one HTTP/2 connection; spread streams over a few.
  return Array.from({ length: count }, () =>
    createClient(LeaseService, createGrpcTransport({ baseUrl: url })),
  );
}

async function pool<T>(items: number, concurrency: number, work: (i: number) => Promise<T>) {
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.min(concurrency, items) }, async () => {
      while (next < items) await work(next++);
    }),
  );
}

async function statementCounts(db: BenchDatabase) {
  const [row] = await db.sql<
    { all: string; renewals: string; renewal_ms: number; commits: string; wal: unknown }[]
  >`
    SELECT
      (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s
        WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database()))::text AS all,
      (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s
        WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND s.query LIKE '%lookup_handoff)%')::text AS renewals,
      (SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements s
        WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND s.query LIKE '%lookup_handoff)%')::float8 AS renewal_ms,
      (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())::text AS commits,
      -- WAL flushes and the time they took (track_wal_io_timing): where a
      -- commit's wait goes. As JSON: the columns differ between versions.
      (SELECT to_jsonb(w) FROM pg_stat_wal w) AS wal`;
  const wal = (row?.wal ?? {}) as { wal_sync?: number | string; wal_sync_time?: number | string };
  return {
    all: Number(row?.all ?? 0),
    renewals: Number(row?.renewals ?? 0),
    renewalMs: Number(row?.renewal_ms ?? 0),
    commits: Number(row?.commits ?? 0),
    walSyncs: Number(wal.wal_sync ?? Number.NaN),
    walSyncMs: Number(wal.wal_sync_time ?? Number.NaN),
  };
}

/** The KeepAlive scenario; see the top of this file. */
export async function run(
  partial: Partial<KeepAliveBenchOptions> = {},
): Promise<KeepAliveBenchResult> {
  const o: KeepAliveBenchOptions = { ...defaults, ...partial };
  const { log } = o;
  log(
    `KeepAlive: ${o.leases} leases, TTL ${o.ttlMs / 1000}s, renewed every ${o.renewEveryMs / 1000}s over ${o.streams} streams`,
  );
  const db = await startBenchDatabase();
  // All leases are in one account: lift the per-account quota (10,000 by
  // default), which is not what this scenario measures.
  const server = await spawnLeasehold(
    db.url,
    ["--pool-size", "20", "--max-leases-per-account", "0"],
    o.serverCli,
  );
  try {
    const conns = clients(server.url, Math.max(1, Math.ceil(o.streams / 25)));
    const accountId = "bench";

    // Setup: acquire every lease with a TTL that outlasts the setup on a
    // slow machine (50,000 acquires can take over two minutes); the first
    // renewal sets the scenario's TTL.
    const runIds: string[] = new Array(o.leases);
    const setupStart = performance.now();
    await pool(o.leases, 64, async (i) => {
      const a = await (conns[i % conns.length] as LeaseClient).acquire({
        key: { accountId, sessionId: `s${i}` },
        ttl: duration(Math.max(900_000, o.ttlMs)),
        holder: "bench",
      });
      if (!a.acquired || !a.lease) throw new Error(`setup could not acquire s${i}`);
      runIds[i] = a.lease.runId;
    });
    const setupSeconds = (performance.now() - setupStart) / 1000;
    log(
      `setup: ${o.leases} acquires in ${setupSeconds.toFixed(1)}s (${Math.round(o.leases / setupSeconds)}/s)`,
    );

    // Streams: lease i rides stream i % M and renews at its own phase.
    const sentAt = new Float64Array(o.leases);
    const tally = createRenewalTally(o.leases);
    const indexOf = new Map(runIds.map((r, i) => [r, i]));
    let measuring = false;
    let rtts = new Float64Array(1 << 16);
    let samples = 0;
    let lost = 0;
    let sent = 0;
    let stopping = false;
    const queues = Array.from({ length: o.streams }, () => new RequestQueue());
    const requests = runIds.map((runId, i) => ({
      key: { accountId, sessionId: `s${i}` },
      runId,
      ttl: duration(o.ttlMs),
    }));
    const send = (i: number) => {
      sentAt[i] = performance.now();
      (queues[i % o.streams] as RequestQueue).push(requests[i] as KeepAliveInit);
      if (measuring) sent++;
      tally.sent(i, measuring);
    };
    // Saturation: stream s cycles through its own leases s, s + M, s + 2M, …
    const perStream = Math.ceil(o.leases / o.streams);
    const cursor = new Uint32Array(o.streams);
    const sendNext = (s: number) => {
      for (let tries = 0; tries < perStream; tries++) {
        const c = cursor[s] ?? 0;
        cursor[s] = c + 1;
        const i = s + o.streams * (c % perStream);
        if (i < o.leases) return send(i);
      }
    };
    const readers = queues.map(async (queue, s) => {
      const client = conns[s % conns.length] as LeaseClient;
      for await (const answer of client.keepAlive(queue)) {
        const i = indexOf.get(answer.runId);
        if (i === undefined) continue;
        if (answer.result.case === "lost") {
          // Answered, though not renewed: counted as lost, not unanswered.
          lost++;
          tally.answered(i);
          continue;
        }
        if (answer.result.case !== "lease") continue;
        // Only renewals sent inside the window count, answered when they may.
        if (tally.answered(i)) {
          if (samples === rtts.length) {
            const bigger = new Float64Array(rtts.length * 2);
            bigger.set(rtts);
            rtts = bigger;
          }
          rtts[samples++] = performance.now() - (sentAt[i] ?? 0);
        }
        if (o.inflightPerStream > 0 && !stopping) sendNext(s);
      }
    });
    // A stream that ends with an error fails the run at once, through the
    // finally below that stops the server and PostgreSQL. Left unhandled,
    // its rejection ended this process before they were stopped.
    let failRun: (error: unknown) => void = () => {};
    const streamFailed = new Promise<never>((_, reject) => {
      failRun = reject;
    });
    streamFailed.catch(() => {});
    for (const [s, reader] of readers.entries()) {
      reader.catch((error: unknown) =>
        failRun(
          new Error(
            `KeepAlive stream ${s} of ${o.streams} ended: ${error instanceof Error ? error.message : String(error)}`,
            { cause: error },
          ),
        ),
      );
    }
    const sleep = (ms: number) =>
      Promise.race([new Promise((r) => setTimeout(r, ms)), streamFailed]);
    const t0 = performance.now();
    let sentUpTo = 0;
    const ticker =
      o.inflightPerStream > 0
        ? undefined
        : setInterval(() => {
            const due = Math.floor(((performance.now() - t0) / o.renewEveryMs) * o.leases);
            for (; sentUpTo < due; sentUpTo++) send(sentUpTo % o.leases);
          }, 5);
    for (let s = 0; s < o.streams && o.inflightPerStream > 0; s++) {
      for (let k = 0; k < o.inflightPerStream; k++) sendNext(s);
    }

    // Warm-up: one full renewal period, so every lease is on its 15 s TTL.
    try {
      await sleep(o.renewEveryMs);
    } catch (error) {
      clearInterval(ticker);
      for (const q of queues) q.end();
      throw error;
    }
    const before = {
      stmts: await statementCounts(db),
      server: await cpuSeconds(server.pid),
      pg: await treeCpuSeconds(db.postmasterPid),
      self: process.cpuUsage(),
      machine: machineBusySeconds(),
      at: performance.now(),
    };
    const waits = sampleRenewalWaits(db.url);
    measuring = true;
    const windowStart = Number(process.hrtime.bigint() / 1000n);
    lost = 0;
    try {
      await sleep(o.measureMs);
    } catch (error) {
      clearInterval(ticker);
      for (const q of queues) q.end();
      await waits.stop().catch(() => {});
      throw error;
    }
    measuring = false;
    const windowEnd = Number(process.hrtime.bigint() / 1000n);
    const renewalWaits = await waits.stop();
    stopping = true;
    const seconds = (performance.now() - before.at) / 1000;
    const after = {
      stmts: await statementCounts(db),
      server: await cpuSeconds(server.pid),
      pg: await treeCpuSeconds(db.postmasterPid),
      self: process.cpuUsage(before.self),
      machine: machineBusySeconds(),
      rss: await rssBytes(server.pid),
    };
    // Renewals sent in the window may still be on their way back.
    const settleBy = performance.now() + 5_000;
    while (tally.unanswered > 0 && performance.now() < settleBy) {
      await new Promise((r) => setTimeout(r, 20));
    }
    clearInterval(ticker);
    for (const q of queues) q.end();
    await Promise.race([Promise.allSettled(readers), streamFailed]);

    const sorted = rtts.slice(0, samples).sort();
    const result: KeepAliveBenchResult = {
      leases: o.leases,
      streams: o.streams,
      setup: { seconds: setupSeconds, acquiresPerSecond: o.leases / setupSeconds },
      renewals: {
        perSecond: sent / seconds,
        p50Ms: quantile(sorted, 0.5),
        p99Ms: quantile(sorted, 0.99),
        maxMs: quantile(sorted, 1),
        lost,
        unanswered: tally.unanswered,
      },
      database: {
        statementsPerSecond: (after.stmts.all - before.stmts.all) / seconds,
        renewalStatementsPerSecond: (after.stmts.renewals - before.stmts.renewals) / seconds,
        renewalStatementMeanMs:
          (after.stmts.renewalMs - before.stmts.renewalMs) /
          (after.stmts.renewals - before.stmts.renewals),
        walSyncsPerSecond: (after.stmts.walSyncs - before.stmts.walSyncs) / seconds,
        walSyncMeanMs:
          (after.stmts.walSyncMs - before.stmts.walSyncMs) /
          (after.stmts.walSyncs - before.stmts.walSyncs),
        commitsPerSecond: (after.stmts.commits - before.stmts.commits) / seconds,
        cpuCores: (after.pg - before.pg) / seconds,
        renewalWaits,
      },
      server: { cpuCores: (after.server - before.server) / seconds, rssMiB: after.rss / 2 ** 20 },
      loadGeneratorCpuCores: (after.self.user + after.self.system) / 1e6 / seconds,
      otherCpuCores:
        (after.machine -
          before.machine -
          (after.server - before.server) -
          (after.pg - before.pg) -
          (after.self.user + after.self.system) / 1e6) /
        seconds,
      windowMicros: [windowStart, windowEnd],
    };
    log(
      `renewals: ${result.renewals.perSecond.toFixed(0)}/s, round trip p50 ${result.renewals.p50Ms.toFixed(1)} ms, p99 ${result.renewals.p99Ms.toFixed(1)} ms, max ${result.renewals.maxMs.toFixed(1)} ms; lost ${lost}, unanswered ${result.renewals.unanswered}`,
    );
    log(
      `database: ${result.database.statementsPerSecond.toFixed(1)} statements/s (renewal batches ${result.database.renewalStatementsPerSecond.toFixed(1)}/s, ${result.database.renewalStatementMeanMs.toFixed(2)} ms each in PostgreSQL), ${result.database.commitsPerSecond.toFixed(1)} commits/s, ${result.database.walSyncsPerSecond.toFixed(0)} WAL flushes/s of ${result.database.walSyncMeanMs.toFixed(2)} ms, PostgreSQL CPU ${(result.database.cpuCores * 100).toFixed(0)}% of a core`,
    );
    log(`renewal statements, sampled: ${describeWaits(renewalWaits)}`);
    log(
      `server: CPU ${(result.server.cpuCores * 100).toFixed(0)}% of a core, RSS ${result.server.rssMiB.toFixed(0)} MiB; load generator CPU ${(result.loadGeneratorCpuCores * 100).toFixed(0)}% of a core; other work on the machine ${result.otherCpuCores.toFixed(2)} cores`,
    );
    await server.stop();

    if (o.acquireSeconds > 0) result.acquire = await compareNotifications(db, o);
    return result;
  } finally {
    await server.stop();
    await db.stop();
  }
}

/**
 * Acquire throughput of one instance with the notification path off, on,
 * and on with a second instance watching the account (so every published
 * change is received, decoded and sent to a watcher there — on this machine,
 * with the same CPUs). Each mode twice, alternating, each on a fresh server.
 */
async function compareNotifications(db: BenchDatabase, o: KeepAliveBenchOptions) {
  const { log } = o;
  const modes = ["off", "on", "watched"] as const;
  const rates: Record<(typeof modes)[number], number[]> = { off: [], on: [], watched: [] };
  const cpu: Record<(typeof modes)[number], { server: number; pg: number }[]> = {
    off: [],
    on: [],
    watched: [],
  };
  let acquiredWatched = 0;
  let seenWatched = 0;
  // Rounds alternate direction (off on watched, watched on off, …), so a
  // drift over the run (a neighbour's load, autovacuum) does not favour a mode.
  const phases = Array.from({ length: o.acquireRounds }, (_, r) =>
    r % 2 === 0 ? [...modes] : [...modes].reverse(),
  ).flat();
  for (const mode of phases) {
    // An account of its own per mode: no earlier grant expires in view.
    const accountId = `bench-acquire-${mode}`;
    // No quota here: it adds a statement per acquire and would stop the
    // phase at its limit; the comparison is about the publish path.
    const server = await spawnLeasehold(
      db.url,
      [
        "--notifications",
        mode === "off" ? "off" : "on",
        "--pool-size",
        "20",
        "--max-leases-per-account",
        "0",
      ],
      o.serverCli,
    );
    const watcherSide =
      mode === "watched" ? await spawnLeasehold(db.url, [], o.serverCli) : undefined;
    const controller = new AbortController();
    let seen = 0;
    let ready: () => void = () => {};
    const snapshot = new Promise<void>((r) => {
      ready = r;
    });
    const watching = watcherSide
      ? (async () => {
          const watcher = createClient(
            LeaseService,
            createGrpcTransport({ baseUrl: watcherSide.url }),
          );
          for await (const m of watcher.watch(
            { key: { accountId, sessionId: "" } },
            { signal: controller.signal },
          )) {
            if (m.kind.case === "snapshot") ready();
            else if (m.kind.case === "event" && m.kind.value.type === EventType.ACQUIRED) seen++;
          }
        })().catch(() => {})
      : Promise.resolve();
    if (!watcherSide) ready();
    try {
      await snapshot;
      const client = createClient(LeaseService, createGrpcTransport({ baseUrl: server.url }));
      // Warm the pool and the code paths before measuring.
      await pool(200, o.acquireConcurrency, async () => {
        await client.acquire({
          key: { accountId: "bench-warm", sessionId: randomUUID() },
          ttl: duration(60_000),
        });
      });
      // Each caller acquires and releases sessions of its own in turn: the
      // table stays the same size from phase to phase (tombstones are
      // reused), and every pair publishes two changes.
      let count = 0;
      const cpuBefore = {
        server: await cpuSeconds(server.pid),
        pg: await treeCpuSeconds(db.postmasterPid),
      };
      const start = performance.now();
      const end = start + o.acquireSeconds * 1000;
      await Promise.all(
        Array.from({ length: o.acquireConcurrency }, async (_, caller) => {
          for (let i = 0; performance.now() < end; i++) {
            const key = { accountId, sessionId: `c${caller}-${i % 100}` };
            const a = await client.acquire({ key, ttl: duration(60_000) });
            if (!a.acquired || !a.lease) throw new Error(`could not acquire ${key.sessionId}`);
            count++;
            await client.release({ key, runId: a.lease.runId });
          }
        }),
      );
      const rate = count / ((performance.now() - start) / 1000);
      rates[mode].push(rate);
      // CPU per acquire is steadier than the rate on a shared machine.
      const serverUs = ((await cpuSeconds(server.pid)) - cpuBefore.server) * 1e6;
      const pgUs = ((await treeCpuSeconds(db.postmasterPid)) - cpuBefore.pg) * 1e6;
      cpu[mode].push({ server: serverUs / count, pg: pgUs / count });
      if (watcherSide) {
        // Let the last tick's changes arrive before counting what was seen.
        await new Promise((r) => setTimeout(r, 500));
        acquiredWatched += count;
        seenWatched += seen;
      }
      const last = cpu[mode].at(-1);
      log(
        `acquires (each then released), notifications ${mode}: ${rate.toFixed(0)}/s; CPU per acquire+release: server ${last?.server.toFixed(0)} µs, PostgreSQL ${last?.pg.toFixed(0)} µs`,
      );
    } finally {
      controller.abort();
      await watching;
      await watcherSide?.stop();
      await server.stop();
    }
  }
  // The median: a shared machine's neighbours make single phases noisy.
  const median = (xs: number[]) => {
    const sorted = [...xs].sort((a, b) => a - b);
    const mid = Math.floor(sorted.length / 2);
    return sorted.length % 2
      ? (sorted[mid] ?? 0)
      : ((sorted[mid - 1] ?? 0) + (sorted[mid] ?? 0)) / 2;
  };
  const out = {
    notificationsOffPerSecond: median(rates.off),
    notificationsOnPerSecond: median(rates.on),
    notificationsOnWatchedPerSecond: median(rates.watched),
    serverCpuUsPerAcquire: {
      off: median(cpu.off.map((c) => c.server)),
      on: median(cpu.on.map((c) => c.server)),
      watched: median(cpu.watched.map((c) => c.server)),
    },
    postgresCpuUsPerAcquire: {
      off: median(cpu.off.map((c) => c.pg)),
      on: median(cpu.on.map((c) => c.pg)),
      watched: median(cpu.watched.map((c) => c.pg)),
    },
    phases: rates,
    deliveredToWatcher: acquiredWatched === 0 ? 0 : seenWatched / acquiredWatched,
  };
  log(
    `CPU per acquire+release (median): server off ${out.serverCpuUsPerAcquire.off.toFixed(0)} µs, on ${out.serverCpuUsPerAcquire.on.toFixed(0)} µs, watched ${out.serverCpuUsPerAcquire.watched.toFixed(0)} µs; PostgreSQL off ${out.postgresCpuUsPerAcquire.off.toFixed(0)} µs, on ${out.postgresCpuUsPerAcquire.on.toFixed(0)} µs, watched ${out.postgresCpuUsPerAcquire.watched.toFixed(0)} µs`,
  );
  log(
    `acquire throughput (median of ${o.acquireRounds}): notifications off ${out.notificationsOffPerSecond.toFixed(0)}/s, on ${out.notificationsOnPerSecond.toFixed(0)}/s, on with a watching instance ${out.notificationsOnWatchedPerSecond.toFixed(0)}/s (which saw ${(out.deliveredToWatcher * 100).toFixed(1)}% of those grants)`,
  );
  return out;
}

const usage = `usage: npx tsx bench/keepalive.ts [options]

  --leases N             leases kept alive (default ${defaults.leases}; 1,000 with --quick)
  --streams M            KeepAlive streams they are spread over (default ${defaults.streams})
  --inflight K           saturate: each stream keeps K renewals in flight (default: steady renewals every 5 s)
  --measure DURATION     measured window, e.g. 30s (default ${defaults.measureMs / 1000}s; 10s with --quick)
  --acquire-seconds N    length of each acquire-throughput round (default ${defaults.acquireSeconds})
  --acquire-rounds N     rounds per notification mode (default ${defaults.acquireRounds})
  --quick                a short run
  --json                 print the figures as JSON at the end
  --help                 this text
`;

async function main() {
  const { values } = parseArgs({
    options: {
      help: { type: "boolean" },
      leases: { type: "string" },
      streams: { type: "string" },
      inflight: { type: "string" },
      measure: { type: "string" },
      "acquire-seconds": { type: "string" },
      "acquire-rounds": { type: "string" },
      quick: { type: "boolean" },
      json: { type: "boolean" },
    },
  });
  if (values.help) {
    process.stdout.write(usage);
    return;
  }
  const quick = values.quick === true;
  const number = (text: string | undefined, fallback: number) => {
    if (text === undefined) return fallback;
    const n = Number(text);
    if (!Number.isInteger(n) || n < 1) throw new Error(`expected a positive integer, got ${text}`);
    return n;
  };
  const result = await run({
    leases: number(values.leases, quick ? 1_000 : defaults.leases),
    streams: number(values.streams, defaults.streams),
    inflightPerStream: values.inflight === undefined ? 0 : number(values.inflight, 0),
    measureMs: values.measure
      ? (parseDuration(values.measure) ?? defaults.measureMs)
      : quick
        ? 10_000
        : defaults.measureMs,
    acquireSeconds:
      values["acquire-seconds"] !== undefined
        ? Number(values["acquire-seconds"])
        : quick
          ? 3
          : defaults.acquireSeconds,
    acquireRounds: number(values["acquire-rounds"], quick ? 1 : defaults.acquireRounds),
  });
  if (values.json) process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
}

if (process.argv[1] && import.meta.url === new URL(`file://${process.argv[1]}`).href) {
  main().catch((error: unknown) => {
    // A bad flag is a usage error, not a crash: say which, and how to call it.
    const badFlag =
      error instanceof TypeError &&
      "code" in error &&
      String(error.code).startsWith("ERR_PARSE_ARGS");
    process.stderr.write(
      badFlag
        ? `${error.message}\n${usage}`
        : `${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`,
    );
    process.exitCode = badFlag ? 2 : 1;
  });
}
