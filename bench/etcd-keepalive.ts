// etcd's side of scenario 3 (scenario 5): the same keepalive loads, each on
// a freshly started etcd so leases of one run do not weigh on the next.

import { type BenchContext, medianOf } from "./context.js";
import type { EtcdServer } from "./etcd.js";
import { describeLoad, type KeepAliveLoad, windowFor } from "./keepalive-loads.js";
import type { EtcdKeepAliveOptions, KeepAliveResult } from "./load-etcd-keepalive.js";
import { type Measured, measureLoad } from "./measure.js";

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

export async function measureEtcdKeepAlive(
  ctx: BenchContext,
  etcd: EtcdServer,
  load: KeepAliveLoad,
  rounds: number,
): Promise<KeepAliveFigures> {
  const runs: Measured<KeepAliveResult>[] = [];
  for (let round = 1; round <= rounds; round++) {
    ctx.progress(`5 KeepAlive · etcd · ${describeLoad(load)} · round ${round}/${rounds}`);
    await etcd.restart();
    const options: EtcdKeepAliveOptions = {
      url: etcd.url,
      ...load,
      // A steady load warms up for one renewal period, so that every lease
      // has been renewed once before the window, as on Leasehold's side.
      warmupMs: load.inflight === 0 ? load.intervalMs : ctx.settings.warmupMs,
      windowMs: windowFor(ctx, load),
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
