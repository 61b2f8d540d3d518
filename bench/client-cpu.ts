// CPU of the TypeScript client per renewal and per acquire→release cycle,
// measured the way clients/python/bench/client_cpu.py measures the Python
// client, so the two can stand side by side (docs/clients.md, "Cost"):
// against a running lease server, `--leases` runExclusive renewed every
// `--interval-ms` on the client's one KeepAlive stream for `--seconds`, then
// `--cycles` sequential runExclusive with empty work (Acquire, the lease
// registered on the stream, Release). CPU is this process's user + system
// time (process.cpuUsage); renewals are counted by the server
// (leasehold_lease_renewals_total on its /metrics). One JSON line on stdout.
//
// Run: npm run build && npx tsx bench/client-cpu.ts --server http://127.0.0.1:7070

import { randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { createLeaseClient } from "../src/client/index.js";
import { benchArgs, positiveInteger } from "./support/arguments.js";

const usage = `usage: npx tsx bench/client-cpu.ts [options]

  --server URL      lease server (default http://127.0.0.1:7070)
  --leases N        leases held (default 500)
  --interval-ms N   renewal interval (default 1000)
  --seconds N       measured window (default 10)
  --cycles N        acquire→release cycles (default 300)
`;
const { values } = benchArgs(
  {
    server: { type: "string", default: "http://127.0.0.1:7070" },
    leases: { type: "string", default: "500" },
    "interval-ms": { type: "string", default: "1000" },
    seconds: { type: "string", default: "10" },
    cycles: { type: "string", default: "300" },
  },
  usage,
);
const server = values.server as string;
const leases = positiveInteger("leases", values.leases, usage);
const intervalMs = positiveInteger("interval-ms", values["interval-ms"], usage);
const seconds = positiveInteger("seconds", values.seconds, usage);
const cycles = positiveInteger("cycles", values.cycles, usage);
const ttlMs = 10_000;

const cpuSeconds = () => {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
};
async function renewals(): Promise<number> {
  const body = await (await fetch(`${server}/metrics`)).text();
  return Number(/^leasehold_lease_renewals_total (\d+)/m.exec(body)?.[1] ?? 0);
}
const key = (label: string) => ({ accountId: "bench-ts", sessionId: `${label}-${randomUUID()}` });

const client = createLeaseClient({
  baseUrl: server,
  protocol: "grpc",
  token: process.env.LEASEHOLD_TOKEN || undefined,
});
let release!: () => void;
const held = new Promise<void>((resolve) => {
  release = resolve;
});
let entered = 0;
const runs = Array.from({ length: leases }, () =>
  client.runExclusive(
    key("renew"),
    async () => {
      entered += 1;
      await held;
    },
    { ttlMs, renewIntervalMs: intervalMs },
  ),
);
while (entered < leases) await sleep(10);
await sleep(intervalMs * 2);
const [n0, c0] = [await renewals(), cpuSeconds()];
await sleep(seconds * 1000);
const [n1, c1] = [await renewals(), cpuSeconds()];
release();
await Promise.all(runs);
const c2 = cpuSeconds();
for (let i = 0; i < cycles; i += 1) {
  await client.runExclusive(key("cycle"), async () => {}, { ttlMs });
}
const c3 = cpuSeconds();
client.close();
const round = (v: number) => Math.round(v * 10) / 10;
console.log(
  JSON.stringify({
    client: "typescript",
    renewals_per_s: round((n1 - n0) / seconds),
    cpu_us_per_renewal: round(((c1 - c0) / Math.max(1, n1 - n0)) * 1e6),
    cpu_us_per_cycle: round(((c3 - c2) / cycles) * 1e6),
  }),
);
