// How the orchestrator and a load generator process talk. The load generator
// runs as its own process (so its CPU is not the server's), gets its options
// as one JSON argument, and writes JSON lines on stdout: `measure` when the
// warm-up ends, `window-end` when the measured window closes, and finally
// `result`. The orchestrator samples CPU and database counters at the first
// two, so those figures cover exactly the measured window, and answers
// `window-end` with a line on stdin: until then the load generator keeps its
// connections, whose server-side processes (PostgreSQL backends) would
// otherwise be gone before their CPU time was read.

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
      { stdio: ["pipe", "pipe", "pipe"], env: { ...process.env, ...env } },
    );
    if (child.pid !== undefined) hooks.onStart?.(child.pid);
    // A child that died early closes its stdin; the exit handler reports it.
    child.stdin.on("error", () => {});
    let stderr = "";
    let result: { value: R } | undefined;
    let buffered = "";
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`${script} did not finish within ${timeoutMs} ms: ${stderr}`));
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
    child.once("exit", (code) => {
      clearTimeout(timer);
      if (code === 0 && result) resolve(result.value);
      else reject(new Error(`${script} exited with ${code}: ${stderr.trim()}`));
    });
  });
}
