// Load generator for scenario 4: `watchers` Watch streams on one account
// (key.session_id empty), spread over `connections` HTTP/2 connections, while
// a driver acquires and releases a fresh session of that account `rate` times
// a second. For every release it measures the time from the Release being
// sent to each watcher receiving RELEASED, and to the last of them. Run by
// bench/run.ts as its own process; see load-protocol.ts.

import { randomUUID } from "node:crypto";
import { setMaxListeners } from "node:events";
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { EventType, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { Latency, type LatencySummary } from "./latency.js";
import { loadOptions, MeasuredWindow, send, type WindowTiming } from "./load-protocol.js";

export interface WatchOptions extends WindowTiming {
  urls: string[];
  watchers: number;
  connections: number;
  accountId: string;
  /** Releases per second the driver aims for. */
  rate: number;
  ttlSeconds: number;
  /** How long after the window to wait for the last deliveries. */
  graceMs: number;
}

export interface WatchResult {
  watchers: number;
  /** Time for all watchers to be subscribed (first snapshot received). */
  subscribeSeconds: number;
  releases: number;
  releasesPerSec: number;
  /** Release sent → the last watcher has RELEASED. */
  toAll: LatencySummary;
  /** The same, each release (dozens per window), so rounds can be pooled. */
  toAllMs: number[];
  /** Release sent → one watcher has RELEASED, over every delivery. */
  perDelivery: LatencySummary;
  /** Deliveries still missing after the grace period. Expected 0. */
  missing: number;
  /** Snapshots after the first: the server could not vouch for the stream. */
  resyncs: number;
  errors: number;
  firstError?: string;
  seconds: number;
  loadCpuCores: number;
}

interface Release {
  sentAt: number;
  received: number;
  measured: boolean;
}

async function main(): Promise<void> {
  const options = loadOptions<WatchOptions>();
  const clients = Array.from({ length: options.connections }, (_, i) =>
    createClient(
      LeaseService,
      createGrpcTransport({ baseUrl: options.urls[i % options.urls.length] as string }),
    ),
  );
  const toAll = new Latency();
  const toAllMs: number[] = [];
  const perDelivery = new Latency();
  const releases = new Map<string, Release>();
  const stop = new AbortController();
  // Every Watch call listens on this one signal.
  setMaxListeners(options.watchers + 10, stop.signal);
  let resyncs = 0;
  let errors = 0;
  let firstError: string | undefined;
  let subscribed = 0;
  let allSubscribed: () => void = () => {};
  let subscribeFailed: (error: unknown) => void = () => {};
  const ready = new Promise<void>((resolve, reject) => {
    allSubscribed = resolve;
    subscribeFailed = reject;
  });

  const watch = async (i: number) => {
    const client = clients[i % clients.length] as (typeof clients)[number];
    let snapshots = 0;
    try {
      for await (const res of client.watch(
        { key: { accountId: options.accountId, sessionId: "" } },
        { signal: stop.signal },
      )) {
        const now = performance.now();
        if (res.kind.case === "snapshot") {
          if (snapshots++ === 0 && ++subscribed === options.watchers) allSubscribed();
          else if (snapshots > 1) resyncs++;
          continue;
        }
        const event = res.kind.case === "event" ? res.kind.value : undefined;
        if (event?.type !== EventType.RELEASED) continue;
        const release = releases.get(event.key?.sessionId ?? "");
        if (!release) continue;
        release.received++;
        if (!release.measured) continue;
        perDelivery.record(now - release.sentAt);
        if (release.received === options.watchers) {
          toAll.record(now - release.sentAt);
          toAllMs.push(Math.round((now - release.sentAt) * 1000) / 1000);
        }
      }
    } catch (error) {
      if (stop.signal.aborted) return;
      // A watcher refused before its snapshot (a limit, say) would leave the
      // run waiting for all of them forever.
      if (snapshots === 0) subscribeFailed(error);
      errors++;
      firstError ??= String(error);
    }
  };

  const subscribeStart = performance.now();
  const watches = Array.from({ length: options.watchers }, (_, i) => watch(i));
  await ready;
  const subscribeSeconds = (performance.now() - subscribeStart) / 1000;

  const window = new MeasuredWindow(options);
  // The driver has a connection of its own: the watchers' connections are
  // full of streams, and the server caps streams per connection.
  const driver = createClient(
    LeaseService,
    createGrpcTransport({ baseUrl: options.urls[0] as string }),
  );
  const ttl = { seconds: BigInt(options.ttlSeconds), nanos: 0 };
  const intervalMs = 1000 / options.rate;
  let measured = 0;
  for (let next = performance.now(); !window.stopped; next += intervalMs) {
    const delay = next - performance.now();
    if (delay > 0) await new Promise((r) => setTimeout(r, delay));
    const key = { accountId: options.accountId, sessionId: `s-${randomUUID()}` };
    const runId = randomUUID();
    try {
      const res = await driver.acquire(
        { key, runId, ttl, holder: "driver" },
        { timeoutMs: 10_000 },
      );
      if (!res.acquired) throw new Error(`fresh session ${key.sessionId} was not acquired`);
      const sentAt = performance.now();
      const inWindow = window.counts(sentAt);
      if (inWindow) measured++;
      releases.set(key.sessionId, { sentAt, received: 0, measured: inWindow });
      await driver.release({ key, runId }, { timeoutMs: 10_000 });
    } catch (error) {
      errors++;
      firstError ??= String(error);
      if (errors > 100) throw error;
    }
  }
  // Let the last releases of the window reach every watcher.
  const graceEnd = performance.now() + options.graceMs;
  const pending = () =>
    [...releases.values()].some((r) => r.measured && r.received < options.watchers);
  while (pending() && performance.now() < graceEnd) await new Promise((r) => setTimeout(r, 20));
  let missing = 0;
  for (const r of releases.values()) if (r.measured) missing += options.watchers - r.received;
  stop.abort();
  await Promise.all(watches);
  const result: WatchResult = {
    watchers: options.watchers,
    subscribeSeconds: Math.round(subscribeSeconds * 10) / 10,
    releases: measured,
    releasesPerSec: Math.round((measured / window.seconds) * 10) / 10,
    toAll: toAll.summary(),
    toAllMs,
    perDelivery: perDelivery.summary(),
    missing,
    resyncs,
    errors,
    firstError,
    seconds: window.seconds,
    loadCpuCores: Math.round(window.cpuCores * 100) / 100,
  };
  send({ phase: "result", result });
  process.exit(0);
}

await main();
