// How the orchestrator and a load generator process talk. The load generator
// runs as its own process (so its CPU is not the server's), gets its options
// as one JSON argument, and writes JSON lines on stdout: `measure` when the
// warm-up ends, `window-end` when the measured window closes, and finally
// `result`. The orchestrator samples CPU and database counters at the first
// two, so those figures cover exactly the measured window, and answers
// `window-end` with a line on stdin: until then the load generator keeps its
// connections, whose server-side processes (PostgreSQL backends) would
// otherwise be gone before their CPU time was read.
//
// Each load generator runs in a process group of its own, with whatever it
// starts (the KeepAlive scenario's servers and PostgreSQL): when it fails,
// times out or is stopped (stopLoads, when its scenario fails), the whole
// group is stopped, so nothing it started outlives it. A load generator
// that crashed used to leave its server and PostgreSQL running, busy for the
// rest of the run (issue 33).

import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";

export type LoadMessage =
  | { phase: "measure" }
  | { phase: "window-end" }
  | { phase: "result"; result: unknown };

export interface WindowTiming {
  warmupMs: number;
  windowMs: number;
}

/** Load generator side: reads the options passed by `runLoad`. */
export function loadOptions<T>(): T {
  const text = process.argv[2];
  if (!text) throw new Error("expected the load options as one JSON argument");
  return JSON.parse(text) as T;
}

/** The machine's clock in ms with the monotonic clock's resolution: comparable between processes. */
export const epochMs = () => performance.timeOrigin + performance.now();

export function send(message: LoadMessage): void {
  process.stdout.write(`${JSON.stringify(message)}\n`);
}

/**
 * Load generator side: the warm-up then the measured window, on the
 * monotonic clock. Work that ends inside the window counts; the load keeps
 * running until `stopped` so the window sees a steady state at both edges.
 */
export class MeasuredWindow {
  private start = Number.POSITIVE_INFINITY;
  private end = Number.POSITIVE_INFINITY;
  private cpuAtStart: NodeJS.CpuUsage | undefined;
  private cpuInWindow: NodeJS.CpuUsage | undefined;
  stopped = false;
  /** Resolves when the window closes. */
  readonly done: Promise<void>;

  constructor(timing: WindowTiming) {
    this.done = new Promise((resolve) => {
      setTimeout(() => {
        this.start = performance.now();
        this.cpuAtStart = process.cpuUsage();
        send({ phase: "measure" });
        setTimeout(() => {
          this.end = performance.now();
          this.cpuInWindow = process.cpuUsage(this.cpuAtStart);
          this.stopped = true;
          send({ phase: "window-end" });
          process.stdin.once("data", () => resolve());
        }, timing.windowMs);
      }, timing.warmupMs);
    });
  }

  /** Whether work that finished at `t` (performance.now()) is measured. */
  counts(t: number): boolean {
    return t >= this.start && t <= this.end;
  }

  get seconds(): number {
    return (this.end - this.start) / 1000;
  }

  /** CPU this process used in the window, in cores (1 = one core busy). */
  get cpuCores(): number {
    const cpu = this.cpuInWindow;
    if (!cpu) return Number.NaN;
    return (cpu.user + cpu.system) / 1e6 / this.seconds;
  }
}

export interface LoadHooks {
  /** The warm-up ended: take the "before" samples. */
  onMeasure?: () => void;
  /** The window closed: take the "after" samples. */
  onWindowEnd?: () => void;
  /** The child's pid, once started (to sample its CPU). */
  onStart?: (pid: number) => void;
}

const benchDir = fileURLToPath(new URL(".", import.meta.url));

/** Load generators running now, by process group id: each one's stop. */
const running = new Map<number, () => Promise<void>>();

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function groupAlive(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return true;
  } catch {
    return false;
  }
}

function signalGroup(pgid: number, signal: NodeJS.Signals) {
  try {
    process.kill(-pgid, signal);
  } catch {
    // The group is gone already.
  }
}

/**
 * Stops every process of a group: SIGTERM (PostgreSQL then shuts down
 * cleanly), SIGKILL for what is left after `graceMs`. Bounded: a process
 * that stays (a zombie nobody reaps) is given up on after a second more.
 */
export async function stopGroup(pgid: number, graceMs = 5_000): Promise<void> {
  if (!groupAlive(pgid)) return;
  signalGroup(pgid, "SIGTERM");
  for (const end = performance.now() + graceMs; groupAlive(pgid) && performance.now() < end; ) {
    await sleep(50);
  }
  if (!groupAlive(pgid)) return;
  signalGroup(pgid, "SIGKILL");
  for (const end = performance.now() + 1_000; groupAlive(pgid) && performance.now() < end; ) {
    await sleep(20);
  }
}

/**
 * Stops every load generator still running, each with everything it
 * started; their runLoad calls reject. What the orchestrator does when a
 * scenario fails, and at the end of a run or on a signal.
 */
export async function stopLoads(): Promise<void> {
  await Promise.all([...running.values()].map((stop) => stop()));
}

/** Orchestrator side: runs `bench/<script>` as a process and returns its result. */
export function runLoad<R>(
  script: string,
  options: object,
  hooks: LoadHooks,
  timeoutMs: number,
  env: NodeJS.ProcessEnv = {},
): Promise<R> {
  return new Promise((resolve, reject) => {
    const child = spawn(
      process.execPath,
      ["--import", "tsx", `${benchDir}${script}`, JSON.stringify(options)],
      // A process group of its own (see the top of this file).
      { stdio: ["pipe", "pipe", "pipe"], env: { ...process.env, ...env }, detached: true },
    );
    const pgid = child.pid;
    if (pgid === undefined) {
      reject(new Error(`${script} could not be started`));
      return;
    }
    hooks.onStart?.(pgid);
    let stopped: string | undefined;
    running.set(pgid, async () => {
      stopped ??= "stopped: its scenario failed or the run ended";
      await stopGroup(pgid);
    });
    // A child that died early closes its stdin; the exit handler reports it.
    child.stdin.on("error", () => {});
    let stderr = "";
    let result: { value: R } | undefined;
    let buffered = "";
    const timer = setTimeout(() => {
      stopped ??= `did not finish within ${timeoutMs} ms`;
      void stopGroup(pgid);
    }, timeoutMs);
    child.stderr.on("data", (chunk: Buffer) => {
      stderr += chunk.toString();
    });
    child.stdout.on("data", (chunk: Buffer) => {
      buffered += chunk.toString();
      for (let nl = buffered.indexOf("\n"); nl >= 0; nl = buffered.indexOf("\n")) {
        const line = buffered.slice(0, nl);
        buffered = buffered.slice(nl + 1);
        let message: LoadMessage;
        try {
          message = JSON.parse(line) as LoadMessage;
        } catch {
          stderr += `${line}\n`;
          continue;
        }
        if (message.phase === "measure") hooks.onMeasure?.();
        else if (message.phase === "window-end") {
          hooks.onWindowEnd?.();
          child.stdin.write("sampled\n");
        } else result = { value: message.result as R };
      }
    });
    child.once("exit", (code, signal) => {
      clearTimeout(timer);
      // What it started and left behind (it crashed, or was killed) goes
      // with it; after a clean exit the group is empty already.
      void stopGroup(pgid).then(() => {
        running.delete(pgid);
        if (code === 0 && result && !stopped) resolve(result.value);
        else {
          const how = stopped ?? `exited with ${code ?? signal}`;
          reject(new Error(`${script} ${how}: ${stderr.trim()}`));
        }
      });
    });
  });
}
