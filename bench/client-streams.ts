// Probe: what the client library's shared KeepAlive stream costs per
// renewal in the caller's process. Starts an embedded PostgreSQL and the
// lease server as a separate process, acquires N leases, then renews them
// at a steady rate from this process in two ways that take turns inside
// every round, over the client's own gRPC transport:
//
//   library  the KeepAliveChannel behind runExclusive: N registered leases,
//            each renewal a `renew()` (its stall watch, answer dispatch and
//            deadline bookkeeping included);
//   bare     connect's createClient over the same transport, requests
//            pushed onto one stream and answers counted in a for-await loop:
//            the least a caller can do with the generated client.
//
// Reported per way: answered renewals/s and this process's CPU per answered
// renewal (process.cpuUsage, user + system, over the window), medians of
// the rounds, and library ÷ bare.
//
// Run: npm run build && npx tsx bench/client-streams.ts [--leases N] [--rate N]
//      [--rounds N] [--window-ms N] [--json FILE]

import { writeFileSync } from "node:fs";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { durationFromMs } from "../src/client/index.js";
import { KeepAliveChannel, type KeepAliveRegistration } from "../src/client/keepalive.js";
import { RequestQueue } from "../src/client/request-queue.js";
import { type KeepAliveRequestSchema, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { benchArgs, positiveInteger } from "./support/arguments.js";
import { cleanupsOnSignal } from "./support/cleanups.js";
import { spawnLeasehold, startBenchDatabase } from "./support/environment.js";

const usage = `usage: npx tsx bench/client-streams.ts [options]

  --leases N      leases kept alive (default 5000)
  --rate N        renewals per second, spread evenly over the leases (default 4000)
  --rounds N      rounds, the two ways taking turns in each (default 3)
  --window-ms N   measured window per way and round (default 5000)
  --json FILE     also write the figures to FILE
`;
const { values } = benchArgs(
  {
    leases: { type: "string", default: "5000" },
    rate: { type: "string", default: "4000" },
    rounds: { type: "string", default: "3" },
    "window-ms": { type: "string", default: "5000" },
    json: { type: "string" },
  },
  usage,
);
const leases = positiveInteger("leases", values.leases, usage);
const rate = positiveInteger("rate", values.rate, usage);
const rounds = positiveInteger("rounds", values.rounds, usage);
const windowMs = positiveInteger("window-ms", values["window-ms"], usage);

const log = (line: string) => process.stderr.write(`${line}\n`);
const cleanups = cleanupsOnSignal(log, "the database and the server");
const accountId = "bench-client";
const ttl = durationFromMs(60_000);
type KeepAliveInit = MessageInitShape<typeof KeepAliveRequestSchema>;

/** Calls `renew(i)` for lease after lease at `rate` per second until stopped. */
function pace(renew: (i: number) => void): () => void {
  const t0 = performance.now();
  let sent = 0;
  const timer = setInterval(() => {
    const due = Math.floor(((performance.now() - t0) / 1000) * rate);
    for (; sent < due; sent++) renew(sent % leases);
  }, 5);
  return () => clearInterval(timer);
}

interface Way {
  start(count: () => void): Promise<() => Promise<void>>;
}

function library(url: string, runIds: string[]): Way {
  return {
    async start(count) {
      const channel = new KeepAliveChannel({ baseUrls: [url], transport: { protocol: "grpc" } });
      const registrations: KeepAliveRegistration[] = runIds.map((runId, i) =>
        channel.register({
          key: { accountId, sessionId: `s${i}` },
          runId,
          responseTimeoutMs: 10_000,
          onRenewed: count,
          onLost: () => {
            throw new Error(`lease s${i} lost`);
          },
          onHandoffRequested: () => {},
          onFailed: (error) => {
            throw error;
          },
        }),
      );
      const stop = pace((i) => registrations[i]?.renew());
      return async () => {
        stop();
        channel.close();
      };
    },
  };
}

function bare(url: string, runIds: string[]): Way {
  return {
    async start(count) {
      const transport = createGrpcTransport({ baseUrl: url });
      const client = createClient(LeaseService, transport);
      const queue = new RequestQueue<KeepAliveInit>();
      const abort = new AbortController();
      const requests = runIds.map((runId, i) => ({
        key: { accountId, sessionId: `s${i}` },
        runId,
      }));
      const reading = (async () => {
        for await (const answer of client.keepAlive(queue, {
          signal: abort.signal,
          timeoutMs: 0,
        })) {
          if (answer.result.case === "lease") count();
        }
      })().catch(() => {});
      const stop = pace((i) => queue.push(requests[i] as KeepAliveInit));
      return async () => {
        stop();
        queue.end();
        await reading;
        abort.abort();
        transport.close();
      };
    },
  };
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 === 1 ? (s[m] as number) : ((s[m - 1] as number) + (s[m] as number)) / 2;
};

try {
  const db = await startBenchDatabase();
  cleanups.push(() => db.stop());
  // One stream carries every lease in both ways: lift the per-stream bound
  // (1,000 by default) and the account quota, which are not measured here.
  const server = await spawnLeasehold(db.url, [
    "--max-leases-per-account",
    "0",
    "--max-leases-per-stream",
    String(Math.max(1_000, leases)),
  ]);
  cleanups.push(() => server.stop());
  log(
    `client-streams: ${leases} leases, ${rate} renewals/s, ${rounds} rounds × ${windowMs} ms per way, gRPC (the client's transport), server ${server.url}`,
  );
  const setup = createClient(LeaseService, createGrpcTransport({ baseUrl: server.url }));
  const runIds: string[] = [];
  for (let i = 0; i < leases; i += 64) {
    const batch = await Promise.all(
      Array.from({ length: Math.min(64, leases - i) }, (_, k) =>
        setup.acquire({ key: { accountId, sessionId: `s${i + k}` }, ttl }),
      ),
    );
    for (const a of batch) {
      if (!a.acquired || !a.lease) throw new Error("setup could not acquire a lease");
      runIds.push(a.lease.runId);
    }
  }
  const ways = { library: library(server.url, runIds), bare: bare(server.url, runIds) };
  const figures: Record<keyof typeof ways, { perSecond: number[]; cpuUs: number[] }> = {
    library: { perSecond: [], cpuUs: [] },
    bare: { perSecond: [], cpuUs: [] },
  };
  for (let round = 0; round < rounds; round++) {
    // Alternate the order, so a burst of other work falls on both.
    const order = (
      round % 2 === 0 ? ["library", "bare"] : ["bare", "library"]
    ) as (keyof typeof ways)[];
    for (const name of order) {
      let answered = 0;
      const stop = await ways[name].start(() => {
        answered += 1;
      });
      await new Promise((r) => setTimeout(r, 1_000)); // warm-up
      const from = { answered, cpu: process.cpuUsage(), at: performance.now() };
      await new Promise((r) => setTimeout(r, windowMs));
      const cpu = process.cpuUsage(from.cpu);
      const seconds = (performance.now() - from.at) / 1000;
      const n = answered - from.answered;
      await stop();
      figures[name].perSecond.push(n / seconds);
      figures[name].cpuUs.push((cpu.user + cpu.system) / n);
      log(
        `round ${round + 1} ${name.padEnd(7)} ${Math.round(n / seconds)} renewals/s, ${((cpu.user + cpu.system) / n).toFixed(1)} µs CPU per renewal`,
      );
    }
  }
  const result = {
    leases,
    rate,
    rounds,
    windowMs,
    library: {
      renewalsPerSecond: Math.round(median(figures.library.perSecond)),
      cpuUsPerRenewal: Number(median(figures.library.cpuUs).toFixed(1)),
    },
    bare: {
      renewalsPerSecond: Math.round(median(figures.bare.perSecond)),
      cpuUsPerRenewal: Number(median(figures.bare.cpuUs).toFixed(1)),
    },
    libraryOverBare: Number(
      (median(figures.library.cpuUs) / median(figures.bare.cpuUs)).toFixed(2),
    ),
  };
  log(
    `medians: library ${result.library.cpuUsPerRenewal} µs, bare ${result.bare.cpuUsPerRenewal} µs per renewal; library ÷ bare ${result.libraryOverBare}`,
  );
  process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
  if (values.json) writeFileSync(values.json, `${JSON.stringify(result, null, 2)}\n`);
} finally {
  await cleanups.run();
}
