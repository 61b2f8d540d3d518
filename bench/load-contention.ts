// Load generator for scenario 2: `clients` runs contend for one key, each
// looping Acquire with `wait` → Release. Measures handovers per second, the
// time from a release being sent to the next holder receiving its grant, and
// what the clients saw of S1 and S6: a grant received while another client
// still held the key, or a fencing token not above the previous one. Run by
// bench/run.ts as its own process; see load-protocol.ts.

import { randomUUID } from "node:crypto";
import { setMaxListeners } from "node:events";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { Latency, type LatencySummary } from "./latency.js";
import { loadOptions, MeasuredWindow, send, type WindowTiming } from "./load-protocol.js";

export interface ContentionOptions extends WindowTiming {
  urls: string[];
  clients: number;
  accountId: string;
  sessionId: string;
  ttlSeconds: number;
  waitSeconds: number;
}

export interface ContentionResult {
  handovers: number;
  handoversPerSec: number;
  /** Release sent → the next holder has its grant. */
  handover: LatencySummary;
  /** Grants received while another client had not yet sent its release (S1). Expected 0. */
  overlaps: number;
  /** Grants whose fencing token was not above the previous grant's (S6). Expected 0. */
  tokenRegressions: number;
  /** Waiting acquires that ended without a grant (wait elapsed). */
  waitsExpired: number;
  errors: number;
  firstError?: string;
  seconds: number;
  loadCpuCores: number;
}

async function main(): Promise<void> {
  const options = loadOptions<ContentionOptions>();
  const clients = options.urls.map((baseUrl) =>
    createClient(LeaseService, createGrpcTransport({ baseUrl })),
  );
  const key = { accountId: options.accountId, sessionId: options.sessionId };
  const ttl = { seconds: BigInt(options.ttlSeconds), nanos: 0 };
  const wait = { seconds: BigInt(options.waitSeconds), nanos: 0 };
  const handover = new Latency();
  const stop = new AbortController();
  // Every waiting Acquire listens on this one signal.
  setMaxListeners(options.clients + 10, stop.signal);
  let handovers = 0;
  let overlaps = 0;
  let tokenRegressions = 0;
  let waitsExpired = 0;
  let errors = 0;
  let firstError: string | undefined;
  // The client-side view of who holds the key, in one process and on one
  // monotonic clock: set on a grant, cleared just before the release is sent.
  let holder: string | undefined;
  let lastToken = -1n;
  let releaseSentAt: number | undefined;
  const window = new MeasuredWindow(options);
  void window.done.then(() => stop.abort());

  const run = async (i: number) => {
    const client = clients[i % clients.length] as (typeof clients)[number];
    while (!window.stopped) {
      const runId = randomUUID();
      try {
        const res = await client.acquire(
          { key, runId, ttl, wait, holder: `client-${i}` },
          { signal: stop.signal },
        );
        const grantedAt = performance.now();
        if (!res.acquired || !res.lease) {
          waitsExpired++;
          continue;
        }
        if (holder !== undefined) overlaps++;
        holder = runId;
        if (res.lease.fencingToken <= lastToken) tokenRegressions++;
        lastToken = res.lease.fencingToken;
        if (releaseSentAt !== undefined && window.counts(grantedAt)) {
          handovers++;
          handover.record(grantedAt - releaseSentAt);
        }
        if (holder === runId) holder = undefined;
        releaseSentAt = performance.now();
        await client.release({ key, runId });
      } catch (error) {
        if (stop.signal.aborted && ConnectError.from(error).code === Code.Canceled) return;
        errors++;
        firstError ??= String(error);
        if (errors > 1000) throw error;
        await new Promise((r) => setTimeout(r, 10));
      }
    }
  };

  const runs = Array.from({ length: options.clients }, (_, i) => run(i));
  await window.done;
  await Promise.all(runs);
  const result: ContentionResult = {
    handovers,
    handoversPerSec: Math.round(handovers / window.seconds),
    handover: handover.summary(),
    overlaps,
    tokenRegressions,
    waitsExpired,
    errors,
    firstError,
    seconds: window.seconds,
    loadCpuCores: Math.round(window.cpuCores * 100) / 100,
  };
  send({ phase: "result", result });
  process.exit(0);
}

await main();
