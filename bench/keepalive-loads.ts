// The loads of the KeepAlive scenario, shared by Leasehold's side and etcd's.

import type { BenchContext } from "./context.js";

export interface KeepAliveLoad {
  leases: number;
  ttlSeconds: number;
  streams: number;
  intervalMs: number;
  /** 0: steady renewals every intervalMs; above 0: saturation with this many in flight per stream. */
  inflight: number;
}

export function describeLoad(load: KeepAliveLoad): string {
  const base = `${load.leases.toLocaleString("en-US")} leases, ${load.streams} streams`;
  return load.inflight === 0
    ? `${base}, every ${load.intervalMs / 1000} s`
    : `${base}, saturating (${load.inflight} in flight/stream)`;
}

/** A steady load's window spans a renewal period, so every lease is renewed in it. */
export function windowFor(ctx: BenchContext, load: KeepAliveLoad): number {
  return load.inflight > 0
    ? ctx.settings.windowMs
    : Math.max(ctx.settings.windowMs, load.intervalMs);
}

export function keepAliveLoads(quick: boolean): KeepAliveLoad[] {
  const steady = (leases: number): KeepAliveLoad => ({
    leases,
    ttlSeconds: 15,
    streams: 100,
    intervalMs: 5_000,
    inflight: 0,
  });
  // Quick: the saturation run alone, the one that compares capacity.
  if (quick) return [{ ...steady(1_000), inflight: 4 }];
  return [steady(1_000), steady(10_000), steady(50_000), { ...steady(10_000), inflight: 4 }];
}
