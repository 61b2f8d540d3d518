// Load generator for scenario 4: `watchers` Watch streams on one account
// (key.session_id empty), while a driver acquires and releases a fresh
// session of that account `rate` times a second. For every release it
// measures the time from the Release being sent to each watcher receiving
// RELEASED, and to the last of them. Run by bench/run.ts as its own process;
// see load-protocol.ts.
//
// The watchers run in `processes` processes of their own (load-watchers.ts),
// each over its share of `connections`, and this process only drives. In
// one process with the driver, the watchers' side was a bound of its own:
// it handles each event once per watcher (an ACQUIRED and a RELEASED to
// 1,000 watchers per cycle, ~13 µs each) while the server writes a release
// to all 1,000 streams in 3–9 ms; the driver's Release answers waited
// behind it too. Real watchers are devices of their own. Three alternating
// pairs of 20 s windows (1,000 watchers): one process p50 27–29 ms, p99
// 62–71 ms; two processes p50 20–27 ms, p99 37–65 ms.

import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { fileURLToPath } from "node:url";
import { createLeaseClient } from "../src/client/index.js";
import { Latency, type LatencySummary } from "./latency.js";
import { epochMs, loadOptions, MeasuredWindow, send, type WindowTiming } from "./load-protocol.js";
import type {
  WatcherGroupMessage,
  WatcherGroupOptions,
  WatcherGroupResult,
} from "./load-watchers.js";

export interface WatchOptions extends WindowTiming {
  urls: string[];
  watchers: number;
  connections: number;
  /** Processes the watchers are spread over. */
  processes: number;
  accountId: string;
  /** Releases per second the driver aims for. */
  rate: number;
  ttlSeconds: number;
  /** How long after the window to wait for the last deliveries. */
  graceMs: number;
}

export interface WatchResult {
  watchers: number;
  processes: number;
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
  /** When the Release was sent, ms since the epoch (epochMs). */
  sentAt: number;
  measured: boolean;
  /** Groups all of whose watchers have it. */
  complete: number;
}

interface Group {
  ready: Promise<void>;
  stop(): Promise<WatcherGroupResult>;
}

const groupScript = fileURLToPath(new URL("./load-watchers.ts", import.meta.url));

/** Starts one process of watchers; `onComplete` hears of each session all of them have seen released. */
function startGroup(options: WatcherGroupOptions, onComplete: (session: string) => void): Group {
  const child = spawn(process.execPath, ["--import", "tsx", groupScript, JSON.stringify(options)], {
    stdio: ["pipe", "pipe", "inherit"],
  });
  let ready: () => void = () => {};
  let failed: (error: Error) => void = () => {};
  let result: (r: WatcherGroupResult) => void = () => {};
  let lost: (error: Error) => void = () => {};
  const readyPromise = new Promise<void>((resolve, reject) => {
    ready = resolve;
    failed = reject;
  });
  const resultPromise = new Promise<WatcherGroupResult>((resolve, reject) => {
    result = resolve;
    lost = reject;
  });
  // 'close' comes after the last line was read: a group that ends without
  // its result (or before it is ready) must not leave the driver waiting.
  child.once("close", (code) => {
    const error = new Error(`a watcher process exited with ${code} before its result`);
    failed(error);
    lost(error);
  });
  let buffered = "";
  child.stdout.on("data", (chunk: Buffer) => {
    buffered += chunk.toString();
    for (let nl = buffered.indexOf("\n"); nl >= 0; nl = buffered.indexOf("\n")) {
      const message = JSON.parse(buffered.slice(0, nl)) as WatcherGroupMessage;
      buffered = buffered.slice(nl + 1);
      if (message.type === "ready") ready();
      else if (message.type === "failed") failed(new Error(message.error));
      else if (message.type === "complete") onComplete(message.session);
      else result(message);
    }
  });
  return {
    ready: readyPromise,
    stop: () => {
      child.stdin.write("stop\n");
      return resultPromise;
    },
  };
}

async function main(): Promise<void> {
  const options = loadOptions<WatchOptions>();
  const releases = new Map<string, Release>();
  const share = (total: number, i: number) =>
    Math.floor(total / options.processes) + (i < total % options.processes ? 1 : 0);
  const subscribeStart = performance.now();
  const groups = Array.from({ length: options.processes }, (_, i) =>
    startGroup(
      {
        urls: options.urls,
        watchers: share(options.watchers, i),
        connections: Math.max(1, share(options.connections, i)),
        accountId: options.accountId,
      },
      (session) => {
        const release = releases.get(session);
        if (release) release.complete++;
      },
    ),
  );
  await Promise.all(groups.map((g) => g.ready));
  const subscribeSeconds = (performance.now() - subscribeStart) / 1000;

  const window = new MeasuredWindow(options);
  // The driver has a connection of its own: the watchers' connections are
  // full of streams, and the server caps streams per connection.
  const driver = createLeaseClient({ baseUrl: options.urls[0] as string, protocol: "grpc" });
  const ttl = { seconds: BigInt(options.ttlSeconds), nanos: 0 };
  const intervalMs = 1000 / options.rate;
  let measured = 0;
  let errors = 0;
  let firstError: string | undefined;
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
      const inWindow = window.counts(performance.now());
      if (inWindow) measured++;
      releases.set(key.sessionId, { sentAt: epochMs(), measured: inWindow, complete: 0 });
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
    [...releases.values()].some((r) => r.measured && r.complete < options.processes);
  while (pending() && performance.now() < graceEnd) await new Promise((r) => setTimeout(r, 20));
  const results = await Promise.all(groups.map((g) => g.stop()));

  const toAll = new Latency();
  const toAllMs: number[] = [];
  const perDelivery = new Latency();
  const received = new Map<string, number[]>();
  for (const r of results) {
    for (const [session, times] of r.receipts) {
      const all = received.get(session);
      if (all) all.push(...times);
      else received.set(session, [...times]);
    }
  }
  let missing = 0;
  for (const [session, release] of releases) {
    if (!release.measured) continue;
    const times = received.get(session) ?? [];
    missing += options.watchers - times.length;
    for (const t of times) perDelivery.record(t - release.sentAt);
    if (times.length === options.watchers) {
      const last = Math.max(...times) - release.sentAt;
      toAll.record(last);
      toAllMs.push(Math.round(last * 1000) / 1000);
    }
  }
  const result: WatchResult = {
    watchers: options.watchers,
    processes: options.processes,
    subscribeSeconds: Math.round(subscribeSeconds * 10) / 10,
    releases: measured,
    releasesPerSec: Math.round((measured / window.seconds) * 10) / 10,
    toAll: toAll.summary(),
    toAllMs,
    perDelivery: perDelivery.summary(),
    missing,
    resyncs: results.reduce((sum, r) => sum + r.resyncs, 0),
    errors: errors + results.reduce((sum, r) => sum + r.errors, 0),
    firstError: firstError ?? results.find((r) => r.firstError)?.firstError,
    seconds: window.seconds,
    loadCpuCores: Math.round(window.cpuCores * 100) / 100,
  };
  send({ phase: "result", result });
  process.exit(0);
}

await main();
