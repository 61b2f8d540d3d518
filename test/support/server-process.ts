// `leasehold serve` as a separate OS process, on a real socket. Shared by the
// tests (spawnServer) and the benchmark, which both need servers that do not
// share a CPU-bound event loop with the code driving them.

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
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
}

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
  const url = await new Promise<string>((resolve, reject) => {
    const onData = () => {
      const m = /serving on (http:\/\/\S+)/.exec(stderr);
      if (m?.[1]) {
        child.stderr?.off("data", onData);
        child.off("exit", onExit);
        resolve(m[1]);
      }
    };
    const onExit = (code: number | null) =>
      reject(new Error(`server exited with ${code}: ${stderr}`));
    child.stderr?.on("data", onData);
    child.once("exit", onExit);
  });
  const exited = child.exitCode === null ? once(child, "exit") : Promise.resolve();
  return {
    url,
    child,
    output: () => output,
    stop: async () => {
      if (child.exitCode === null) child.kill("SIGTERM");
      await exited;
    },
    kill: async () => {
      if (child.exitCode === null) child.kill("SIGKILL");
      await exited;
    },
  };
}
