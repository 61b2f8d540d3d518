// Probe: what one acquire → release cycle of the client library's
// runExclusive costs the calling process (its Acquire, KeepAlive
// registration and Release), beside the Go client's BenchmarkCycleCPU
// (clients/go/measure_test.go), which runs the same load: 4,000 cycles,
// 8 at a time, each on a session of its own loop, TTL 10 s, over gRPC.
// Reports cycles/s and this process's CPU (process.cpuUsage, user +
// system) per cycle.
//
// Run: npm run build && npx tsx bench/client-cycles.ts [--cycles N] [--parallel N]

import { createLeaseClient } from "../src/client/index.js";
import { benchArgs, positiveInteger } from "./support/arguments.js";
import { cleanupsOnSignal } from "./support/cleanups.js";
import { spawnLeasehold, startBenchDatabase } from "./support/environment.js";

const usage = `usage: npx tsx bench/client-cycles.ts [options]

  --cycles N      acquire → release cycles in all (default 4000)
  --parallel N    cycles at a time, each loop on its own session (default 8)
`;
const { values } = benchArgs(
  {
    cycles: { type: "string", default: "4000" },
    parallel: { type: "string", default: "8" },
  },
  usage,
);
const cycles = positiveInteger("cycles", values.cycles, usage);
const parallel = positiveInteger("parallel", values.parallel, usage);
const log = (line: string) => process.stderr.write(`${line}\n`);
const cleanups = cleanupsOnSignal(log, "the database and the server");

try {
  const db = await startBenchDatabase();
  cleanups.push(() => db.stop());
  const server = await spawnLeasehold(db.url, []);
  cleanups.push(() => server.stop());
  const client = createLeaseClient({ baseUrl: server.url, protocol: "grpc" });
  cleanups.push(async () => client.close());
  const loop = async (w: number, n: number) => {
    for (let i = 0; i < n; i++) {
      await client.runExclusive({ accountId: "bench", sessionId: `cycle-${w}` }, () => {}, {
        ttlMs: 10_000,
      });
    }
  };
  // Warm-up: connections, JIT.
  await Promise.all(Array.from({ length: parallel }, (_, w) => loop(w, 20)));
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: parallel }, (_, w) => loop(w, Math.floor(cycles / parallel))),
  );
  const cpu = process.cpuUsage(cpu0);
  const seconds = (performance.now() - t0) / 1000;
  const result = {
    cycles,
    parallel,
    cyclesPerSecond: Math.round(cycles / seconds),
    cpuUsPerCycle: Number(((cpu.user + cpu.system) / cycles).toFixed(1)),
  };
  process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
} finally {
  await cleanups.run();
}
