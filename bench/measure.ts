// Runs one load generator process against the running systems and adds what
// the systems did during its measured window: CPU per process group (and
// the rest of the machine: the noise), database statements and WAL syncs,
// etcd WAL fsyncs, server memory.

import { monotonicMicros } from "./cpu-profile.js";
import type { EtcdCounters, EtcdServer } from "./etcd.js";
import { runLoad } from "./load-protocol.js";
import type { BenchPostgres, DatabaseCounters } from "./postgres.js";
import { databaseRates } from "./postgres.js";
import {
  type CpuSample,
  cpuBetween,
  type ProcessGroup,
  processRssMiB,
  processTree,
  sampleCpu,
} from "./process-stats.js";

export interface Systems {
  postgres: BenchPostgres;
  /** pids of the lease server processes. */
  serverPids: () => number[];
  etcd: EtcdServer | undefined;
}

export interface Measured<R> {
  load: R;
  /** Cores used during the window, per group; `other` is everything else. */
  cpu: Record<string, number>;
  database: ReturnType<typeof databaseRates>;
  etcdWalFsyncsPerSec?: number;
  /** Resident memory of the lease servers at the window's end, summed. */
  serverRssMiB: number;
  /** The window on the monotonic clock (µs), to cut CPU profiles to it. */
  window: [number, number];
}

export async function measureLoad<R>(
  systems: Systems,
  script: string,
  options: { warmupMs: number; windowMs: number } & object,
): Promise<Measured<R>> {
  let loadPid = 0;
  const groups: ProcessGroup[] = [
    { name: "server", pids: systems.serverPids },
    { name: "postgres", pids: () => systems.postgres.pids() },
    // The load generator and the processes it starts (scenario 4's watchers).
    { name: "load", pids: () => (loadPid ? processTree(loadPid) : []) },
  ];
  const etcd = systems.etcd;
  if (etcd) groups.push({ name: "etcd", pids: () => [etcd.pid()] });
  let cpuBefore: CpuSample | undefined;
  let cpuAfter: CpuSample | undefined;
  let dbBefore: Promise<DatabaseCounters> | undefined;
  let dbAfter: Promise<DatabaseCounters> | undefined;
  let etcdBefore: Promise<EtcdCounters> | undefined;
  let etcdAfter: Promise<EtcdCounters> | undefined;
  let rss = 0;
  const window: [number, number] = [0, 0];
  const load = await runLoad<R>(
    script,
    options,
    {
      onStart: (pid) => {
        loadPid = pid;
      },
      onMeasure: () => {
        window[0] = monotonicMicros();
        cpuBefore = sampleCpu(groups);
        dbBefore = systems.postgres.counters();
        etcdBefore = etcd?.counters();
      },
      onWindowEnd: () => {
        window[1] = monotonicMicros();
        cpuAfter = sampleCpu(groups);
        dbAfter = systems.postgres.counters();
        etcdAfter = etcd?.counters();
        rss = systems.serverPids().reduce((sum, pid) => sum + processRssMiB(pid), 0);
      },
    },
    // Setup before the warm-up (granting 50,000 etcd leases) takes a while.
    options.warmupMs + options.windowMs + 300_000,
  );
  if (!cpuBefore || !cpuAfter || !dbBefore || !dbAfter) {
    throw new Error(`${script} reported a result without a measured window`);
  }
  const measured: Measured<R> = {
    load,
    cpu: cpuBetween(cpuBefore, cpuAfter),
    database: databaseRates(await dbBefore, await dbAfter),
    serverRssMiB: Math.round(rss),
    window,
  };
  if (etcdBefore && etcdAfter) {
    const [a, b] = [await etcdBefore, await etcdAfter];
    measured.etcdWalFsyncsPerSec = Math.round((b.walFsyncs - a.walFsyncs) / ((b.at - a.at) / 1000));
  }
  return measured;
}
