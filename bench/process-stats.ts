// CPU and memory of the processes under test, read from /proc (Linux), so
// every figure can say who used the two cores: the server, PostgreSQL, the
// load generator, etcd — and everything else on the machine (other work
// sharing it, the noise floor of the run).

import { readdirSync, readFileSync } from "node:fs";

/** USER_HZ: /proc/<pid>/stat counts CPU time in 1/100 s on Linux. */
const ticksPerSecond = 100;

/** CPU seconds (user + system) a process has used so far; 0 once it is gone. */
export function processCpuSeconds(pid: number): number {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    // The command name may contain spaces and parentheses: fields follow the last ")".
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    // Fields 14 and 15 of stat(5), counted from the state field (3).
    return (Number(fields[11]) + Number(fields[12])) / ticksPerSecond;
  } catch {
    return 0;
  }
}

/** Resident memory in MiB; 0 once the process is gone. */
export function processRssMiB(pid: number): number {
  try {
    const status = readFileSync(`/proc/${pid}/status`, "utf8");
    const kb = /^VmRSS:\s+(\d+) kB/m.exec(status)?.[1];
    return kb ? Math.round(Number(kb) / 102.4) / 10 : 0;
  } catch {
    return 0;
  }
}

/** A process and all its live descendants (PostgreSQL's backends, say). */
export function processTree(root: number): number[] {
  const children = new Map<number, number[]>();
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    try {
      const stat = readFileSync(`/proc/${name}/stat`, "utf8");
      const ppid = Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]);
      const list = children.get(ppid) ?? [];
      list.push(Number(name));
      children.set(ppid, list);
    } catch {
      // The process ended while we listed it.
    }
  }
  const out: number[] = [];
  const walk = (pid: number) => {
    out.push(pid);
    for (const child of children.get(pid) ?? []) walk(child);
  };
  walk(root);
  return out;
}

/** Busy CPU seconds of the whole machine (all cores), from /proc/stat. */
export function machineBusySeconds(): number {
  const line = readFileSync("/proc/stat", "utf8").split("\n", 1)[0] ?? "";
  const [, user, nice, system, , , irq, softirq, steal] = line.trim().split(/\s+/).map(Number);
  return (
    ((user ?? 0) + (nice ?? 0) + (system ?? 0) + (irq ?? 0) + (softirq ?? 0) + (steal ?? 0)) /
    ticksPerSecond
  );
}

/** A named group of processes whose CPU is measured together. */
export interface ProcessGroup {
  name: string;
  /** Current pids; called at each sample (backends come and go). */
  pids(): number[];
}

export interface CpuSample {
  at: number;
  machine: number;
  groups: Map<string, Map<number, number>>;
}

export function sampleCpu(groups: ProcessGroup[]): CpuSample {
  return {
    at: performance.now(),
    machine: machineBusySeconds(),
    groups: new Map(
      groups.map((g) => [g.name, new Map(g.pids().map((pid) => [pid, processCpuSeconds(pid)]))]),
    ),
  };
}

/**
 * CPU used between two samples, in cores (1.0 = one core busy), per group,
 * plus `machine` and `other` (machine minus the groups). A process that ended
 * before the second sample counts only until the first.
 */
export function cpuBetween(before: CpuSample, after: CpuSample): Record<string, number> {
  const seconds = (after.at - before.at) / 1000;
  const out: Record<string, number> = {};
  let ours = 0;
  for (const [name, pids] of after.groups) {
    const earlier = before.groups.get(name) ?? new Map<number, number>();
    let used = 0;
    for (const [pid, cpu] of pids) used += Math.max(0, cpu - (earlier.get(pid) ?? 0));
    out[name] = round2(used / seconds);
    ours += used;
  }
  const machine = (after.machine - before.machine) / seconds;
  out.machine = round2(machine);
  out.other = round2(Math.max(0, machine - ours / seconds));
  return out;
}

function round2(x: number): number {
  return Math.round(x * 100) / 100;
}
