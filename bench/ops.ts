// What the operational surface costs per call: Get and Acquire/Release over
// gRPC in development mode, with HS256 bearer tokens, with the acl-table
// session authorizer, and with the per-account lease quota, plus a /metrics
// scrape. Run: npx tsx bench/ops.ts [seconds per case]
// (embedded PostgreSQL in a temp folder unless DATABASE_URL is set).

import { randomBytes, randomUUID } from "node:crypto";
import { rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { performance } from "node:perf_hooks";
import { createClient } from "@connectrpc/connect";
import { SignJWT } from "jose";
import postgres from "postgres";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { createLogger } from "../src/log/logger.js";
import {
  type EmbeddedDatabase,
  makeDataParent,
  startEmbeddedPostgres,
} from "../src/postgres/embedded-postgres.js";
import { parseServerConfig } from "../src/server/config/server-config.js";
import { durationFromMillis } from "../src/server/rpc/convert.js";
import { startServer } from "../src/server/server.js";
import { secondsPerCase } from "./support/arguments.js";

const seconds = secondsPerCase("usage: npx tsx bench/ops.ts [seconds per case, default 3]\n", 3);
const concurrency = 16;

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
  const row = {
    name,
    perSecond: Math.round(latencies.length / elapsed),
    p50: Number(at(0.5).toFixed(2)),
    p99: Number(at(0.99).toFixed(2)),
  };
  console.log(JSON.stringify(row));
}

const dir = await makeDataParent("leasehold-bench-ops-");
let embedded: EmbeddedDatabase | undefined;
let url = process.env.DATABASE_URL;
if (!url) {
  embedded = await startEmbeddedPostgres({ dataDir: path.join(dir, "pgdata"), ephemeral: true });
  url = embedded.url;
}
const secret = randomBytes(32).toString("base64url");
const secretFile = path.join(dir, "secret");
await writeFile(secretFile, secret);
const token = await new SignJWT({})
  .setProtectedHeader({ alg: "HS256" })
  .setSubject("bench")
  .setExpirationTime("1h")
  .sign(new TextEncoder().encode(secret));

const cases: [string, string[]][] = [
  ["development mode", ["--max-leases-per-account", "0"]],
  ["HS256 token", ["--jwt-secret-file", secretFile, "--max-leases-per-account", "0"]],
  [
    "HS256 + acl-table",
    [
      "--jwt-secret-file",
      secretFile,
      "--session-authorizer",
      "acl-table",
      "--max-leases-per-account",
      "0",
    ],
  ],
  ["HS256 + quota 10000", ["--jwt-secret-file", secretFile]],
];

try {
  const admin = postgres(url, { max: 1, onnotice: () => {} });
  for (const [name, args] of cases) {
    const config = parseServerConfig(
      ["--listen", "127.0.0.1:0", "--database-url", url, "--pool-size", "16", ...args],
      {},
    );
    const server = await startServer(config, createLogger({ level: "silent" }));
    await admin`INSERT INTO session_acl VALUES ('bench', '*', '*', ARRAY['*'])
      ON CONFLICT DO NOTHING`;
    const client = createClient(LeaseService, createGrpcTransport({ baseUrl: server.url }));
    const options = { headers: { authorization: `Bearer ${token}` } };
    const key = (w: number) => ({ accountId: "bench", sessionId: `w${w}` });
    await measure(`${name}: Get`, async (w) => {
      await client.get({ key: key(w) }, options);
    });
    await measure(`${name}: Acquire+Release`, async (w) => {
      const a = await client.acquire(
        { key: key(w), runId: randomUUID(), ttl: durationFromMillis(30_000) },
        options,
      );
      await client.release({ key: key(w), runId: a.lease?.runId ?? "" }, options);
    });
    await server.close();
  }
  const config = parseServerConfig(["--listen", "127.0.0.1:0", "--database-url", url], {});
  const server = await startServer(config, createLogger({ level: "silent" }));
  await measure("/metrics scrape", async () => {
    await (await fetch(`${server.url}/metrics`)).text();
  });
  await server.close();
  await admin.end();
} finally {
  await embedded?.stop();
  await rm(dir, { recursive: true, force: true });
}
