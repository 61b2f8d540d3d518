// Scenario 6 (keepers, docs/keepers.md): acquire → release cycles on one
// keeper's Keep stream at each concurrency against the raw SQL and etcd
// (scenario 1's harness with the keeper as the lead), then 100,000 leases
// held on 100 keepers: heartbeat → answer latency, database statements/s and
// server memory while only heartbeats keep them, and leases kept alive per
// CPU-second of the machine against etcd (one etcd lease per keeper with its
// keys attached, kept alive over LeaseKeepAlive).

import { type BenchContext, medianOf, type ScenarioReport } from "./context.js";
import type { HoldOptions, HoldResult } from "./load-keepers.js";
import { type Measured, measureLoad } from "./measure.js";
import { compare, fmtMs, fmtRate, fmtRatio, type Row } from "./report.js";
import { runCycles } from "./scenario-cycles.js";

const scenario = "6 keepers";
const keepers = 100;
const leasesPerKeeper = 1_000;
const ttlSeconds = 9;
/** (TTL − TTL/10) / 3, the client's default heartbeat interval. */
const heartbeatMs = 2_700;

interface HoldFigures {
  system: "keepers" | "etcd";
  leases: number;
  setupSeconds: number;
  heartbeatsPerSec: number;
  p50Ms: number;
  p99Ms: number;
  lost: number;
  statementsPerSec: number;
  serverRssMiB: number;
  /** Cores busy in the window: the system's processes and the load generator. */
  cores: number;
  leasesPerCpuSecond: number;
}

function holdFigures(system: HoldFigures["system"], r: Measured<HoldResult>[]): HoldFigures {
  const groups = system === "keepers" ? ["server", "postgres", "load"] : ["etcd", "load"];
  const cores = medianOf(r, (m) => groups.reduce((sum, g) => sum + (m.cpu[g] ?? 0), 0));
  const leases = r[0]?.load.leases ?? 0;
  return {
    system,
    leases,
    setupSeconds: medianOf(r, (m) => m.load.setupSeconds),
    heartbeatsPerSec: medianOf(r, (m) => m.load.heartbeats / m.load.seconds),
    p50Ms: medianOf(r, (m) => m.load.roundTrip.p50Ms),
    p99Ms: medianOf(r, (m) => m.load.roundTrip.p99Ms),
    lost: r.reduce((sum, m) => sum + m.load.lost, 0),
    statementsPerSec: medianOf(r, (m) => m.database.statementsPerSec),
    serverRssMiB: medianOf(r, (m) => m.serverRssMiB),
    cores,
    leasesPerCpuSecond: cores > 0 ? leases / cores : Number.NaN,
  };
}

export async function runKeepers(ctx: BenchContext): Promise<ScenarioReport> {
  const cycles = await runCycles(ctx, { id: "keepers", scenario, lead: "keeper" });

  const { settings, systems } = ctx;
  const present: HoldFigures["system"][] = ["keepers"];
  if (systems.etcd) present.push("etcd");
  const runs = new Map(present.map((s) => [s, [] as Measured<HoldResult>[]]));
  for (let round = 1; round <= settings.rounds; round++) {
    for (const system of present) {
      ctx.progress(
        `${scenario} · ${keepers * leasesPerKeeper} leases on ${keepers} keepers · ${system} · round ${round}/${settings.rounds}`,
      );
      const options: HoldOptions = {
        target:
          system === "keepers"
            ? { kind: "keepers", urls: ctx.serverUrls }
            : { kind: "etcd", url: systems.etcd?.url ?? "" },
        keepers,
        leasesPerKeeper,
        ttlSeconds,
        heartbeatMs,
        // Every keeper beats at least twice in the window.
        warmupMs: settings.warmupMs,
        windowMs: Math.max(settings.windowMs, 2 * heartbeatMs),
      };
      const measured = await measureLoad<HoldResult>(systems, "load-keepers.ts", options);
      if (measured.load.errors > 0) {
        throw new Error(
          `${system}: ${measured.load.errors} heartbeats failed, first: ${measured.load.firstError}`,
        );
      }
      runs.get(system)?.push(measured);
    }
  }
  const held = holdFigures("keepers", runs.get("keepers") ?? []);
  const etcd = runs.has("etcd") ? holdFigures("etcd", runs.get("etcd") ?? []) : undefined;

  const load = `${held.leases} leases on ${keepers} keepers, heartbeat every ${heartbeatMs / 1000} s`;
  const rows: Row[] = [...cycles.rows];
  const comparisons = [...cycles.comparisons];
  const targets = [...cycles.targets];
  const perCpu = etcd
    ? compare(
        scenario,
        load,
        "leases kept alive per CPU-second",
        held.leasesPerCpuSecond,
        "etcd",
        etcd.leasesPerCpuSecond,
        true,
      )
    : undefined;
  if (perCpu) comparisons.push(perCpu);
  rows.push(
    {
      scenario,
      load,
      metric: "heartbeat → answer p50 / p99 ms",
      leasehold: `${fmtMs(held.p50Ms)} / ${fmtMs(held.p99Ms)}`,
      etcd: etcd ? `${fmtMs(etcd.p50Ms)} / ${fmtMs(etcd.p99Ms)}` : undefined,
    },
    {
      scenario,
      load,
      metric: "database statements/s, heartbeats/s",
      leasehold: `${fmtRate(held.statementsPerSec)}, ${fmtRate(held.heartbeatsPerSec)}`,
    },
    {
      scenario,
      load,
      metric: "server RSS MiB; setup s",
      leasehold: `${Math.round(held.serverRssMiB)}; ${held.setupSeconds}`,
      etcd: etcd ? `—; ${etcd.setupSeconds}` : undefined,
    },
    {
      scenario,
      load,
      metric: "leases kept alive per CPU-second [cores]",
      leasehold: `${fmtRate(held.leasesPerCpuSecond)} [${held.cores.toFixed(2)}]`,
      etcd: etcd ? `${fmtRate(etcd.leasesPerCpuSecond)} [${etcd.cores.toFixed(2)}]` : undefined,
      vsEtcd: fmtRatio(perCpu?.ratio),
    },
  );
  targets.push(
    {
      scenario,
      target: "heartbeat → answer p99 < 50 ms with 100,000 leases on 100 keepers",
      measured: `${fmtMs(held.p99Ms)} ms`,
      met: held.p99Ms < 50,
    },
    {
      scenario,
      target: "database statements/s < 100 with 100,000 leases on 100 keepers",
      measured: `${fmtRate(held.statementsPerSec)}/s`,
      met: held.statementsPerSec < 100,
    },
    {
      scenario,
      target: "leases kept alive per CPU-second ≥ 1.5× etcd's",
      measured: perCpu ? `${perCpu.ratio.toFixed(2)}×` : "etcd not measured",
      met: perCpu ? perCpu.ratio >= 1.5 : null,
    },
    {
      scenario,
      target: "no heartbeat answered lost",
      measured: `${held.lost} lost`,
      met: held.lost === 0,
    },
  );
  return {
    id: "keepers",
    name: "keepers",
    figures: { cycles: cycles.figures, hold: [held, ...(etcd ? [etcd] : [])] },
    rows,
    comparisons,
    targets,
    profile: cycles.profile,
  };
}
