// Load generator for etcd's side of the KeepAlive capacity scenario: grant
// `leases` leases with `ttlSeconds`, then keep them alive over `streams`
// LeaseKeepAlive streams — either each lease every `intervalMs` (the steady
// load a fleet of holders puts on a server), or as fast as the server answers
// with `inflight` requests outstanding per stream (saturation). Run by
// bench/run.ts as its own process; see load-protocol.ts.

import { Etcd3 } from "etcd3";
import { Latency, type LatencySummary } from "./latency.js";
import { loadOptions, MeasuredWindow, send, type WindowTiming } from "./load-protocol.js";

export interface EtcdKeepAliveOptions extends WindowTiming {
  url: string;
  leases: number;
  ttlSeconds: number;
  streams: number;
  /** Steady load: each lease renewed this often. */
  intervalMs: number;
  /** Saturation: requests outstanding per stream; 0 for the steady load. */
  inflight: number;
}

export interface KeepAliveResult {
  leases: number;
  grantSeconds: number;
  renewals: number;
  renewalsPerSec: number;
  /** Keepalives answered with TTL 0: the lease had expired. Expected 0. */
  lost: number;
  errors: number;
  firstError?: string;
  roundTrip: LatencySummary;
  seconds: number;
  loadCpuCores: number;
}

/** Slots of the steady-load wheel: each lease fires once per turn, in its own slot. */
const tickMs = 10;

async function main(): Promise<void> {
  const options = loadOptions<EtcdKeepAliveOptions>();
  const client = new Etcd3({ hosts: options.url });
  const roundTrip = new Latency();
  let renewals = 0;
  let lost = 0;
  let errors = 0;
  let firstError: string | undefined;
  let window: MeasuredWindow | undefined;
  const fail = (error: unknown) => {
    errors++;
    firstError ??= String(error);
  };

  // Send times per lease id, oldest first: responses on a stream come back
  // in order, and a lease may be in flight more than once when saturating.
  const sentAt = new Map<string, number[]>();
  const streams = await Promise.all(
    Array.from({ length: options.streams }, async () => {
      const stream = await client.leaseClient.leaseKeepAlive();
      const own: string[] = [];
      let next = 0;
      const write = (id: string) => {
        const queue = sentAt.get(id);
        if (queue) queue.push(performance.now());
        else sentAt.set(id, [performance.now()]);
        stream.write({ ID: id });
      };
      stream.on("data", (res) => {
        const now = performance.now();
        const t = sentAt.get(res.ID)?.shift();
        if (window?.counts(now) && t !== undefined) {
          renewals++;
          roundTrip.record(now - t);
          if (Number(res.TTL) <= 0) lost++;
        }
        // Saturation: answer each response with the stream's next lease.
        if (options.inflight > 0 && !window?.stopped && own.length > 0) {
          write(own[next++ % own.length] as string);
        }
      });
      stream.on("error", fail);
      return { stream, own, write };
    }),
  );

  // Grant with bounded concurrency; each lease joins the keepalive load at
  // once, so the first ones do not expire while the last are granted.
  const grantStart = performance.now();
  const wheel: { id: string; stream: number }[][] = Array.from(
    { length: Math.round(options.intervalMs / tickMs) },
    () => [],
  );
  let granted = 0;
  const granter = async () => {
    while (granted < options.leases) {
      const i = granted++;
      const { ID } = await client.leaseClient.leaseGrant({ TTL: options.ttlSeconds });
      const s = i % options.streams;
      streams[s]?.own.push(ID);
      wheel[i % wheel.length]?.push({ id: ID, stream: s });
    }
  };
  let slot = Math.floor(performance.now() / tickMs);
  const ticker =
    options.inflight === 0
      ? setInterval(() => {
          const now = Math.floor(performance.now() / tickMs);
          for (; slot < now; slot++) {
            for (const { id, stream } of wheel[slot % wheel.length] ?? [])
              streams[stream]?.write(id);
          }
        }, tickMs)
      : undefined;
  await Promise.all(Array.from({ length: Math.min(64, options.leases) }, granter));
  const grantSeconds = (performance.now() - grantStart) / 1000;
  if (options.inflight > 0) {
    for (const s of streams) {
      for (let k = 0; k < options.inflight && s.own.length > 0; k++) {
        s.write(s.own[k % s.own.length] as string);
      }
    }
  }

  window = new MeasuredWindow(options);
  await window.done;
  clearInterval(ticker);
  for (const s of streams) s.stream.end();
  const result: KeepAliveResult = {
    leases: options.leases,
    grantSeconds: Math.round(grantSeconds * 10) / 10,
    renewals,
    renewalsPerSec: Math.round(renewals / window.seconds),
    lost,
    errors,
    firstError,
    roundTrip: roundTrip.summary(),
    seconds: window.seconds,
    loadCpuCores: Math.round(window.cpuCores * 100) / 100,
  };
  send({ phase: "result", result });
  process.exit(0);
}

await main();
