// Runs the `leasehold` command as its own process, the way a user does.

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { createInterface } from "node:readline";
import { cliPath, repoRoot } from "./server.js";

export interface CliResult {
  code: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
}

/** A running `leasehold` process whose output lines can be awaited. */
export interface CliProcess {
  child: ChildProcess;
  /** Every stdout line so far. */
  lines: string[];
  /**
   * Resolves with the first stdout line (already seen or future) that
   * matches, from line number `from` on (0: every line).
   */
  line(match: RegExp, from?: number): Promise<string>;
  /** Resolves when the process exits. */
  exited: Promise<CliResult>;
}

export function startCli(args: string[], env: NodeJS.ProcessEnv = {}): CliProcess {
  const child = spawn(process.execPath, [cliPath, ...args], {
    cwd: repoRoot,
    env: { ...process.env, LEASEHOLD_SERVER: "", LEASEHOLD_TOKEN: "", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  const lines: string[] = [];
  const waiters: { match: RegExp; resolve: (line: string) => void }[] = [];
  let stdout = "";
  let stderr = "";
  child.stdout?.setEncoding("utf8");
  child.stderr?.setEncoding("utf8");
  child.stdout?.on("data", (chunk: string) => {
    stdout += chunk;
  });
  child.stderr?.on("data", (chunk: string) => {
    stderr += chunk;
  });
  if (child.stdout) {
    createInterface({ input: child.stdout }).on("line", (line) => {
      lines.push(line);
      for (const w of [...waiters]) {
        if (w.match.test(line)) {
          waiters.splice(waiters.indexOf(w), 1);
          w.resolve(line);
        }
      }
    });
  }
  const exited = once(child, "close").then(([code, signal]) => ({
    code: code as number | null,
    signal: signal as NodeJS.Signals | null,
    stdout,
    stderr,
  }));
  return {
    child,
    lines,
    line: (match, from = 0) => {
      const seen = lines.slice(from).find((l) => match.test(l));
      if (seen !== undefined) return Promise.resolve(seen);
      return new Promise((resolve, reject) => {
        waiters.push({ match, resolve });
        void exited.then((r) =>
          reject(new Error(`leasehold exited (${r.code}) before printing ${match}: ${r.stderr}`)),
        );
      });
    },
    exited,
  };
}

/** Runs `leasehold` to completion. */
export function runCli(args: string[], env: NodeJS.ProcessEnv = {}): Promise<CliResult> {
  return startCli(args, env).exited;
}
