// etcd, the peer a user would pick instead: found on PATH (Debian's
// etcd-server package), installed with apt when asked and allowed, started
// on loopback ports in a temporary data folder, stopped at the end.

import { type ChildProcess, execFile, spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { promisify } from "node:util";
import { freePort } from "../src/postgres/embedded-postgres.js";

const run = promisify(execFile);

export interface EtcdServer {
  url: string;
  version: string;
  pid(): number;
  /** Counters from etcd's own /metrics. */
  counters(): Promise<EtcdCounters>;
  /** Stops etcd, wipes its data and starts it again: a clean slate between runs. */
  restart(): Promise<void>;
  stop(): Promise<void>;
}

export interface EtcdCounters {
  at: number;
  walFsyncs: number;
}

export function findEtcd(): string | undefined {
  for (const dir of (process.env.PATH ?? "").split(":").concat("/usr/bin", "/usr/local/bin")) {
    const candidate = path.join(dir, "etcd");
    if (dir && existsSync(candidate)) return candidate;
  }
  return undefined;
}

/** Installs Debian's etcd-server; only as root, only when asked (--with-etcd). */
export async function installEtcd(log: (line: string) => void): Promise<string | undefined> {
  if (process.getuid?.() !== 0) {
    log("etcd: not installed and not root, so not installing it");
    return undefined;
  }
  log("etcd: apt-get update && apt-get install -y etcd-server");
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" };
  await run("apt-get", ["update"], { env, maxBuffer: 16 << 20 });
  await run("apt-get", ["install", "-y", "--no-install-recommends", "etcd-server"], {
    env,
    maxBuffer: 16 << 20,
  });
  return findEtcd();
}

export async function startEtcd(binary: string): Promise<EtcdServer> {
  const { stdout } = await run(binary, ["--version"]);
  const version = /etcd Version: (\S+)/.exec(stdout)?.[1] ?? stdout.trim();
  const clientPort = await freePort();
  const peerPort = await freePort();
  const url = `http://127.0.0.1:${clientPort}`;
  let dir = "";
  let child: ChildProcess | undefined;

  const start = async () => {
    dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-bench-etcd-"));
    const peer = `http://127.0.0.1:${peerPort}`;
    // Defaults otherwise, as a user would run a single member: fsync on, the
    // default snapshot count and heartbeat.
    const started = spawn(
      binary,
      [
        "--name=bench",
        `--data-dir=${dir}`,
        `--listen-client-urls=${url}`,
        `--advertise-client-urls=${url}`,
        `--listen-peer-urls=${peer}`,
        `--initial-advertise-peer-urls=${peer}`,
        `--initial-cluster=bench=${peer}`,
        "--logger=zap",
        "--log-level=error",
      ],
      { stdio: ["ignore", "ignore", "pipe"] },
    );
    let stderr = "";
    started.stderr?.on("data", (c: Buffer) => {
      stderr = (stderr + c.toString()).slice(-4000);
    });
    child = started;
    for (let i = 0; ; i++) {
      if (started.exitCode !== null) throw new Error(`etcd exited: ${stderr}`);
      try {
        const res = await fetch(`${url}/health`);
        if (res.ok && ((await res.json()) as { health?: string }).health === "true") return;
      } catch {
        // Not listening yet.
      }
      if (i > 200) throw new Error(`etcd did not become healthy: ${stderr}`);
      await new Promise((r) => setTimeout(r, 50));
    }
  };

  const stop = async () => {
    const c = child;
    if (c && c.exitCode === null) {
      const exited = once(c, "exit");
      c.kill("SIGTERM");
      await exited;
    }
    if (dir) await rm(dir, { recursive: true, force: true });
  };

  await start();
  return {
    url,
    version,
    pid: () => child?.pid ?? 0,
    counters: async () => {
      const text = await (await fetch(`${url}/metrics`)).text();
      const fsyncs = /^etcd_disk_wal_fsync_duration_seconds_count (\d+)/m.exec(text)?.[1];
      return { at: performance.now(), walFsyncs: Number(fsyncs ?? 0) };
    },
    restart: async () => {
      await stop();
      await start();
    },
    stop,
  };
}
