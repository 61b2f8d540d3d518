// What a benchmark runs against: an embedded PostgreSQL of its own (with
// pg_stat_statements, so statements can be counted) and Leasehold servers as
// separate processes, as in production. Also the /proc readings behind the
// CPU and memory figures.

import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { once } from "node:events";
import { appendFileSync } from "node:fs";
import { readdir, readFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import postgres from "postgres";
import {
  type EmbeddedDatabase,
  makeDataParent,
  startEmbeddedPostgres,
} from "../../src/postgres/embedded-postgres.js";

const cliPath = fileURLToPath(new URL("../../bin/leasehold.js", import.meta.url));
const repoRoot = fileURLToPath(new URL("../../", import.meta.url));

export interface BenchDatabase {
  /** URL of a fresh database for this run. */
  url: string;
  /** A small pool on that database for the benchmark's own queries. */
  sql: postgres.Sql;
  /** The postmaster's process id (its children are the backends). */
  postmasterPid: number;
  stop(): Promise<void>;
}

export async function startBenchDatabase(name = "leasehold_bench"): Promise<BenchDatabase> {
  const dir = await makeDataParent("leasehold-bench-");
  const pgLog = process.env.BENCH_PG_LOG;
  const embedded: EmbeddedDatabase = await startEmbeddedPostgres({
    dataDir: path.join(dir, "pgdata"),
    ephemeral: true,
    // Diagnostics (bench/README.md, "Profiling"): PostgreSQL's log to a file.
    ...(pgLog ? { onLog: (m: string) => appendFileSync(pgLog, m) } : {}),
    settings: [
      "shared_preload_libraries=pg_stat_statements",
      "pg_stat_statements.track=all",
      // pg_stat_wal's flush times, read by the KeepAlive scenario.
      "track_wal_io_timing=on",
      ...(process.env.BENCH_PG_SETTINGS ?? "").split(" ").filter(Boolean),
    ],
  });
  const admin = postgres(embedded.url, { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE DATABASE ${name}`);
  await admin.end();
  const url = embedded.urlFor(name);
  const sql = postgres(url, { max: 2, onnotice: () => {} });
  await sql`CREATE EXTENSION IF NOT EXISTS pg_stat_statements`;
  const pidText = await readFile(path.join(embedded.dataDir, "postmaster.pid"), "utf8");
  return {
    url,
    sql,
    postmasterPid: Number(pidText.split("\n")[0]),
    stop: async () => {
      await sql.end({ timeout: 1 });
      await embedded.stop();
    },
  };
}

export interface ServerProcess {
  url: string;
  pid: number;
  child: ChildProcess;
  stop(): Promise<void>;
}

/**
 * Runs `leasehold serve` as its own process; resolves once it listens. `cli`
 * is another checkout's bin/leasehold.js (`npm run bench -- --server-cli`).
 */
export async function spawnLeasehold(
  databaseUrl: string,
  args: string[] = [],
  cli: string = cliPath,
): Promise<ServerProcess> {
  // BENCH_SERVER_NODE_ARGS="--cpu-prof --cpu-prof-dir=prof" profiles the server.
  const nodeArgs = (process.env.BENCH_SERVER_NODE_ARGS ?? "").split(" ").filter(Boolean);
  const child = spawn(
    process.execPath,
    [...nodeArgs, cli, "serve", "--listen", "127.0.0.1:0", "--database-url", databaseUrl, ...args],
    {
      cwd: cli === cliPath ? repoRoot : path.dirname(path.dirname(cli)),
      env: { ...process.env, LEASEHOLD_LOG_LEVEL: "warn" },
      stdio: ["ignore", "pipe", "pipe"],
    },
  );
  let stderr = "";
  const url = await new Promise<string>((resolve, reject) => {
    const onData = (chunk: Buffer) => {
      stderr += chunk.toString();
      const m = /serving on (http:\/\/\S+)/.exec(stderr);
      if (m?.[1]) {
        child.stderr?.off("data", onData);
        resolve(m[1]);
      }
    };
    child.stderr?.on("data", onData);
    child.once("exit", (code) => reject(new Error(`server exited with ${code}: ${stderr}`)));
  });
  // BENCH_SERVER_STDOUT keeps what the server prints (e.g. under --trace-gc).
  const stdoutFile = process.env.BENCH_SERVER_STDOUT;
  if (stdoutFile) child.stdout?.on("data", (chunk: Buffer) => appendFileSync(stdoutFile, chunk));
  else child.stdout?.resume();
  child.stderr?.resume();
  const exited = once(child, "exit");
  return {
    url,
    pid: child.pid ?? 0,
    child,
    stop: async () => {
      if (child.exitCode === null) child.kill("SIGTERM");
      await exited;
    },
  };
}

const clockTicks = (() => {
  try {
    return Number(execFileSync("getconf", ["CLK_TCK"]).toString().trim()) || 100;
  } catch {
    return 100;
  }
})();

/** CPU seconds (user + system) a process has used, from /proc/PID/stat. */
export async function cpuSeconds(pid: number): Promise<number> {
  const stat = await readFile(`/proc/${pid}/stat`, "utf8");
  // Fields after the command name, which is in parentheses and may hold spaces.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(fields[11]) + Number(fields[12])) / clockTicks;
}

/** Resident memory of a process in bytes, from /proc/PID/status. */
export async function rssBytes(pid: number): Promise<number> {
  const status = await readFile(`/proc/${pid}/status`, "utf8");
  const m = /VmRSS:\s+(\d+) kB/.exec(status);
  return m ? Number(m[1]) * 1024 : 0;
}

/** CPU seconds of a process and all its direct children (PostgreSQL backends). */
export async function treeCpuSeconds(parentPid: number): Promise<number> {
  let total = await cpuSeconds(parentPid).catch(() => 0);
  for (const entry of await readdir("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = await readFile(`/proc/${entry}/stat`, "utf8");
      const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      if (Number(fields[1]) === parentPid) {
        total += (Number(fields[11]) + Number(fields[12])) / clockTicks;
      }
    } catch {
      // The process ended while being read.
    }
  }
  return total;
}

/** The q-quantile (0..1) of samples, by nearest rank. */
export function quantile(sorted: Float64Array, q: number): number {
  if (sorted.length === 0) return Number.NaN;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1));
  return sorted[i] ?? Number.NaN;
}
