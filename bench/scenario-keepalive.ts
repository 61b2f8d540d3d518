// Scenario 3: KeepAlive capacity — leases held at TTL 15 s, each renewed
// every 5 s over 100 streams, at growing counts, then a saturation run; and,
// side by side (scenario 5), etcd under the same loads.

import type { BenchContext, ScenarioReport } from "./context.js";
import type { EtcdServer } from "./etcd.js";
import { describeLoad, type KeepAliveLoad, measureEtcdKeepAlive } from "./etcd-keepalive.js";
import { fmtMs, fmtRate } from "./report.js";

export function keepAliveLoads(quick: boolean): KeepAliveLoad[] {
  const steady = (leases: number): KeepAliveLoad => ({
    leases,
    ttlSeconds: 15,
    streams: 100,
    intervalMs: 5_000,
    inflight: 0,
  });
  const sizes = quick ? [1_000, 10_000] : [1_000, 10_000, 50_000];
  return [...sizes.map(steady), { ...steady(10_000), inflight: 4 }];
}

export async function runKeepAlive(
  ctx: BenchContext,
  etcd: EtcdServer | undefined,
): Promise<ScenarioReport> {
  const scenario = "3 KeepAlive";
  const report: ScenarioReport = {
    id: "keepalive",
    name: "KeepAlive capacity (TTL 15 s, every 5 s, 100 streams) and saturation",
    figures: [],
    rows: [],
    comparisons: [],
    targets: [],
  };
  if (!etcd) return report;
  const figures = [];
  for (const load of keepAliveLoads(ctx.settings.quick)) {
    const e = await measureEtcdKeepAlive(ctx, etcd, load);
    figures.push({ load, etcd: e });
    const name = describeLoad(load);
    report.rows.push(
      {
        scenario,
        load: name,
        metric: "renewals/s",
        leasehold: "",
        etcd: fmtRate(e.renewalsPerSec),
      },
      {
        scenario,
        load: name,
        metric: "round trip p50 / p99 ms",
        leasehold: "",
        etcd: `${fmtMs(e.p50Ms)} / ${fmtMs(e.p99Ms)}`,
      },
    );
  }
  report.figures = figures;
  return report;
}
