// Running a command while a lease is held, for `leasehold run` and
// `leasehold elect`: CMD gets the lease's fencing token and run id in its
// environment, SIGTERM when the lease is lost (L2: the signal aborts before
// the database deadline), then SIGKILL after a grace; handoff requests are
// reported (and passed on as a signal when asked).

import { type ChildProcess, spawn } from "node:child_process";
import os from "node:os";
import { LeaseLostError } from "../client/index.js";
import type { HandoffRequested } from "../gen/leasehold/v1/lease_pb.js";
import { ExitCode, UsageError } from "./common.js";

/** The signals passed on to CMD. */
export const forwardedSignals = ["SIGINT", "SIGTERM", "SIGHUP"] as const;

/** The exit code of a process killed by `signal`: 128 + its number. */
export function signalExitCode(signal: NodeJS.Signals): number {
  return 128 + (os.constants.signals[signal] ?? 0);
}

/** Reads a signal flag (SIGUSR1 or USR1); a bad name is a UsageError naming the flag. */
export function checkSignal(name: string, value: string | undefined): NodeJS.Signals | undefined {
  if (value === undefined) return undefined;
  const signal = value.toUpperCase().startsWith("SIG")
    ? value.toUpperCase()
    : `SIG${value.toUpperCase()}`;
  if (!(signal in os.constants.signals)) {
    throw new UsageError(
      `--${name} must be a signal name such as SIGUSR1, got ${JSON.stringify(value)}`,
    );
  }
  return signal as NodeJS.Signals;
}

/** CMD could not be started at all (not found, not executable). */
export class SpawnError extends Error {
  override readonly name = "SpawnError";
}

/** What a supervised command runs under: a lease's context or a leadership. */
export interface Holding {
  readonly signal: AbortSignal;
  onHandoffRequested(listener: (request: HandoffRequested) => void): () => void;
}

export interface SuperviseOptions {
  file: string;
  args: string[];
  /** Added to the process's environment (the LEASEHOLD_* variables). */
  env: Record<string, string>;
  graceMs: number;
  handoffSignal: NodeJS.Signals | undefined;
  /** What is held, for messages: "lease on acme/s2", "leadership of acme/e". */
  what: string;
  say(line: string): void;
  /** Told the child as soon as it is spawned (signals are passed on to it). */
  onSpawn(child: ChildProcess): void;
}

/**
 * Runs CMD while `holding` lasts; resolves with its exit code (128+N when
 * killed by signal N), rejects with SpawnError when it cannot start.
 */
export function superviseCommand(holding: Holding, options: SuperviseOptions): Promise<number> {
  const { file, args, graceMs, say } = options;
  return new Promise<number>((resolve, reject) => {
    const started = spawn(file, args, {
      stdio: "inherit",
      env: { ...process.env, ...options.env },
    });
    options.onSpawn(started);
    let killTimer: NodeJS.Timeout | undefined;
    started.once("error", (error) => {
      reject(new SpawnError(`cannot start ${JSON.stringify(file)}: ${error.message}`));
    });
    started.once("exit", (code, signal) => {
      clearTimeout(killTimer);
      resolve(code ?? (signal ? signalExitCode(signal) : ExitCode.failure));
    });
    const stop = () => {
      if (started.exitCode !== null || started.signalCode !== null) return;
      const reason: unknown = holding.signal.reason;
      const why = reason instanceof LeaseLostError ? reason.message : "the run was interrupted";
      say(`${options.what} lost: ${why}; stopping ${file} (SIGTERM)`);
      started.kill("SIGTERM");
      killTimer = setTimeout(() => {
        if (started.exitCode !== null || started.signalCode !== null) return;
        say(`${file} did not exit within ${graceMs}ms of SIGTERM; sending SIGKILL`);
        started.kill("SIGKILL");
      }, graceMs);
    };
    if (holding.signal.aborted) stop();
    else holding.signal.addEventListener("abort", stop, { once: true });
    holding.onHandoffRequested((request) => {
      const by =
        request.requesterHolder === "" ? "another holder" : JSON.stringify(request.requesterHolder);
      const why = request.reason === "" ? "" : `: ${request.reason}`;
      say(`handoff requested by ${by}${why}`);
      if (options.handoffSignal) started.kill(options.handoffSignal);
    });
  });
}
