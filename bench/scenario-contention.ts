// Scenario 2: 64 runs contending for one key with Acquire `wait`. Handovers
// per second, release → next grant, and S1 checked twice: by the clients (a
// grant while another client still held the key) and afterwards on the
// database's audit trail (a grant that began before the previous run ended).

import { type BenchContext, medianOf, type ScenarioReport } from "./context.js";
import type { ContentionOptions, ContentionResult } from "./load-contention.js";
import { type Measured, measureLoad } from "./measure.js";
import { fmtMs, fmtRate } from "./report.js";

const clients = 64;

export async function runContention(ctx: BenchContext): Promise<ScenarioReport> {
  const { settings, systems } = ctx;
  const runs: Measured<ContentionResult>[] = [];
  let databaseOverlaps = 0;
  for (let round = 1; round <= settings.rounds; round++) {
    ctx.progress(
      `2 contention · ${clients} clients, one key, wait · round ${round}/${settings.rounds}`,
    );
    const options: ContentionOptions = {
      urls: ctx.serverUrls,
      clients,
      accountId: "bench-contention",
      sessionId: `round-${round}`,
      ttlSeconds: settings.ttlSeconds,
      waitSeconds: 60,
      warmupMs: settings.warmupMs,
      windowMs: settings.windowMs,
    };
    runs.push(await measureLoad<ContentionResult>(systems, "load-contention.ts", options));
    databaseOverlaps += await systems.postgres.overlappingGrants(
      options.accountId,
      options.sessionId,
    );
  }
  const figures = {
    clients,
    handoversPerSec: medianOf(runs, (m) => m.load.handoversPerSec),
    p50Ms: medianOf(runs, (m) => m.load.handover.p50Ms),
    p99Ms: medianOf(runs, (m) => m.load.handover.p99Ms),
    clientOverlaps: runs.reduce((sum, m) => sum + m.load.overlaps, 0),
    databaseOverlaps,
    tokenRegressions: runs.reduce((sum, m) => sum + m.load.tokenRegressions, 0),
    waitsExpired: runs.reduce((sum, m) => sum + m.load.waitsExpired, 0),
    errors: runs.reduce((sum, m) => sum + m.load.errors, 0),
    firstError: runs.find((m) => m.load.firstError)?.load.firstError,
    cpuCores: {
      server: medianOf(runs, (m) => m.cpu.server ?? 0),
      postgres: medianOf(runs, (m) => m.cpu.postgres ?? 0),
      load: medianOf(runs, (m) => m.cpu.load ?? 0),
      other: medianOf(runs, (m) => m.cpu.other ?? 0),
    },
    databaseStatementsPerSec: medianOf(runs, (m) => m.database.statementsPerSec),
    windows: runs.map((m) => ({
      handoversPerSec: m.load.handoversPerSec,
      p50Ms: m.load.handover.p50Ms,
      p99Ms: m.load.handover.p99Ms,
      otherCpu: m.cpu.other ?? Number.NaN,
    })),
  };
  const scenario = "2 contention";
  const load = `${clients} clients, 1 key, wait`;
  const twoHolders = figures.clientOverlaps + figures.databaseOverlaps;
  return {
    id: "contention",
    name: "64 clients on one key with wait",
    figures,
    rows: [
      { scenario, load, metric: "handovers/s", leasehold: fmtRate(figures.handoversPerSec) },
      {
        scenario,
        load,
        metric: "release→next grant p50 / p99 ms",
        leasehold: `${fmtMs(figures.p50Ms)} / ${fmtMs(figures.p99Ms)}`,
      },
      {
        scenario,
        load,
        metric: "two holders at once: clients / database",
        leasehold: `${figures.clientOverlaps} / ${figures.databaseOverlaps}`,
      },
    ],
    comparisons: [],
    profile: {
      label: `2 contention, ${clients} clients on one key`,
      windows: runs.map((m) => m.window),
    },
    targets: [
      {
        scenario,
        target: "no moment with two holders (S1), no token regression (S6)",
        measured: `${twoHolders} overlaps, ${figures.tokenRegressions} regressions`,
        met: twoHolders === 0 && figures.tokenRegressions === 0,
      },
      {
        scenario,
        target: "release → next grant p99 < 10 ms",
        measured: `${fmtMs(figures.p99Ms)} ms`,
        met: figures.p99Ms < 10,
      },
    ],
  };
}
