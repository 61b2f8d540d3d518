// Scenario 4: Watch fan-out. 1,000 watchers on one account (and 10,000 in a
// full run); how long from a release until every watcher has the event.

import { type BenchContext, medianOf, type ScenarioReport } from "./context.js";
import type { WatchOptions, WatchResult } from "./load-watch.js";
import { type Measured, measureLoad } from "./measure.js";
import { fmtMs, type Target } from "./report.js";

// 50 streams per connection, well under the server's default cap (100).
const streamsPerConnection = 50;
// Processes the watchers are spread over (load-watch.ts says why): one per core.
const watcherProcesses = 2;
const releasesPerSecond = 5;

async function measureWatchers(ctx: BenchContext, watchers: number, rounds: number) {
  const { settings, systems } = ctx;
  const runs: Measured<WatchResult>[] = [];
  // Few releases fit in one window: a longer window gives p99 more samples.
  const windowMs = settings.windowMs * 2;
  const connections = Math.ceil(watchers / streamsPerConnection);
  for (let round = 1; round <= rounds; round++) {
    ctx.progress(`4 watch fan-out · ${watchers} watchers · round ${round}/${rounds}`);
    const options: WatchOptions = {
      urls: ctx.serverUrls,
      watchers,
      connections,
      processes: watcherProcesses,
      accountId: `bench-watch-${watchers}-${round}`,
      rate: releasesPerSecond,
      ttlSeconds: settings.ttlSeconds,
      graceMs: 5_000,
      warmupMs: settings.warmupMs,
      windowMs,
    };
    runs.push(await measureLoad<WatchResult>(systems, "load-watch.ts", options));
  }
  // One window holds only dozens of releases: p99 over all rounds' releases
  // together says more than a median of per-window p99s.
  const pooled = runs.flatMap((m) => m.load.toAllMs).sort((a, b) => a - b);
  const rank = (p: number) =>
    pooled[Math.min(pooled.length - 1, Math.ceil((p / 100) * pooled.length) - 1)] ?? Number.NaN;
  const figures = {
    watchers,
    connections,
    targetReleasesPerSec: releasesPerSecond,
    releasesPerSec: medianOf(runs, (m) => m.load.releasesPerSec),
    releases: runs.reduce((sum, m) => sum + m.load.releases, 0),
    toAllP50Ms: rank(50),
    toAllP99Ms: rank(99),
    toAllMaxMs: pooled.at(-1) ?? Number.NaN,
    perDeliveryP50Ms: medianOf(runs, (m) => m.load.perDelivery.p50Ms),
    perDeliveryP99Ms: medianOf(runs, (m) => m.load.perDelivery.p99Ms),
    missing: runs.reduce((sum, m) => sum + m.load.missing, 0),
    resyncs: runs.reduce((sum, m) => sum + m.load.resyncs, 0),
    subscribeSeconds: medianOf(runs, (m) => m.load.subscribeSeconds),
    errors: runs.reduce((sum, m) => sum + m.load.errors, 0),
    firstError: runs.find((m) => m.load.firstError)?.load.firstError,
    cpuCores: {
      server: medianOf(runs, (m) => m.cpu.server ?? 0),
      postgres: medianOf(runs, (m) => m.cpu.postgres ?? 0),
      load: medianOf(runs, (m) => m.cpu.load ?? 0),
      other: medianOf(runs, (m) => m.cpu.other ?? 0),
    },
    serverRssMiB: medianOf(runs, (m) => m.serverRssMiB),
    windows: runs.map((m) => ({
      releases: m.load.releases,
      toAllP50Ms: m.load.toAll.p50Ms,
      toAllP99Ms: m.load.toAll.p99Ms,
      otherCpu: m.cpu.other ?? Number.NaN,
    })),
  };
  return { figures, windows: runs.map((m) => m.window) };
}

export async function runWatch(ctx: BenchContext): Promise<ScenarioReport> {
  // 10,000 watchers take half a minute to subscribe: one round there, and
  // only in a full run.
  const sizes = ctx.settings.quick ? [1_000] : [1_000, 10_000];
  const measured = [];
  for (const watchers of sizes) {
    const rounds = watchers > 1_000 ? 1 : ctx.settings.rounds;
    measured.push(await measureWatchers(ctx, watchers, rounds));
  }
  const scenario = "4 watch fan-out";
  const rows: ScenarioReport["rows"] = [];
  const targets: Target[] = [];
  for (const { figures } of measured) {
    const load = `${figures.watchers.toLocaleString("en-US")} watchers, 1 account`;
    rows.push(
      {
        scenario,
        load,
        metric: "release→all watchers p50 / p99 ms",
        leasehold: `${fmtMs(figures.toAllP50Ms)} / ${fmtMs(figures.toAllP99Ms)}`,
      },
      {
        scenario,
        load,
        metric: "release→one watcher p50 / p99 ms",
        leasehold: `${fmtMs(figures.perDeliveryP50Ms)} / ${fmtMs(figures.perDeliveryP99Ms)}`,
      },
      {
        scenario,
        load,
        metric: "releases/s; missed deliveries; server CPU cores · RSS",
        leasehold: `${figures.releasesPerSec}; ${figures.missing}; ${figures.cpuCores.server.toFixed(2)} · ${figures.serverRssMiB} MiB`,
      },
    );
    if (figures.watchers === 1_000) {
      targets.push({
        scenario,
        target: "1,000 watchers: release→all watchers p99 < 50 ms",
        measured: `${fmtMs(figures.toAllP99Ms)} ms`,
        met: figures.toAllP99Ms < 50,
      });
    } else {
      // Measured and reported; the issue sets no bound for it.
      targets.push({
        scenario,
        target: `${figures.watchers.toLocaleString("en-US")} watchers: measured and reported`,
        measured: `p99 ${fmtMs(figures.toAllP99Ms)} ms, ${figures.missing} missed`,
        met: figures.missing === 0 && figures.errors === 0,
      });
    }
  }
  const first = measured[0];
  return {
    id: "watch",
    name: `Watch fan-out: ${sizes.map((n) => n.toLocaleString("en-US")).join(" and ")} watchers on one account`,
    figures: measured.map((m) => m.figures),
    rows,
    comparisons: [],
    profile: first
      ? { label: `4 watch fan-out, ${first.figures.watchers} watchers`, windows: first.windows }
      : undefined,
    targets,
  };
}
