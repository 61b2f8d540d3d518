// Scenario 3: KeepAlive capacity — leases held at TTL 15 s, each renewed
// every 5 s over 100 streams, at growing counts, then a saturation run (each
// stream keeping renewals in flight); and, side by side (scenario 5), etcd
// under the same loads. Leasehold's side is bench/keepalive.ts's scenario,
// which brings its own PostgreSQL and server and counts statements with
// pg_stat_statements.

import { readdir } from "node:fs/promises";
import path from "node:path";
import { type BenchContext, medianOf, type ScenarioReport } from "./context.js";
import type { EtcdServer } from "./etcd.js";
import { type KeepAliveFigures, measureEtcdKeepAlive } from "./etcd-keepalive.js";
import { describeLoad, type KeepAliveLoad, keepAliveLoads, windowFor } from "./keepalive-loads.js";
import type { KeepAliveBenchResult, LeaseholdKeepAliveOptions } from "./load-keepalive.js";
import { runLoad } from "./load-protocol.js";
import {
  type Comparison,
  compare,
  fmtMs,
  fmtRate,
  fmtRatio,
  type Row,
  type Target,
} from "./report.js";

interface LeaseholdFigures {
  renewalsPerSec: number;
  p50Ms: number;
  p99Ms: number;
  lost: number;
  unanswered: number;
  statementsPerSec: number;
  renewalStatementsPerSec: number;
  /** A renewal statement's mean execution time in PostgreSQL, ms (its commit not included). */
  renewalStatementMeanMs: number;
  /** WAL flushes per second and their mean duration, ms: what a commit waits for. */
  walSyncsPerSec: number;
  walSyncMeanMs: number;
  serverCpuCores: number;
  serverRssMiB: number;
  postgresCpuCores: number;
  loadCpuCores: number;
  /** The rest of the machine's busy cores in the window (other work: the noise). */
  otherCpuCores: number;
  setupSeconds: number;
  windows: {
    renewalsPerSec: number;
    p50Ms: number;
    p99Ms: number;
    /** The longest a renewal statement was seen running in PostgreSQL (sampled every 20 ms). */
    longestStatementMs: number;
    /** What the renewal statements were seen doing: shares by wait event, "CPU" for none. */
    statementWaits: Record<string, number>;
  }[];
}

async function measureLeasehold(
  ctx: BenchContext,
  load: KeepAliveLoad,
  round: number,
  rounds: number,
  serverProfiles: NonNullable<ScenarioReport["serverProfiles"]>,
): Promise<KeepAliveBenchResult> {
  ctx.progress(`3 KeepAlive · Leasehold · ${describeLoad(load)} · round ${round}/${rounds}`);
  const options: LeaseholdKeepAliveOptions = {
    leases: load.leases,
    streams: load.streams,
    ttlMs: load.ttlSeconds * 1000,
    renewEveryMs: load.intervalMs,
    inflightPerStream: load.inflight,
    measureMs: windowFor(ctx, load),
    serverCli: ctx.serverCli,
  };
  // bench/keepalive.ts starts its own server; this is how it profiles it.
  const dir =
    ctx.cpuProfileDir &&
    path.join(ctx.cpuProfileDir, `keepalive-${load.leases}-${load.inflight}-${round}`);
  const env = dir ? { BENCH_SERVER_NODE_ARGS: `--cpu-prof --cpu-prof-dir=${dir}` } : {};
  // Setup acquires every lease through the service first: allow for it.
  const result = await runLoad<KeepAliveBenchResult>(
    "load-keepalive.ts",
    options,
    {},
    600_000,
    env,
  );
  // A stream that ended fails the load generator; a renewal never answered
  // or answered lost (none of these leases is released or taken over) fails
  // the scenario too: since a renewal statement that times out ends no
  // stream, that is how a database that cannot keep up shows.
  const { lost, unanswered } = result.renewals;
  if (lost > 0 || unanswered > 0) {
    throw new Error(
      `${describeLoad(load)}: ${lost} renewal(s) of the window answered lost, ${unanswered} never answered`,
    );
  }
  if (dir) {
    // CPU.<date>.<time>.<pid>.<thread>.<seq>.cpuprofile; thread 0 is the main one.
    const main = (await readdir(dir)).find((f) => f.split(".")[4] === "0");
    if (main) {
      serverProfiles.push({
        label: `3 KeepAlive, Leasehold, ${describeLoad(load)}, round ${round}`,
        file: path.join(dir, main),
        windows: [result.windowMicros],
      });
    }
  }
  return result;
}

function summarize(runs: KeepAliveBenchResult[]): LeaseholdFigures {
  const med = (pick: (r: KeepAliveBenchResult) => number) => medianOf(runs, pick);
  const r1 = (x: number) => Math.round(x * 10) / 10;
  const r2 = (x: number) => Math.round(x * 100) / 100;
  return {
    renewalsPerSec: Math.round(med((r) => r.renewals.perSecond)),
    p50Ms: r2(med((r) => r.renewals.p50Ms)),
    p99Ms: r2(med((r) => r.renewals.p99Ms)),
    lost: runs.reduce((sum, r) => sum + r.renewals.lost, 0),
    unanswered: runs.reduce((sum, r) => sum + r.renewals.unanswered, 0),
    statementsPerSec: r1(med((r) => r.database.statementsPerSecond)),
    renewalStatementsPerSec: r1(med((r) => r.database.renewalStatementsPerSecond)),
    renewalStatementMeanMs: r2(med((r) => r.database.renewalStatementMeanMs)),
    walSyncsPerSec: r1(med((r) => r.database.walSyncsPerSecond)),
    walSyncMeanMs: r2(med((r) => r.database.walSyncMeanMs)),
    serverCpuCores: r2(med((r) => r.server.cpuCores)),
    serverRssMiB: Math.round(med((r) => r.server.rssMiB)),
    postgresCpuCores: r2(med((r) => r.database.cpuCores)),
    loadCpuCores: r2(med((r) => r.loadGeneratorCpuCores)),
    otherCpuCores: r2(med((r) => r.otherCpuCores)),
    setupSeconds: r1(med((r) => r.setup.seconds)),
    windows: runs.map((r) => ({
      renewalsPerSec: Math.round(r.renewals.perSecond),
      p50Ms: r.renewals.p50Ms,
      p99Ms: r.renewals.p99Ms,
      longestStatementMs: r.database.renewalWaits.longestMs,
      statementWaits: r.database.renewalWaits.shares,
    })),
  };
}

export async function runKeepAlive(
  ctx: BenchContext,
  etcd: EtcdServer | undefined,
): Promise<ScenarioReport> {
  const scenario = "3 KeepAlive";
  const rows: Row[] = [];
  const comparisons: Comparison[] = [];
  const targets: Target[] = [];
  const serverProfiles: NonNullable<ScenarioReport["serverProfiles"]> = [];
  const figures: { load: KeepAliveLoad; leasehold: LeaseholdFigures; etcd?: KeepAliveFigures }[] =
    [];
  for (const load of keepAliveLoads(ctx.settings.quick)) {
    // Setting up 50,000 leases takes most of a minute: one window of tens
    // of thousands of renewals is enough there.
    const rounds = load.leases > 10_000 ? 1 : ctx.settings.rounds;
    const runs: KeepAliveBenchResult[] = [];
    for (let round = 1; round <= rounds; round++) {
      runs.push(await measureLeasehold(ctx, load, round, rounds, serverProfiles));
    }
    const l = summarize(runs);
    const e = etcd ? await measureEtcdKeepAlive(ctx, etcd, load, rounds) : undefined;
    figures.push({ load, leasehold: l, etcd: e });

    const name = describeLoad(load);
    const vs = (metric: string, lv: number, ev: number | undefined, higher: boolean) => {
      if (ev === undefined) return undefined;
      const c = compare(scenario, name, metric, lv, "etcd", ev, higher);
      comparisons.push(c);
      return c;
    };
    const rate = vs("renewals/s", l.renewalsPerSec, e?.renewalsPerSec, true);
    const p50 = vs("round trip p50 ms", l.p50Ms, e?.p50Ms, false);
    const p99 = vs("round trip p99 ms", l.p99Ms, e?.p99Ms, false);
    rows.push(
      {
        scenario,
        load: name,
        metric: "renewals/s",
        leasehold: fmtRate(l.renewalsPerSec),
        etcd: e ? fmtRate(e.renewalsPerSec) : undefined,
        vsEtcd: fmtRatio(rate?.ratio),
      },
      {
        scenario,
        load: name,
        metric: "round trip p50 / p99 ms",
        leasehold: `${fmtMs(l.p50Ms)} / ${fmtMs(l.p99Ms)}`,
        etcd: e ? `${fmtMs(e.p50Ms)} / ${fmtMs(e.p99Ms)}` : undefined,
        vsEtcd: p50 && p99 ? `${fmtRatio(p50.ratio)} / ${fmtRatio(p99.ratio)}` : undefined,
      },
      {
        scenario,
        load: name,
        metric: "DB stmts/s (etcd: WAL fsyncs/s) · server CPU cores · RSS",
        leasehold: `${fmtRate(l.statementsPerSec)} · ${l.serverCpuCores.toFixed(2)} · ${l.serverRssMiB} MiB`,
        etcd: e
          ? `${fmtRate(e.etcdWalFsyncsPerSec)} · ${(e.cpuCores.etcd ?? 0).toFixed(2)}`
          : undefined,
      },
    );
    // The targets of the streaming fast path (docs/design.md).
    if (load.leases === 50_000 && load.inflight === 0) {
      targets.push({
        scenario,
        target: "50,000 leases: p99 < 50 ms, < 100 statements/s, server RSS < 300 MiB",
        measured: `p99 ${fmtMs(l.p99Ms)} ms, ${fmtRate(l.statementsPerSec)} statements/s, ${l.serverRssMiB} MiB`,
        met: l.p99Ms < 50 && l.statementsPerSec < 100 && l.serverRssMiB < 300,
      });
    }
    if (load.inflight > 0) {
      targets.push({
        scenario,
        target: `saturation at ${load.leases.toLocaleString("en-US")} leases ≥ 1.5× etcd`,
        measured: rate ? `${rate.ratio.toFixed(2)}×` : "etcd not measured",
        met: rate ? rate.ratio >= 1.5 : null,
      });
    }
  }
  return {
    id: "keepalive",
    name: "KeepAlive capacity (TTL 15 s, every 5 s, 100 streams) and saturation",
    figures,
    rows,
    comparisons,
    targets,
    serverProfiles,
  };
}
