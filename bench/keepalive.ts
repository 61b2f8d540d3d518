// KeepAlive scenario: N leases with TTL 15 s, each renewed every 5 s over M
// multiplexed KeepAlive streams, against a Leasehold server running as its own
// process on an embedded PostgreSQL. Reports setup time, renewals per second,
// the renewal round trip (p50/p99, measured from send to answer on the
// client), database statements per second (pg_stat_statements), server CPU
// and memory. Then acquire throughput with the notification path on and off.
// With --inflight K it saturates instead: each stream keeps K renewals in
// flight, sending its next lease as each answer arrives.
//
//   npx tsx bench/keepalive.ts [--leases N] [--streams M] [--inflight K] [--measure 30s] [--quick] [--json]
//
// `run(options)` is the same scenario for the benchmark harness.

import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { type Client, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { type KeepAliveRequestSchema, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { parseDuration } from "../src/server/limits.js";
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
  /** Seconds per acquire-throughput phase (notifications on, off, on, off); 0 skips it. */
  acquireSeconds: number;
  /** Concurrent acquires in the throughput phases. */
  acquireConcurrency: number;
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
    commitsPerSecond: number;
    cpuCores: number;
  };
  server: { cpuCores: number; rssMiB: number };
  loadGeneratorCpuCores: number;
  /** The measured window on the monotonic clock in µs, as CPU profiles stamp it. */
  windowMicros: [number, number];
  acquire?: {
    notificationsOnPerSecond: number;
    notificationsOffPerSecond: number;
    /** Share of the acquires of the "on" phases that a watcher on a second instance saw. */
    deliveredToWatcher: number;
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
  const [row] = await db.sql<{ all: string; renewals: string; commits: string }[]>`
    SELECT
      (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s
        WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database()))::text AS all,
      (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s
        WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND s.query LIKE '%lookup_handoff)%')::text AS renewals,
      (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())::text AS commits`;
  return {
    all: Number(row?.all ?? 0),
    renewals: Number(row?.renewals ?? 0),
    commits: Number(row?.commits ?? 0),
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
  const server = await spawnLeasehold(db.url, [
    "--pool-size",
    "20",
    "--max-leases-per-account",
    "0",
  ]);
  try {
    const conns = clients(server.url, Math.max(1, Math.ceil(o.streams / 25)));
    const accountId = "bench";

    // Setup: acquire every lease with a long TTL; the first renewal sets 15 s.
    const runIds: string[] = new Array(o.leases);
    const setupStart = performance.now();
    await pool(o.leases, 64, async (i) => {
      const a = await (conns[i % conns.length] as LeaseClient).acquire({
        key: { accountId, sessionId: `s${i}` },
        ttl: duration(Math.max(120_000, o.ttlMs)),
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
    const awaited = new Uint8Array(o.leases);
    let outstanding = 0;
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
      if (measuring) {
        sent++;
        if (awaited[i] === 0) outstanding++;
        awaited[i] = 1;
      }
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
        if (answer.result.case === "lost") lost++;
        if (answer.result.case !== "lease") continue;
        // Only renewals sent inside the window count, answered when they may.
        if (awaited[i] === 1) {
          awaited[i] = 0;
          outstanding--;
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
    await new Promise((r) => setTimeout(r, o.renewEveryMs));
    const before = {
      stmts: await statementCounts(db),
      server: await cpuSeconds(server.pid),
      pg: await treeCpuSeconds(db.postmasterPid),
      self: process.cpuUsage(),
      at: performance.now(),
    };
    measuring = true;
    const windowStart = Number(process.hrtime.bigint() / 1000n);
    lost = 0;
    await new Promise((r) => setTimeout(r, o.measureMs));
    measuring = false;
    const windowEnd = Number(process.hrtime.bigint() / 1000n);
    stopping = true;
    const seconds = (performance.now() - before.at) / 1000;
    const after = {
      stmts: await statementCounts(db),
      server: await cpuSeconds(server.pid),
      pg: await treeCpuSeconds(db.postmasterPid),
      self: process.cpuUsage(before.self),
      rss: await rssBytes(server.pid),
    };
    // Renewals sent in the window may still be on their way back.
    const settleBy = performance.now() + 5_000;
    while (outstanding > 0 && performance.now() < settleBy) {
      await new Promise((r) => setTimeout(r, 20));
    }
    clearInterval(ticker);
    for (const q of queues) q.end();
    await Promise.allSettled(readers);

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
        unanswered: outstanding,
      },
      database: {
        statementsPerSecond: (after.stmts.all - before.stmts.all) / seconds,
        renewalStatementsPerSecond: (after.stmts.renewals - before.stmts.renewals) / seconds,
        commitsPerSecond: (after.stmts.commits - before.stmts.commits) / seconds,
        cpuCores: (after.pg - before.pg) / seconds,
      },
      server: { cpuCores: (after.server - before.server) / seconds, rssMiB: after.rss / 2 ** 20 },
      loadGeneratorCpuCores: (after.self.user + after.self.system) / 1e6 / seconds,
      windowMicros: [windowStart, windowEnd],
    };
    log(
      `renewals: ${result.renewals.perSecond.toFixed(0)}/s, round trip p50 ${result.renewals.p50Ms.toFixed(1)} ms, p99 ${result.renewals.p99Ms.toFixed(1)} ms, max ${result.renewals.maxMs.toFixed(1)} ms; lost ${lost}, unanswered ${result.renewals.unanswered}`,
    );
    log(
      `database: ${result.database.statementsPerSecond.toFixed(1)} statements/s (renewal batches ${result.database.renewalStatementsPerSecond.toFixed(1)}/s), ${result.database.commitsPerSecond.toFixed(1)} commits/s, PostgreSQL CPU ${(result.database.cpuCores * 100).toFixed(0)}% of a core`,
    );
    log(
      `server: CPU ${(result.server.cpuCores * 100).toFixed(0)}% of a core, RSS ${result.server.rssMiB.toFixed(0)} MiB; load generator CPU ${(result.loadGeneratorCpuCores * 100).toFixed(0)}% of a core`,
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
 * Acquire throughput of one instance with the notification path on and off,
 * alternating, while a second instance watches the account (so published
 * changes are received and fanned out there).
 */
async function compareNotifications(db: BenchDatabase, o: KeepAliveBenchOptions) {
  const { log } = o;
  const watcherSide = await spawnLeasehold(db.url, []);
  const accountId = "bench-acquire";
  const watcherClient = createClient(
    LeaseService,
    createGrpcTransport({ baseUrl: watcherSide.url }),
  );
  const controller = new AbortController();
  let seen = 0;
  const watching = (async () => {
    for await (const m of watcherClient.watch(
      { key: { accountId, sessionId: "" } },
      { signal: controller.signal },
    )) {
      if (m.kind.case === "event") seen++;
    }
  })().catch(() => {});
  const rates: Record<"on" | "off", number[]> = { on: [], off: [] };
  let acquiredOn = 0;
  let seenOn = 0;
  try {
    for (const mode of ["on", "off", "on", "off"] as const) {
      const server = await spawnLeasehold(db.url, ["--notifications", mode, "--pool-size", "20"]);
      try {
        const client = createClient(LeaseService, createGrpcTransport({ baseUrl: server.url }));
        // Warm the pool and the code paths before measuring.
        await pool(200, o.acquireConcurrency, async () => {
          await client.acquire({
            key: { accountId: "bench-warm", sessionId: randomUUID() },
            ttl: duration(60_000),
          });
        });
        const seenBefore = seen;
        let count = 0;
        const start = performance.now();
        const end = start + o.acquireSeconds * 1000;
        await Promise.all(
          Array.from({ length: o.acquireConcurrency }, async () => {
            while (performance.now() < end) {
              const a = await client.acquire({
                key: { accountId, sessionId: randomUUID() },
                ttl: duration(60_000),
              });
              if (a.acquired) count++;
            }
          }),
        );
        const rate = count / ((performance.now() - start) / 1000);
        rates[mode].push(rate);
        // Let the last tick's changes arrive before counting what was seen.
        await new Promise((r) => setTimeout(r, 500));
        if (mode === "on") {
          acquiredOn += count;
          seenOn += seen - seenBefore;
        }
        log(`acquire, notifications ${mode}: ${rate.toFixed(0)}/s`);
      } finally {
        await server.stop();
      }
    }
  } finally {
    controller.abort();
    await watching;
    await watcherSide.stop();
  }
  const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
  const out = {
    notificationsOnPerSecond: mean(rates.on),
    notificationsOffPerSecond: mean(rates.off),
    deliveredToWatcher: acquiredOn === 0 ? 0 : seenOn / acquiredOn,
  };
  log(
    `acquire throughput: notifications on ${out.notificationsOnPerSecond.toFixed(0)}/s, off ${out.notificationsOffPerSecond.toFixed(0)}/s; a watcher on another instance saw ${(out.deliveredToWatcher * 100).toFixed(1)}% of the "on" grants`,
  );
  return out;
}

async function main() {
  const { values } = parseArgs({
    options: {
      leases: { type: "string" },
      streams: { type: "string" },
      inflight: { type: "string" },
      measure: { type: "string" },
      "acquire-seconds": { type: "string" },
      quick: { type: "boolean" },
      json: { type: "boolean" },
    },
  });
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
  });
  if (values.json) process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
}

if (process.argv[1] && import.meta.url === new URL(`file://${process.argv[1]}`).href) {
  main().catch((error: unknown) => {
    process.stderr.write(
      `${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`,
    );
    process.exitCode = 1;
  });
}
