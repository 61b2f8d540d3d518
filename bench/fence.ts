// What fencing costs: write transactions with and without the fence check,
// on many sessions and on one hot session, and guarded store Puts over gRPC
// in monotonic and live mode. Run: npx tsx bench/fence.ts [seconds per case]
// (embedded PostgreSQL in a temp folder unless DATABASE_URL is set).

import { rm } from "node:fs/promises";
import path from "node:path";
import { performance } from "node:perf_hooks";
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { GuardedStoreService } from "../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { parseGuardedConfig } from "../src/guarded/config.js";
import { fence } from "../src/guarded/fence.js";
import { startGuardedServer } from "../src/guarded/server.js";
import { createLogger } from "../src/log/logger.js";
import {
  type EmbeddedDatabase,
  makeDataParent,
  startEmbeddedPostgres,
} from "../src/postgres/embedded-postgres.js";
import { allMigrationSets, migrate } from "../src/postgres/migrate.js";
import { openDatabase } from "../src/postgres/pool.js";
import { parseServerConfig } from "../src/server/config/server-config.js";
import { durationFromMillis } from "../src/server/rpc/convert.js";
import { startServer } from "../src/server/server.js";
import { secondsPerCase } from "./support/arguments.js";

const seconds = secondsPerCase("usage: npx tsx bench/fence.ts [seconds per case, default 3]\n", 3);
const concurrency = 16;

interface Result {
  name: string;
  ops: number;
  perSecond: number;
  p50: number;
  p99: number;
}

// Runs `op` from `concurrency` workers for `seconds`; latencies in ms.
async function measure(name: string, op: (worker: number, n: number) => Promise<void>) {
  const latencies: number[] = [];
  const end = performance.now() + seconds * 1000;
  const started = performance.now();
  await Promise.all(
    Array.from({ length: concurrency }, async (_, worker) => {
      for (let n = 0; performance.now() < end; n++) {
        const t = performance.now();
        await op(worker, n);
        latencies.push(performance.now() - t);
      }
    }),
  );
  const elapsed = (performance.now() - started) / 1000;
  latencies.sort((a, b) => a - b);
  const at = (q: number) =>
    latencies[Math.min(latencies.length - 1, Math.floor(q * latencies.length))] ?? 0;
  const result: Result = {
    name,
    ops: latencies.length,
    perSecond: Math.round(latencies.length / elapsed),
    p50: Number(at(0.5).toFixed(2)),
    p99: Number(at(0.99).toFixed(2)),
  };
  console.log(JSON.stringify(result));
  return result;
}

async function main() {
  let embedded: EmbeddedDatabase | undefined;
  let dir: string | undefined;
  let url = process.env.DATABASE_URL;
  if (!url) {
    dir = await makeDataParent("leasehold-bench-");
    embedded = await startEmbeddedPostgres({ dataDir: path.join(dir, "pgdata"), ephemeral: true });
    url = embedded.url;
  }
  await migrate(url, allMigrationSets);
  const sql = openDatabase({
    url,
    maxConnections: concurrency,
    statementTimeoutMs: 5_000,
    lockTimeoutMs: 5_000,
    idleInTransactionTimeoutMs: 10_000,
    applicationName: "leasehold-bench",
  });
  await sql`CREATE TABLE IF NOT EXISTS bench_writes (session_id text, token bigint, body text)`;
  const key = (w: number) => ({ accountId: "bench", sessionId: `s-${w}` });
  const hot = { accountId: "bench", sessionId: "hot" };

  const results: Result[] = [];
  results.push(
    await measure("sql: plain write transaction, one session per worker", async (w) => {
      await sql.begin((tx) => tx`INSERT INTO bench_writes VALUES (${key(w).sessionId}, 1, 'x')`);
    }),
  );
  results.push(
    await measure("sql: fenced write transaction, one session per worker", async (w) => {
      await sql.begin(async (tx) => {
        await fence(tx, key(w), 1n);
        await tx`INSERT INTO bench_writes VALUES (${key(w).sessionId}, 1, 'x')`;
      });
    }),
  );
  results.push(
    await measure("sql: fenced write transaction, all workers on one session", async () => {
      await sql.begin(async (tx) => {
        await fence(tx, hot, 1n);
        await tx`INSERT INTO bench_writes VALUES ('hot', 1, 'x')`;
      });
    }),
  );

  const quiet = createLogger({ level: "silent" });
  const leaseServer = await startServer(
    parseServerConfig(["--listen", "127.0.0.1:0", "--database-url", url], {}),
    quiet,
  );
  const leases = createClient(LeaseService, createGrpcTransport({ baseUrl: leaseServer.url }));
  const tokens: bigint[] = [];
  for (let w = 0; w < concurrency; w++) {
    const r = await leases.acquire({ key: key(w), ttl: durationFromMillis(600_000) });
    tokens.push(r.lease?.fencingToken ?? 0n);
  }
  const value = new Uint8Array(1024);
  for (const mode of ["monotonic", "live"] as const) {
    const store = await startGuardedServer(
      parseGuardedConfig(
        [
          "--listen",
          "127.0.0.1:0",
          "--database-url",
          url,
          "--fence-mode",
          mode,
          "--lease-url",
          leaseServer.url,
        ],
        {},
      ),
      quiet,
    );
    const client = createClient(GuardedStoreService, createGrpcTransport({ baseUrl: store.url }));
    results.push(
      await measure(`grpc: guarded Put 1 KiB, ${mode}, one session per worker`, async (w, n) => {
        await client.put({
          key: key(w),
          name: `doc-${n % 10}`,
          value,
          fencingToken: tokens[w] ?? 0n,
        });
      }),
    );
    await store.close();
  }
  await leaseServer.close();
  await sql.end();
  await embedded?.stop();
  if (dir) await rm(dir, { recursive: true, force: true });
  console.table(results);
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
