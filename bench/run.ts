// `npm run bench`: starts embedded PostgreSQL, the lease server as separate
// processes and (when available) etcd, runs every scenario with its load
// generator as its own process, prints one table and writes
// bench/results/latest.json. See bench/README.md.

import { copyFile, mkdir, mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";
import { type ServerProcess, spawnLeasehold } from "../test/support/server-process.js";
import { serverStreams } from "./capabilities.js";
import type { BenchContext, BenchSettings, ScenarioReport } from "./context.js";
import { type ProfileSummary, summarizeProfile } from "./cpu-profile.js";
import { type EtcdServer, findEtcd, installEtcd, startEtcd } from "./etcd.js";
import { stopLoads } from "./load-protocol.js";
import { describeMachine, machineLine, packageVersions } from "./machine.js";
import { type BenchPostgres, startBenchPostgres } from "./postgres.js";
import { renderMarkdown, renderText } from "./report.js";
import { runContention } from "./scenario-contention.js";
import { runCycles } from "./scenario-cycles.js";
import { runKeepAlive } from "./scenario-keepalive.js";
import { runKeepers } from "./scenario-keepers.js";
import { runWatch } from "./scenario-watch.js";
import { failureSummary, notRunRows, runScenarios, type Scenario } from "./scenarios.js";
import { cleanupsOnSignal } from "./support/cleanups.js";

const usage = `Usage: npm run bench -- [flags]

  --quick            one short window per figure (under two minutes)
  --with-etcd        install Debian's etcd-server when etcd is missing (root only)
  --no-etcd          skip etcd even when it is installed
  --only LIST        scenarios to run, comma-separated: cycles,contention,keepalive,watch,keepers
  --servers N        lease server processes (default 1)
  --pool-size N      database connections per server (default 20, the server default)
  --rounds N         measured windows per figure (default 3, quick 1)
  --cpu-prof         run the servers under node --cpu-prof; print where their CPU went
                     (profiles kept as bench/results/server-PID.cpuprofile)
  --server-cli PATH  run the bin/leasehold.js of another checkout (to compare builds)
  --out FILE         where to write the JSON (default bench/results/latest.json)
`;

const resultsDir = new URL("results/", import.meta.url);
const readmeFile = new URL("README.md", import.meta.url);

async function main(): Promise<number> {
  const { values } = parseArgs({
    options: {
      quick: { type: "boolean", default: false },
      "with-etcd": { type: "boolean", default: false },
      "no-etcd": { type: "boolean", default: false },
      only: { type: "string" },
      servers: { type: "string", default: "1" },
      "pool-size": { type: "string", default: "20" },
      rounds: { type: "string" },
      "cpu-prof": { type: "boolean", default: false },
      "server-cli": { type: "string" },
      out: { type: "string" },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help) {
    process.stdout.write(usage);
    return 0;
  }
  const quick = values.quick;
  const settings: BenchSettings = {
    quick,
    rounds: Number(values.rounds ?? (quick ? 1 : 3)),
    warmupMs: quick ? 1_000 : 2_000,
    windowMs: quick ? 2_000 : 5_000,
    concurrencies: [1, 8, 32],
    keys: 1_000,
    ttlSeconds: 30,
    servers: Number(values.servers),
    poolSize: Number(values["pool-size"]),
    // The store baseline runs this checkout's SQL: meaningless against another build.
    storeBaseline: !quick && values["server-cli"] === undefined,
  };
  for (const [name, v] of Object.entries({
    rounds: settings.rounds,
    servers: settings.servers,
    "pool-size": settings.poolSize,
  })) {
    if (!Number.isInteger(v) || v < 1) throw new Error(`--${name} must be a positive integer`);
  }
  const only = values.only?.split(",").map((s) => s.trim());
  const wanted = (id: string) => !only || only.includes(id);

  const started = performance.now();
  const progress = (label: string) => {
    const s = Math.round((performance.now() - started) / 1000);
    const stamp = `[${String(Math.floor(s / 60)).padStart(2, "0")}:${String(s % 60).padStart(2, "0")}]`;
    if (process.stderr.isTTY) process.stderr.write(`\r\x1b[K${stamp} ${label}`);
    else process.stderr.write(`${stamp} ${label}\n`);
  };
  const log = (line: string) => {
    if (process.stderr.isTTY) process.stderr.write("\r\x1b[K");
    process.stderr.write(`${line}\n`);
  };

  const machine = describeMachine();
  log(`machine: ${machineLine(machine)}`);

  const cleanups = cleanupsOnSignal(log, "load generators, servers, etcd and PostgreSQL");

  try {
    progress("starting embedded PostgreSQL");
    const postgres: BenchPostgres = await startBenchPostgres({
      migrate: values["server-cli"] === undefined,
    });
    cleanups.push(() => postgres.stop());
    log(`postgres: ${postgres.version.split(" on ")[0]}`);
    log(
      `postgres settings: ${Object.entries(postgres.settings)
        .map(([k, v]) => `${k}=${v}`)
        .join(" ")}`,
    );

    let etcd: EtcdServer | undefined;
    let etcdSkipped: string | undefined;
    if (values["no-etcd"]) etcdSkipped = "--no-etcd";
    else {
      let binary = findEtcd();
      if (!binary && values["with-etcd"]) binary = await installEtcd(log);
      if (!binary) {
        etcdSkipped = values["with-etcd"]
          ? "etcd could not be installed (needs root and Debian's etcd-server)"
          : "no etcd binary (run with --with-etcd as root to install Debian's etcd-server)";
      } else {
        progress("starting etcd");
        etcd = await startEtcd(binary);
        const e = etcd;
        cleanups.push(() => e.stop());
        log(`etcd: ${e.version} on ${e.url}`);
      }
    }
    if (etcdSkipped) log(`etcd: skipped — ${etcdSkipped}`);

    progress(`starting ${settings.servers} lease server process(es)`);
    const profileDir = values["cpu-prof"]
      ? await mkdtemp(path.join(os.tmpdir(), "leasehold-bench-prof-"))
      : "";
    const serverArgs = [
      "--listen",
      "127.0.0.1:0",
      "--pool-size",
      String(settings.poolSize),
      "--shutdown-grace",
      "2s",
      // Scenario 4 opens up to 10,000 Watch streams on one account (default limit 100).
      "--max-watchers-per-account",
      "10000",
    ];
    const servers: ServerProcess[] = [];
    for (let i = 0; i < settings.servers; i++) {
      const server = await spawnLeasehold({
        argv: ["serve", "--database-url", postgres.url, ...serverArgs],
        nodeArgs: values["cpu-prof"] ? ["--cpu-prof", "--cpu-prof-dir", profileDir] : [],
        cli: values["server-cli"] && path.resolve(values["server-cli"]),
      });
      servers.push(server);
      cleanups.push(() => server.stop());
    }
    log(`servers: ${servers.map((s) => `${s.url} (pid ${s.child.pid})`).join(", ")}`);

    const ctx: BenchContext = {
      settings,
      systems: {
        postgres,
        etcd,
        serverPids: () => servers.flatMap((s) => (s.child.pid ? [s.child.pid] : [])),
      },
      serverUrls: servers.map((s) => s.url),
      serverCli: values["server-cli"] && path.resolve(values["server-cli"]),
      cpuProfileDir: values["cpu-prof"] ? profileDir : undefined,
      progress,
    };
    const streams = await serverStreams(ctx.serverUrls[0] as string);
    const noStreams = streams
      ? undefined
      : "the server answers Watch with UNIMPLEMENTED: no KeepAlive, Watch or Acquire wait";
    const scenarios: (Scenario & { streaming: boolean })[] = [
      { id: "cycles", scenario: "1 acquire→release", streaming: false, run: () => runCycles(ctx) },
      {
        id: "contention",
        scenario: "2 contention",
        streaming: true,
        run: () => runContention(ctx),
      },
      {
        id: "keepalive",
        scenario: "3 KeepAlive",
        streaming: true,
        run: () => runKeepAlive(ctx, etcd),
      },
      { id: "watch", scenario: "4 watch fan-out", streaming: true, run: () => runWatch(ctx) },
      { id: "keepers", scenario: "6 keepers", streaming: true, run: () => runKeepers(ctx) },
    ];
    // Load generators run in process groups of their own (load-protocol.ts):
    // a signal to the terminal's group does not reach them; this does, first.
    cleanups.push(() => stopLoads());
    const { reports, notRun } = await runScenarios(
      scenarios
        .filter((x) => wanted(x.id))
        .map((s) => (s.streaming && noStreams ? { ...s, skip: noStreams } : s)),
      log,
    );

    await cleanups.run();
    const profiles = values["cpu-prof"] ? await collectProfiles(profileDir, servers, reports) : [];
    machine.loadAverageAtEnd = Math.round((os.loadavg()[0] ?? 0) * 100) / 100;
    const rows = [...reports.flatMap((r) => r.rows), ...notRunRows(notRun)];
    const table = renderText(rows);
    const versions = {
      ...packageVersions(),
      // "postgres" is the postgres.js client, above.
      postgresql: postgres.version,
      etcd: etcd?.version ?? "not measured",
    };
    const seconds = Math.round((performance.now() - started) / 1000);
    log("");
    process.stdout.write(`Leasehold benchmark — ${machineLine(machine)}\n`);
    process.stdout.write(
      `${quick ? "quick: " : ""}${settings.rounds} window(s) of ${settings.windowMs / 1000} s after ${
        settings.warmupMs / 1000
      } s warm-up per figure, medians; ${settings.servers} server process(es), pool ${settings.poolSize}; ${seconds} s in all\n\n`,
    );
    process.stdout.write(`${table}\n\n`);
    const targets = reports.flatMap((r) => r.targets);
    for (const t of targets) {
      const verdict = t.met === null ? "n/a" : t.met ? "met" : "MISSED";
      process.stdout.write(`target ${verdict}: ${t.target} — measured ${t.measured}\n`);
    }
    if (etcdSkipped) process.stdout.write(`etcd skipped: ${etcdSkipped}\n`);
    for (const n of notRun) {
      process.stdout.write(
        `scenario ${n.scenario} ${n.failed ? "FAILED" : "skipped"}: ${n.reason}\n`,
      );
    }
    for (const p of profiles) process.stdout.write(`\n${describeProfile(p)}\n`);

    const results = {
      generatedAt: new Date().toISOString(),
      command: `npm run bench -- ${process.argv.slice(2).join(" ")}`.trim(),
      durationSeconds: seconds,
      machine,
      versions,
      settings: {
        ...settings,
        postgres: postgres.settings,
        serverArgs,
        serverCli: values["server-cli"] ?? "bin/leasehold.js",
        cpuProfile: values["cpu-prof"],
      },
      etcd: etcd ? { measured: true, url: etcd.url } : { measured: false, skipped: etcdSkipped },
      scenarios: Object.fromEntries(
        reports.map((r) => [r.id, { name: r.name, figures: r.figures }]),
      ),
      skipped: notRun,
      comparisons: reports.flatMap((r) => r.comparisons),
      targets,
      profiles,
      table,
    };
    await mkdir(resultsDir, { recursive: true });
    const out = values.out ?? new URL("latest.json", resultsDir).pathname;
    await writeFile(out, `${JSON.stringify(results, null, 2)}\n`);
    process.stdout.write(`\nwrote ${out}\n`);
    const failure = failureSummary(notRun);
    if (failure) {
      // Not recorded in bench/README.md: a failed run is no result.
      process.stderr.write(`\n${failure}\n`);
      return 1;
    }
    if (!quick && !only && !values.out) {
      await updateReadme(`${machineLine(machine)}\n\n${renderMarkdown(rows)}`, results.generatedAt);
    }
    return 0;
  } finally {
    await cleanups.run();
  }
}

interface ServerProfile {
  file: string;
  label: string;
  summary: ProfileSummary;
}

/**
 * Keeps each server's main-thread profile in bench/results (git-ignored) and
 * summarizes it over the windows the scenarios asked for.
 */
async function collectProfiles(
  dir: string,
  servers: ServerProcess[],
  reports: ScenarioReport[],
): Promise<ServerProfile[]> {
  const out: ServerProfile[] = [];
  const files = await readdir(dir);
  for (const server of servers) {
    // CPU.<date>.<time>.<pid>.<thread>.<seq>.cpuprofile; thread 0 is the main one
    // (tsx's loader runs in a worker thread of its own).
    const main = files.find(
      (f) => f.split(".")[3] === String(server.child.pid) && f.split(".")[4] === "0",
    );
    if (!main) continue;
    const file = new URL(`server-${server.child.pid}.cpuprofile`, resultsDir).pathname;
    await copyFile(path.join(dir, main), file);
    for (const r of reports) {
      if (!r.profile || r.profile.windows.length === 0) continue;
      out.push({
        file,
        label: r.profile.label,
        summary: await summarizeProfile(file, r.profile.windows),
      });
    }
  }
  for (const r of reports) {
    for (const p of r.serverProfiles ?? []) {
      const file = new URL(path.basename(p.file), resultsDir).pathname;
      await copyFile(p.file, file);
      out.push({ file, label: p.label, summary: await summarizeProfile(file, p.windows) });
    }
  }
  await rm(dir, { recursive: true, force: true });
  return out;
}

function describeProfile(p: ServerProfile): string {
  const pct = (x: number) => `${(x * 100).toFixed(1)}%`;
  return [
    `server CPU profile — ${p.label} (${p.file}): busy ${pct(p.summary.busyShare)} of ${p.summary.sampledMs} ms sampled`,
    `  by module: ${p.summary.byModule.map((m) => `${m.module} ${pct(m.share)}`).join(", ")}`,
    "  top self time:",
    ...p.summary.topFunctions.map((f) => `    ${pct(f.share).padStart(6)}  ${f.fn}`),
  ].join("\n");
}

/** Replaces the results section of bench/README.md after a full run. */
async function updateReadme(table: string, at: string): Promise<void> {
  const start = "<!-- results:start -->";
  const end = "<!-- results:end -->";
  let text: string;
  try {
    text = await readFile(readmeFile, "utf8");
  } catch {
    return;
  }
  const i = text.indexOf(start);
  const j = text.indexOf(end);
  if (i < 0 || j < i) return;
  const body = `${start}\nMeasured ${at.slice(0, 10)} on: ${table}\n${end}`;
  await writeFile(readmeFile, text.slice(0, i) + body + text.slice(j + end.length));
}

main().then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(
      `\nbench: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`,
    );
    process.exit(1);
  },
);
