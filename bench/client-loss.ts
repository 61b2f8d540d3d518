// How early runExclusive stops work when its renewals are cut (L2).
//
// For each fault — connection dropped, connection stalled, server process
// killed — runs a lease with the default timing, injects the fault right
// after a confirmed renewal, and records (a) how long after the fault the
// work's signal aborted and (b) how much time the lease still had on the
// server at that moment, read from the database (expires_at − clock).
// (b) > 0 is L2; its size is the slack the client gave itself.
//
//   npx tsx bench/client-loss.ts [--runs 10] [--ttl 2s]
//
// Uses DATABASE_URL when set, else an embedded PostgreSQL in a temp folder.

import { spawn } from "node:child_process";
import { once } from "node:events";
import { rm } from "node:fs/promises";
import path from "node:path";
import { createLeaseClient } from "../src/client/index.js";
import { parseDuration } from "../src/lease/limits.js";
import { createLogger } from "../src/log/logger.js";
import { makeDataParent, startEmbeddedPostgres } from "../src/postgres/embedded-postgres.js";
import { parseServerConfig } from "../src/server/config/server-config.js";
import { startServer } from "../src/server/server.js";
import { startTcpProxy } from "../test/support/tcp-proxy.js";
import { benchArgs, usageError } from "./support/arguments.js";

const usage = `usage: npx tsx bench/client-loss.ts [--runs 10] [--ttl 2s]

  --runs N        leases per fault (default 10)
  --ttl DURATION  the leases' TTL (default 2s)
`;
const { values } = benchArgs({ runs: { type: "string" }, ttl: { type: "string" } }, usage);
const runs = Number(values.runs ?? "10");
if (!(Number.isInteger(runs) && runs > 0)) {
  usageError(`--runs must be a positive integer, got ${JSON.stringify(values.runs)}`, usage);
}
const ttlMs =
  parseDuration(values.ttl ?? "2s") ??
  usageError(`--ttl must be a duration such as 2s, got ${JSON.stringify(values.ttl)}`, usage);
const repoRoot = path.resolve(import.meta.dirname, "..");

const dataDir = await makeDataParent("leasehold-bench-");
const embedded = process.env.DATABASE_URL
  ? undefined
  : await startEmbeddedPostgres({ dataDir: path.join(dataDir, "pgdata"), ephemeral: true });
const databaseUrl = process.env.DATABASE_URL ?? (embedded?.url as string);
const base = await startServer(
  parseServerConfig(
    ["--listen", "127.0.0.1:0", "--min-ttl", "50ms", "--database-url", databaseUrl],
    {},
  ),
  createLogger({ level: "silent" }),
);

async function serverLeftMs(key: { accountId: string; sessionId: string }): Promise<number> {
  const [row] = await base.sql<{ leftMs: number }[]>`
    SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8 AS left_ms
    FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  return row?.leftMs ?? Number.NaN;
}

/** A separate `leasehold serve` process on the same database. */
async function spawnServe(): Promise<{ url: string; kill: () => Promise<void> }> {
  const child = spawn(
    process.execPath,
    [
      path.join(repoRoot, "bin/leasehold.js"),
      "serve",
      "--listen",
      "127.0.0.1:0",
      "--min-ttl",
      "50ms",
      "--database-url",
      databaseUrl,
    ],
    {
      cwd: repoRoot,
      stdio: ["ignore", "ignore", "pipe"],
      env: { ...process.env, LEASEHOLD_LOG_LEVEL: "warn" },
    },
  );
  let text = "";
  const url = await new Promise<string>((resolve, reject) => {
    child.stderr?.on("data", (c: Buffer) => {
      text += c.toString();
      const m = /serving on (http:\/\/\S+)/.exec(text);
      if (m?.[1]) resolve(m[1]);
    });
    child.once("exit", () => reject(new Error(text)));
  });
  return {
    url,
    kill: async () => {
      child.kill("SIGKILL");
      await once(child, "exit");
    },
  };
}

type Fault = "drop" | "stall" | "kill";

async function trial(fault: Fault, i: number) {
  const key = { accountId: "bench", sessionId: `${fault}-${i}-${Date.now()}` };
  let target = base.url;
  let killServer: (() => Promise<void>) | undefined;
  if (fault === "kill") {
    const s = await spawnServe();
    target = s.url;
    killServer = s.kill;
  }
  const proxy = await startTcpProxy(target);
  const client = createLeaseClient({ baseUrl: proxy.url, defaultTimeoutMs: 1_000 });
  try {
    return await client.runExclusive(
      key,
      async (ctx) => {
        // Fault right after a renewal is confirmed: the worst case for the
        // client is a cut just after its deadline was last extended.
        const before = ctx.lease;
        while (ctx.lease === before) await new Promise((r) => setTimeout(r, 5));
        const cutAt = performance.now();
        if (fault === "drop") proxy.drop();
        else if (fault === "stall") proxy.stall();
        else await killServer?.();
        await once(ctx.signal, "abort");
        const abortedAfterMs = performance.now() - cutAt;
        const leftMs = await serverLeftMs(key);
        return { abortedAfterMs, leftMs };
      },
      { ttlMs },
    );
  } finally {
    client.close();
    await proxy.close();
  }
}

function summary(xs: number[]) {
  const s = [...xs].sort((a, b) => a - b);
  const q = (p: number) => s[Math.min(s.length - 1, Math.floor(p * s.length))] ?? Number.NaN;
  return `min ${q(0).toFixed(0)}  median ${q(0.5).toFixed(0)}  max ${(s.at(-1) ?? Number.NaN).toFixed(0)}`;
}

console.log(`TTL ${ttlMs} ms, default margin ${ttlMs / 10} ms, ${runs} runs per fault`);
try {
  for (const fault of ["drop", "stall", "kill"] as const) {
    const results = [];
    for (let i = 0; i < runs; i++) results.push(await trial(fault, i));
    console.log(
      `${fault.padEnd(5)}  abort after fault (ms): ${summary(results.map((r) => r.abortedAfterMs))}` +
        `   server-side time left at abort (ms): ${summary(results.map((r) => r.leftMs))}`,
    );
  }
} finally {
  await base.close();
  await embedded?.stop();
  await rm(dataDir, { recursive: true, force: true });
}
