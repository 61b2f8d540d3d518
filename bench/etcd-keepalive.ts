// etcd's side of scenario 3 (scenario 5): the same keepalive loads, each on
// a freshly started etcd so leases of one run do not weigh on the next.

import { type BenchContext, medianOf } from "./context.js";
import type { EtcdServer } from "./etcd.js";
import type { EtcdKeepAliveOptions, KeepAliveResult } from "./load-etcd-keepalive.js";
import { type Measured, measureLoad } from "./measure.js";

export interface KeepAliveLoad {
  leases: number;
  ttlSeconds: number;
  streams: number;
  intervalMs: number;
  /** 0: steady renewals every intervalMs; above 0: saturation with this many in flight per stream. */
  inflight: number;
}

export interface KeepAliveFigures {
  load: KeepAliveLoad;
  renewalsPerSec: number;
  p50Ms: number;
  p99Ms: number;
  lost: number;
  errors: number;
  grantSeconds: number;
  cpuCores: Record<string, number>;
  etcdWalFsyncsPerSec: number;
  windows: { renewalsPerSec: number; p50Ms: number; p99Ms: number; otherCpu: number }[];
}

export function describeLoad(load: KeepAliveLoad): string {
  const base = `${load.leases.toLocaleString("en-US")} leases, ${load.streams} streams`;
  return load.inflight === 0
    ? `${base}, every ${load.intervalMs / 1000} s`
    : `${base}, saturating (${load.inflight} in flight/stream)`;
}

export async function measureEtcdKeepAlive(
  ctx: BenchContext,
  etcd: EtcdServer,
  load: KeepAliveLoad,
): Promise<KeepAliveFigures> {
  const runs: Measured<KeepAliveResult>[] = [];
  for (let round = 1; round <= ctx.settings.rounds; round++) {
    ctx.progress(
      `5 etcd keepalive · ${describeLoad(load)} · round ${round}/${ctx.settings.rounds}`,
    );
    await etcd.restart();
    const options: EtcdKeepAliveOptions = {
      url: etcd.url,
      ...load,
      warmupMs: ctx.settings.warmupMs,
      windowMs: ctx.settings.windowMs,
    };
    runs.push(await measureLoad<KeepAliveResult>(ctx.systems, "load-etcd-keepalive.ts", options));
  }
  const cpuKeys = Object.keys(runs[0]?.cpu ?? {});
  return {
    load,
    renewalsPerSec: medianOf(runs, (m) => m.load.renewalsPerSec),
    p50Ms: medianOf(runs, (m) => m.load.roundTrip.p50Ms),
    p99Ms: medianOf(runs, (m) => m.load.roundTrip.p99Ms),
    lost: runs.reduce((sum, m) => sum + m.load.lost, 0),
    errors: runs.reduce((sum, m) => sum + m.load.errors, 0),
    grantSeconds: medianOf(runs, (m) => m.load.grantSeconds),
    cpuCores: Object.fromEntries(cpuKeys.map((k) => [k, medianOf(runs, (m) => m.cpu[k] ?? 0)])),
    etcdWalFsyncsPerSec: medianOf(runs, (m) => m.etcdWalFsyncsPerSec ?? Number.NaN),
    windows: runs.map((m) => ({
      renewalsPerSec: m.load.renewalsPerSec,
      p50Ms: m.load.roundTrip.p50Ms,
      p99Ms: m.load.roundTrip.p99Ms,
      otherCpu: m.cpu.other ?? Number.NaN,
    })),
  };
}
