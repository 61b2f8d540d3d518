// `leasehold serve` as a separate OS process, on a real socket. Shared by the
// tests (spawnServer) and the benchmark, which both need servers that do not
// share a CPU-bound event loop with the code driving them.

import { type ChildProcess, spawn } from "node:child_process";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const repoRoot = fileURLToPath(new URL("../../", import.meta.url));
export const cliPath = fileURLToPath(new URL("../../bin/leasehold.js", import.meta.url));

export interface ServerProcess {
  url: string;
  child: ChildProcess;
  /** Everything it wrote to stdout and stderr so far. */
  output(): string;
  /** SIGTERM and wait for exit. */
  stop(): Promise<void>;
  /** SIGKILL and wait for exit. */
  kill(): Promise<void>;
}

export interface SpawnOptions {
  /** The command and its flags, e.g. ["serve", "--listen", "127.0.0.1:0", …]. */
  argv: string[];
  env?: NodeJS.ProcessEnv;
  /** Flags for node itself, e.g. --cpu-prof. */
  nodeArgs?: string[];
  /** Another checkout's bin/leasehold.js (to compare builds); default this one. */
  cli?: string;
  /**
   * How long to wait for the "serving on" line (default 90 s: a fresh
   * embedded database's initdb and start on two busy cores take seconds).
   * A server that has not served by then is stopped, and the error carries
   * everything it wrote.
   */
  startTimeoutMs?: number;
}

/** How long stop() and kill() wait for the process to exit before they fail. */
const exitTimeoutMs = 60_000;

/** Runs a `leasehold` server command and resolves with the URL it reports serving on. */
export async function spawnLeasehold(options: SpawnOptions): Promise<ServerProcess> {
  const cli = options.cli ?? cliPath;
  const child = spawn(process.execPath, [...(options.nodeArgs ?? []), cli, ...options.argv], {
    cwd: path.dirname(path.dirname(cli)),
    env: { ...process.env, LEASEHOLD_LOG_LEVEL: "warn", ...options.env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  // Both streams, kept whole: pino logs to stdout, the "serving on" line and
  // start errors go to stderr.
  let output = "";
  child.stdout?.on("data", (chunk: Buffer) => {
    output += chunk.toString();
  });
  let stderr = "";
  child.stderr?.on("data", (chunk: Buffer) => {
    stderr += chunk.toString();
    output += chunk.toString();
  });
  const startTimeoutMs = options.startTimeoutMs ?? 90_000;
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const described = () =>
    `\`leasehold ${options.argv.join(" ")}\` (pid ${child.pid}); its output:\n${output || "(none)"}`;
  const url = await new Promise<string>((resolve, reject) => {
    const done = () => {
      clearTimeout(timer);
      child.stderr?.off("data", onData);
      child.off("exit", onExit);
    };
    const onData = () => {
      const m = /serving on (http:\/\/\S+)/.exec(stderr);
      if (m?.[1]) {
        done();
        resolve(m[1]);
      }
    };
    const onExit = (code: number | null, signal: NodeJS.Signals | null) => {
      done();
      reject(new Error(`server exited with ${signal ?? code} before serving: ${described()}`));
    };
    const timer = setTimeout(() => {
      done();
      // SIGTERM lets it stop what it started (its PostgreSQL); SIGKILL if not.
      child.kill("SIGTERM");
      const kill = setTimeout(() => child.kill("SIGKILL"), 10_000);
      void exited.then(() => {
        clearTimeout(kill);
        reject(
          new Error(
            `server did not report serving within ${startTimeoutMs / 1000}s: ${described()}`,
          ),
        );
      });
    }, startTimeoutMs);
    child.stderr?.on("data", onData);
    child.once("exit", onExit);
  });
  const stopped = async (how: NodeJS.Signals) => {
    if (child.exitCode === null && child.signalCode === null) child.kill(how);
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<"late">((resolve) => {
      timer = setTimeout(() => resolve("late"), exitTimeoutMs);
    });
    const result = await Promise.race([exited, late]);
    clearTimeout(timer);
    if (result === "late") {
      child.kill("SIGKILL");
      throw new Error(
        `server did not exit within ${exitTimeoutMs / 1000}s of ${how} (killed): ${described()}`,
      );
    }
  };
  return {
    url,
    child,
    output: () => output,
    stop: () => stopped("SIGTERM"),
    kill: () => stopped("SIGKILL"),
  };
}
