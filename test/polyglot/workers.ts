// The example workers of examples/python and examples/go as child processes.
// Each prints one JSON object per line on stdout; a test waits for the line
// it expects (never a guessed sleep), each wait bounded by a deadline, and a
// failed wait shows everything the worker said.

import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import { once } from "node:events";
import path from "node:path";
import { createInterface } from "node:readline";
import type { SessionKey } from "../../src/lease/types.js";
import { repoRoot } from "../support/server-process.js";

export type Language = "python" | "go";

export const languages: readonly Language[] = ["python", "go"];

/** How each worker is started: the Python client's venv (clients/python/scripts/setup.sh), or the binary examples/go/build.sh made. */
const commands: Record<Language, { file: string; args: string[] }> = {
  python: {
    file: path.join(repoRoot, "clients/python/.venv/bin/python"),
    args: [path.join(repoRoot, "examples/python/worker.py")],
  },
  go: { file: path.join(repoRoot, "examples/go/gen/bin/worker"), args: [] },
};

/** One line a worker printed. Tokens are decimal strings (int64), as in protobuf's JSON. */
export interface WorkerEvent {
  event: string;
  lang: Language;
  holder: string;
  run_id: string;
  /** Milliseconds since the worker started, on its monotonic clock. */
  t_ms: number;
  [field: string]: unknown;
}

export interface WorkerOptions {
  lang: Language;
  /** Lease server, host:port. */
  server: string;
  /** Guarded store, host:port. */
  store: string;
  key: SessionKey;
  holder: string;
  ttlMs: number;
  marginMs?: number;
  waitMs?: number;
  writes?: number;
  writeEveryMs?: number;
}

const defaultWaitMs = 20_000;

export class WorkerProcess {
  readonly events: WorkerEvent[] = [];
  readonly exited: Promise<unknown>;
  private stderr = "";
  private readonly listeners = new Set<() => void>();

  constructor(
    readonly options: WorkerOptions,
    private readonly child: ChildProcessWithoutNullStreams,
  ) {
    this.exited = child.exitCode === null ? once(child, "exit") : Promise.resolve();
    child.stderr.on("data", (chunk: Buffer) => {
      this.stderr += chunk.toString();
    });
    createInterface({ input: child.stdout }).on("line", (line) => {
      let parsed: WorkerEvent;
      try {
        parsed = JSON.parse(line) as WorkerEvent;
      } catch {
        this.stderr += `(not JSON on stdout) ${line}\n`;
        return;
      }
      this.events.push(parsed);
      for (const listener of this.listeners) listener();
    });
    child.on("exit", () => {
      for (const listener of this.listeners) listener();
    });
  }

  get name(): string {
    return `${this.options.lang} worker ${JSON.stringify(this.options.holder)}`;
  }

  /** Sends a command of the worker's --control protocol. */
  send(command: "go" | "late-write" | "quit"): void {
    this.child.stdin.write(`${command}\n`);
  }

  /**
   * The first event, already printed or still to come, for which `matches`
   * holds. Rejects after `timeoutMs`, or as soon as the worker exits without
   * printing it.
   */
  waitFor(
    description: string,
    matches: (e: WorkerEvent) => boolean,
    timeoutMs = defaultWaitMs,
  ): Promise<WorkerEvent> {
    return new Promise((resolve, reject) => {
      const check = () => {
        const found = this.events.find(matches);
        if (found) {
          done();
          resolve(found);
        } else if (this.child.exitCode !== null || this.child.signalCode !== null) {
          done();
          reject(
            this.failure(
              `exited (${this.child.exitCode ?? this.child.signalCode}) before ${description}`,
            ),
          );
        }
      };
      const timer = setTimeout(() => {
        done();
        reject(this.failure(`no ${description} within ${timeoutMs} ms`));
      }, timeoutMs);
      const done = () => {
        clearTimeout(timer);
        this.listeners.delete(check);
      };
      this.listeners.add(check);
      check();
    });
  }

  /** The first event named `event` (and matching `where`, if given). */
  next(
    event: string,
    where: (e: WorkerEvent) => boolean = () => true,
    timeoutMs = defaultWaitMs,
  ): Promise<WorkerEvent> {
    return this.waitFor(`"${event}" event`, (e) => e.event === event && where(e), timeoutMs);
  }

  /** The `count`-th event named `event`. */
  nth(event: string, count: number, timeoutMs = defaultWaitMs): Promise<WorkerEvent> {
    return this.waitFor(
      `${count} "${event}" events`,
      (e) =>
        e.event === event && this.events.filter((x) => x.event === event).indexOf(e) === count - 1,
      timeoutMs,
    );
  }

  /** Every event named `event` so far. */
  all(event: string): WorkerEvent[] {
    return this.events.filter((e) => e.event === event);
  }

  /** Kills the worker (if still running) and waits for it to exit. */
  async kill(): Promise<void> {
    if (this.child.exitCode === null && this.child.signalCode === null) this.child.kill("SIGKILL");
    await this.exited;
  }

  private failure(what: string): Error {
    const lines = this.events.map((e) => `  ${JSON.stringify(e)}`).join("\n");
    return new Error(
      `${this.name}: ${what}\nstdout:\n${lines || "  (nothing)"}\nstderr:\n${this.stderr || "  (nothing)"}`,
    );
  }
}

/** Starts a worker in --control mode: it connects, says `ready`, and waits for `go`. */
export function spawnWorker(options: WorkerOptions): WorkerProcess {
  const { file, args } = commands[options.lang];
  const flags = [
    "--control",
    "--server",
    options.server,
    "--store",
    options.store,
    "--account",
    options.key.accountId,
    "--session",
    options.key.sessionId,
    "--holder",
    options.holder,
    "--ttl-ms",
    String(options.ttlMs),
  ];
  const optional: [string, number | undefined][] = [
    ["--margin-ms", options.marginMs],
    ["--wait-ms", options.waitMs],
    ["--writes", options.writes],
    ["--write-every-ms", options.writeEveryMs],
  ];
  for (const [flag, value] of optional) {
    if (value !== undefined) flags.push(flag, String(value));
  }
  const child = spawn(file, [...args, ...flags], {
    cwd: repoRoot,
    // No bearer token: the servers run in development mode on loopback.
    env: { ...process.env, LEASEHOLD_TOKEN: "" },
    stdio: ["pipe", "pipe", "pipe"],
  });
  return new WorkerProcess(options, child);
}

/** A token field of an event as a bigint. */
export function token(e: WorkerEvent, field = "token"): bigint {
  const value = e[field];
  if (typeof value !== "string" || !/^\d+$/.test(value)) {
    throw new Error(`event ${e.event} has no decimal ${field}: ${JSON.stringify(e)}`);
  }
  return BigInt(value);
}
