// The fault suite's client processes (test/faults/client-worker.ts) run
// against the HA stack: the same seeded workload, the same invoke/complete
// history, so the HA suite's history goes through the same checker.

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import type { WriteStream } from "node:fs";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import type { CountsLine, OperationKind, WorkerConfig } from "../faults/client-worker.js";
import type { HistoryEvent } from "../faults/op-history.js";
import { repoRoot } from "../support/server.js";

const workerPath = fileURLToPath(new URL("../faults/client-worker.ts", import.meta.url));

export interface Worker {
  index: number;
  child: ChildProcess;
  /** Its latest counts line: outcomes by name, operations by kind (cumulative). */
  counts: Record<string, number>;
  operations: Record<OperationKind, number>;
  exited: Promise<number | null>;
}

/** The history: parsed for the checker, and written line by line to a file as it arrives. */
export interface History {
  events: HistoryEvent[];
  out: WriteStream;
}

export function appendToHistory(history: History, event: HistoryEvent, line?: string) {
  history.events.push(event);
  history.out.write(`${line ?? JSON.stringify(event)}\n`);
}

export function startWorker(
  config: WorkerConfig,
  history: History,
  onEvent?: (event: HistoryEvent) => void,
): Worker {
  const child = spawn(process.execPath, ["--import", "tsx", workerPath, JSON.stringify(config)], {
    cwd: repoRoot,
    stdio: ["pipe", "pipe", "inherit"],
  });
  const worker: Worker = {
    index: config.client,
    child,
    counts: {},
    operations: { acquire: 0, renew: 0, release: 0, write: 0, revoke: 0, keeper: 0, campaign: 0 },
    // "close", not "exit": only then has every line of its stdout been read.
    exited: once(child, "close").then(([code]) => code as number | null),
  };
  createInterface({ input: child.stdout as NodeJS.ReadableStream }).on("line", (line) => {
    const parsed = JSON.parse(line) as HistoryEvent | CountsLine;
    if (parsed.type === "counts") {
      worker.counts = parsed.counts;
      worker.operations = parsed.operations;
    } else {
      appendToHistory(history, parsed, line);
      onEvent?.(parsed);
    }
  });
  return worker;
}

const operationKinds: OperationKind[] = [
  "acquire",
  "renew",
  "release",
  "write",
  "revoke",
  "keeper",
  "campaign",
];

/** The clients' operations so far, by kind and in total. */
export function operationsOf(workers: readonly Worker[]) {
  const byKind = Object.fromEntries(operationKinds.map((k) => [k, 0])) as Record<
    OperationKind,
    number
  >;
  for (const w of workers) for (const k of operationKinds) byKind[k] += w.operations[k];
  return { total: operationKinds.reduce((n, k) => n + byKind[k], 0), byKind };
}

/** Calls of the clients that failed with a code so far, e.g. "Unavailable" (their counts by outcome). */
export function failedWith(workers: readonly Worker[], code: string): number {
  let n = 0;
  for (const w of workers) {
    for (const [name, count] of Object.entries(w.counts)) {
      // Outcomes are named by operation and code (acquire-Unavailable,
      // write-unknown-Unavailable, …); the bare write-unknown is their sum.
      if (name.endsWith(`-${code}`)) n += count;
    }
  }
  return n;
}
