// Scenario 1: acquire → release cycles at each concurrency, through the
// service, against the seed's two statements sent straight to the same
// database (the limit the service sits on), and — scenario 5 — against etcd.
// Systems take turns within each round, so noise from other work on the
// machine falls on all of them alike; each figure is the median of rounds.

import { type BenchContext, medianOf, type ScenarioReport } from "./context.js";
import type { CycleOptions, CycleResult, CycleTarget } from "./load-cycles.js";
import { type Measured, measureLoad } from "./measure.js";
import { type Comparison, compare, fmtMs, fmtRate, fmtRatio, type Row } from "./report.js";

export type System = "leasehold" | "sql" | "store" | "etcd" | "keeper";

const labels: Record<System, string> = {
  leasehold: "Leasehold (gRPC)",
  sql: "raw SQL (seed statements)",
  store: "Leasehold store SQL, no RPC",
  etcd: "etcd",
  keeper: "Leasehold on a keeper's stream",
};

export interface CycleFigures {
  system: System;
  concurrency: number;
  cyclesPerSec: number;
  contendedPerSec: number;
  p50Ms: number;
  p99Ms: number;
  acquireP50Ms: number;
  acquireP99Ms: number;
  errors: number;
  /** Cores busy during the window, per process group; `other` is the rest of the machine. */
  cpuCores: Record<string, number>;
  /** CPU milliseconds per completed cycle, per process group. */
  cpuMsPerCycle: Record<string, number>;
  databaseStatementsPerSec: number;
  walSyncsPerSec: number;
  etcdWalFsyncsPerSec?: number;
  /** Every window, for anyone who wants the spread. */
  windows: { cyclesPerSec: number; p50Ms: number; p99Ms: number; otherCpu: number }[];
}

/** Which Leasehold is measured: unary calls (scenario 1) or a keeper's stream (the keepers scenario). */
export interface CycleRun {
  id: string;
  scenario: string;
  lead: "leasehold" | "keeper";
}

const unaryCycles: CycleRun = { id: "cycles", scenario: "1 acquire→release", lead: "leasehold" };

export async function runCycles(
  ctx: BenchContext,
  run: CycleRun = unaryCycles,
): Promise<ScenarioReport> {
  const { settings, systems } = ctx;
  const present: System[] = [run.lead, "sql"];
  if (settings.storeBaseline && run.lead === "leasehold") present.push("store");
  if (systems.etcd) present.push("etcd");
  const targetOf = (system: System): CycleTarget => {
    switch (system) {
      case "leasehold":
        return { kind: "service", urls: ctx.serverUrls };
      case "sql":
        return { kind: "sql", databaseUrl: systems.postgres.url };
      case "store":
        return { kind: "store", databaseUrl: systems.postgres.url };
      case "etcd":
        return { kind: "etcd", url: systems.etcd?.url ?? "" };
      case "keeper":
        return { kind: "keeper", urls: ctx.serverUrls };
    }
  };

  const figures: CycleFigures[] = [];
  const profileWindows: [number, number][] = [];
  const profiled = Math.max(...settings.concurrencies);
  for (const concurrency of settings.concurrencies) {
    const runs = new Map<System, Measured<CycleResult>[]>(present.map((s) => [s, []]));
    for (let round = 1; round <= settings.rounds; round++) {
      for (const system of present) {
        ctx.progress(
          `${run.scenario} · c=${concurrency} · ${labels[system]} · round ${round}/${settings.rounds}`,
        );
        const options: CycleOptions = {
          target: targetOf(system),
          concurrency,
          keys: settings.keys,
          ttlSeconds: settings.ttlSeconds,
          accountId: `bench-${run.id}-${system}`,
          warmupMs: settings.warmupMs,
          windowMs: settings.windowMs,
        };
        const measured = await measureLoad<CycleResult>(systems, "load-cycles.ts", options);
        if (measured.load.errors > 0) {
          process.stderr.write(
            `\n${labels[system]} c=${concurrency}: ${measured.load.errors} errors, first: ${measured.load.firstError}\n`,
          );
        }
        runs.get(system)?.push(measured);
        if (system === run.lead && concurrency === profiled) profileWindows.push(measured.window);
      }
    }
    for (const system of present) {
      figures.push(cycleFigures(system, concurrency, runs.get(system) ?? []));
    }
  }
  return {
    ...report(ctx, figures, run),
    profile: {
      label: `${run.scenario}, ${labels[run.lead]} at c=${profiled}`,
      windows: profileWindows,
    },
  };
}

/** The figures of one system at one concurrency: medians of its windows. */
export function cycleFigures(
  system: System,
  concurrency: number,
  r: Measured<CycleResult>[],
): CycleFigures {
  const cpuKeys = Object.keys(r[0]?.cpu ?? {});
  const cpuCores = Object.fromEntries(cpuKeys.map((k) => [k, medianOf(r, (m) => m.cpu[k] ?? 0)]));
  return {
    system,
    concurrency,
    cyclesPerSec: medianOf(r, (m) => m.load.cyclesPerSec),
    contendedPerSec: medianOf(r, (m) => m.load.contendedPerSec),
    p50Ms: medianOf(r, (m) => m.load.cycle.p50Ms),
    p99Ms: medianOf(r, (m) => m.load.cycle.p99Ms),
    acquireP50Ms: medianOf(r, (m) => m.load.acquire.p50Ms),
    acquireP99Ms: medianOf(r, (m) => m.load.acquire.p99Ms),
    errors: r.reduce((sum, m) => sum + m.load.errors, 0),
    cpuCores,
    cpuMsPerCycle: Object.fromEntries(
      cpuKeys
        .filter((k) => k !== "machine" && k !== "other")
        .map((k) => [
          k,
          Math.round(medianOf(r, (m) => ((m.cpu[k] ?? 0) / m.load.cyclesPerSec) * 1000) * 1000) /
            1000,
        ]),
    ),
    databaseStatementsPerSec: medianOf(r, (m) => m.database.statementsPerSec),
    walSyncsPerSec: medianOf(r, (m) => m.database.walSyncsPerSec),
    etcdWalFsyncsPerSec:
      system === "etcd" ? medianOf(r, (m) => m.etcdWalFsyncsPerSec ?? Number.NaN) : undefined,
    windows: r.map((m) => ({
      cyclesPerSec: m.load.cyclesPerSec,
      p50Ms: m.load.cycle.p50Ms,
      p99Ms: m.load.cycle.p99Ms,
      otherCpu: m.cpu.other ?? Number.NaN,
    })),
  };
}

function report(ctx: BenchContext, figures: CycleFigures[], run: CycleRun): ScenarioReport {
  const { scenario } = run;
  const rows: Row[] = [];
  const comparisons: Comparison[] = [];
  const targets: ScenarioReport["targets"] = [];
  for (const concurrency of ctx.settings.concurrencies) {
    const get = (s: System) => figures.find((f) => f.system === s && f.concurrency === concurrency);
    const service = get(run.lead);
    const sql = get("sql");
    const store = get("store");
    const etcd = get("etcd");
    if (!service || !sql) continue;
    const load = `c=${concurrency}, ${ctx.settings.keys} keys`;
    const add = (metric: string, value: (f: CycleFigures) => number, higher: boolean) => {
      const out: Comparison[] = [
        compare(scenario, load, metric, value(service), "raw SQL", value(sql), higher),
      ];
      if (etcd)
        out.push(compare(scenario, load, metric, value(service), "etcd", value(etcd), higher));
      comparisons.push(...out);
      return out;
    };
    const [rateSql, rateEtcd] = add("cycles/s", (f) => f.cyclesPerSec, true);
    const [p50Sql, p50Etcd] = add("cycle p50 ms", (f) => f.p50Ms, false);
    const [p99Sql, p99Etcd] = add("cycle p99 ms", (f) => f.p99Ms, false);
    const pair = (f: CycleFigures | undefined) =>
      f ? `${fmtMs(f.p50Ms)} / ${fmtMs(f.p99Ms)}` : undefined;
    const ratioPair = (a?: Comparison, b?: Comparison) =>
      a && b ? `${fmtRatio(a.ratio)} / ${fmtRatio(b.ratio)}` : undefined;
    rows.push({
      scenario,
      load,
      metric: "cycles/s",
      leasehold: fmtRate(service.cyclesPerSec),
      sql: fmtRate(sql.cyclesPerSec),
      vsSql: fmtRatio(rateSql?.ratio),
      etcd: etcd ? fmtRate(etcd.cyclesPerSec) : undefined,
      vsEtcd: fmtRatio(rateEtcd?.ratio),
    });
    rows.push({
      scenario,
      load,
      metric: "p50 / p99 ms",
      leasehold: pair(service) ?? "",
      sql: pair(sql),
      vsSql: ratioPair(p50Sql, p99Sql),
      etcd: pair(etcd),
      vsEtcd: ratioPair(p50Etcd, p99Etcd),
    });
    // CPU per cycle, per process, says what a cycle costs and holds up far
    // better than throughput when other work shares the machine; that
    // other work (in cores) is in brackets.
    const perCycle = (f: CycleFigures | undefined, keys: string[]) =>
      f
        ? `${keys.map((k) => (f.cpuMsPerCycle[k] ?? 0).toFixed(2)).join("+")} [${(f.cpuCores.other ?? 0).toFixed(1)}]`
        : undefined;
    rows.push({
      scenario,
      load,
      metric: "CPU ms/cycle: system+gen [other]",
      leasehold: perCycle(service, ["server", "postgres", "load"]) ?? "",
      sql: perCycle(sql, ["postgres", "load"]),
      etcd: perCycle(etcd, ["etcd", "load"]),
    });
    if (store) {
      const c = compare(
        scenario,
        load,
        "store SQL cycles/s",
        store.cyclesPerSec,
        "raw SQL",
        sql.cyclesPerSec,
        true,
      );
      comparisons.push(c);
      rows.push({
        scenario,
        load,
        metric: "store SQL without RPC, cycles/s",
        leasehold: fmtRate(store.cyclesPerSec),
        sql: fmtRate(sql.cyclesPerSec),
        vsSql: fmtRatio(c.ratio),
      });
    }
    // The targets of the fast path (docs/design.md, "The unary fast path").
    if (concurrency === 32 && rateSql) {
      targets.push({
        scenario,
        target: "cycles/s at c=32 ≥ 1.0× the raw-SQL limit",
        measured: `${rateSql.ratio.toFixed(2)}×`,
        met: rateSql.ratio >= 1,
      });
    }
    if (concurrency === 32) {
      targets.push({
        scenario,
        target: "cycles/s at c=32 ≥ 4× etcd",
        measured: rateEtcd ? `${rateEtcd.ratio.toFixed(2)}×` : "etcd not measured",
        met: rateEtcd ? rateEtcd.ratio >= 4 : null,
      });
    }
    // The unary fast path's own targets (docs/design.md, "The unary fast path").
    if (concurrency === 32 && run.lead === "leasehold") {
      const serverMs = service.cpuMsPerCycle.server ?? 0;
      targets.push({
        scenario,
        target: "server CPU per cycle at c=32 ≤ 0.4 ms",
        measured: `${serverMs.toFixed(2)} ms`,
        met: serverMs <= 0.4,
      });
      const pgMs = service.cpuMsPerCycle.postgres ?? 0;
      const rawPgMs = sql.cpuMsPerCycle.postgres ?? 0;
      targets.push({
        scenario,
        target: "PostgreSQL CPU per cycle at c=32 ≤ the raw SQL's",
        measured: `${pgMs.toFixed(2)} ms against ${rawPgMs.toFixed(2)} ms`,
        met: pgMs <= rawPgMs,
      });
    }
    if (concurrency === 1) {
      targets.push({
        scenario,
        target: "cycle p50 at c=1 ≤ 1.5× the raw SQL's",
        measured: `${fmtMs(service.p50Ms)} ms against ${fmtMs(sql.p50Ms)} ms (${(service.p50Ms / sql.p50Ms).toFixed(2)}×)`,
        met: service.p50Ms <= 1.5 * sql.p50Ms,
      });
    }
  }
  const name = run.lead === "keeper" ? "acquire → release on a keeper" : "acquire → release cycles";
  return { id: run.id, name, figures, rows, comparisons, targets };
}
