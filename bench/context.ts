// What every scenario gets from the orchestrator: the settings of this run,
// the running systems, and a way to say what is running now.

import type { Systems } from "./measure.js";
import type { Comparison, Row, Target } from "./report.js";

export interface BenchSettings {
  quick: boolean;
  /** Measured windows per figure; the figure is their median. */
  rounds: number;
  warmupMs: number;
  windowMs: number;
  concurrencies: number[];
  keys: number;
  ttlSeconds: number;
  servers: number;
  poolSize: number;
  /** Also run Leasehold's store SQL without RPC (explains the gap to the limit). */
  storeBaseline: boolean;
}

export interface BenchContext {
  settings: BenchSettings;
  systems: Systems;
  serverUrls: string[];
  /** --server-cli: the bin/leasehold.js serving, for scenarios that start servers of their own. */
  serverCli: string | undefined;
  /** With --cpu-prof: where servers started by a scenario itself write their profiles. */
  cpuProfileDir: string | undefined;
  progress(label: string): void;
}

/** What a scenario hands back: raw figures for the JSON, rows, comparisons, targets. */
export interface ScenarioReport {
  id: string;
  name: string;
  figures: unknown;
  rows: Row[];
  comparisons: Comparison[];
  targets: Target[];
  /** Windows worth a server CPU profile (with --cpu-prof), and what ran in them. */
  profile?: { label: string; windows: [number, number][] };
  /** Profiles of servers the scenario started itself, and their measured windows. */
  serverProfiles?: { label: string; file: string; windows: [number, number][] }[];
}

/** The median of a figure across repeated windows. */
export function medianOf<R>(runs: R[], pick: (m: R) => number): number {
  return median(runs.map(pick));
}

export function median(all: number[]): number {
  const values = all.filter(Number.isFinite).sort((a, b) => a - b);
  if (values.length === 0) return Number.NaN;
  const mid = values.length >> 1;
  return values.length % 2
    ? (values[mid] as number)
    : ((values[mid - 1] as number) + (values[mid] as number)) / 2;
}
