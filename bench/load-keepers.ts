// Load generator for the keepers scenario's hold: `keepers` keepers holding
// `leasesPerKeeper` leases each, kept alive by their heartbeats alone, against
// etcd's equivalent (one lease per keeper with its keys attached, kept alive
// over LeaseKeepAlive). Setup (open, acquire or put every key) runs before the
// warm-up; the window measures heartbeat → answer on each keeper's Keep
// stream (or keepalive → answer on etcd) while nothing else happens. Run by
// bench/run.ts as its own process; see load-protocol.ts.

import { randomUUID } from "node:crypto";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import { Etcd3 } from "etcd3";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { RequestQueue } from "../src/client/request-queue.js";
import {
  type KeepRequestSchema,
  type KeepResponse,
  LeaseService,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { Latency, type LatencySummary } from "./latency.js";
import { loadOptions, MeasuredWindow, send, type WindowTiming } from "./load-protocol.js";

export type HoldTarget = { kind: "keepers"; urls: string[] } | { kind: "etcd"; url: string };

export interface HoldOptions extends WindowTiming {
  target: HoldTarget;
  keepers: number;
  leasesPerKeeper: number;
  ttlSeconds: number;
  /** Each keeper's heartbeat (etcd: each lease's keepalive) every this many ms. */
  heartbeatMs: number;
}

export interface HoldResult {
  leases: number;
  setupSeconds: number;
  heartbeats: number;
  /** Heartbeats answered `lost` or with an error (etcd: TTL 0). Expected 0. */
  lost: number;
  errors: number;
  firstError?: string;
  roundTrip: LatencySummary;
  seconds: number;
  loadCpuCores: number;
}

/**
 * Acquires of one stream in flight during setup (the server allows 256,
 * --max-keeper-ops-in-flight); 100 keepers at once make it 1,600.
 */
const setupInFlight = 16;

/** UNAVAILABLE and DEADLINE_EXCEEDED: the database was busy; the same request may succeed. */
const retried = new Set([Code.Unavailable, Code.DeadlineExceeded]);

/**
 * The heartbeats of every keeper, from its open on: a keeper must beat
 * through the setup too (acquiring 1,000 leases takes longer than a TTL).
 * Only those answered inside the measured window are counted.
 */
class Beats {
  window: MeasuredWindow | undefined;
  readonly roundTrip = new Latency();
  heartbeats = 0;
  lost = 0;
  firstError: string | undefined;
  private readonly timers: NodeJS.Timeout[] = [];

  constructor(
    private readonly intervalMs: number,
    private readonly count: number,
  ) {}

  /** Beats keeper number `i` every interval, each keeper in its own slot of it. */
  start(i: number, heartbeat: () => Promise<number>): void {
    const beat = () =>
      heartbeat().then(
        (ms) => {
          if (!this.window?.counts(performance.now())) return;
          this.heartbeats++;
          this.roundTrip.record(ms);
        },
        (error: unknown) => {
          this.lost++;
          this.firstError ??= String(error);
        },
      );
    const slot = (this.intervalMs * i) / this.count;
    this.timers.push(
      setTimeout(() => {
        void beat();
        this.timers.push(setInterval(beat, this.intervalMs));
      }, slot),
    );
  }

  stop(): void {
    for (const t of this.timers) clearInterval(t);
  }
}

/** One keeper on a raw Keep stream: requests by id, answers matched by id. */
async function openKeeper(
  url: string,
  transport: ReturnType<typeof createGrpcTransport>,
  accountId: string,
  options: HoldOptions,
  startBeats: (heartbeat: () => Promise<number>) => void,
): Promise<void> {
  const queue = new RequestQueue<MessageInitShape<typeof KeepRequestSchema>>();
  const waiting = new Map<bigint, (answer: KeepResponse) => void>();
  let nextId = 1n;
  const ask = (op: MessageInitShape<typeof KeepRequestSchema>["op"]) =>
    new Promise<KeepResponse>((resolve) => {
      const id = nextId++;
      waiting.set(id, resolve);
      queue.push({ id, op });
    });
  // Not awaited before the open is queued: the server answers the call's
  // headers once it has read the first request.
  const opening = transport.stream(LeaseService.method.keep, undefined, 0, undefined, queue);
  const ttl = { seconds: BigInt(options.ttlSeconds), nanos: 0 };
  const open = ask({ case: "open", value: { accountId, ttl, holder: "bench" } });
  const response = await opening;
  void (async () => {
    for await (const answer of response.message) {
      const resolve = waiting.get(answer.id);
      waiting.delete(answer.id);
      resolve?.(answer);
    }
  })().catch((error: unknown) => process.stderr.write(`Keep stream to ${url}: ${error}\n`));
  const opened = await open;
  if (opened.result.case !== "keeper") throw new Error(`open answered ${opened.result.case}`);
  let next = 0;
  const acquireOne = async (): Promise<void> => {
    while (next < options.leasesPerKeeper) {
      const sessionId = `session-${next++}`;
      const runId = randomUUID();
      for (;;) {
        const a = await ask({ case: "acquire", value: { key: { accountId, sessionId }, runId } });
        if (a.result.case === "acquire" && a.result.value.acquired) break;
        // A database busy with the setup's burst (a statement or lock past
        // its timeout) is retried with the same run id: idempotent.
        if (a.result.case === "error" && retried.has(a.result.value.code)) {
          await new Promise((r) => setTimeout(r, 50));
          continue;
        }
        const what =
          a.result.case === "error"
            ? `error ${a.result.value.code}: ${a.result.value.message}`
            : a.result.case;
        throw new Error(`acquire of ${accountId}/${sessionId} answered ${what}`);
      }
    }
  };
  startBeats(async () => {
    const t0 = performance.now();
    const answer = await ask({ case: "heartbeat", value: {} });
    if (answer.result.case !== "keeper")
      throw new Error(`heartbeat answered ${answer.result.case}`);
    return performance.now() - t0;
  });
  await Promise.all(Array.from({ length: setupInFlight }, acquireOne));
}

async function holdKeepers(
  target: { urls: string[] },
  options: HoldOptions,
  beats: Beats,
): Promise<void> {
  // A few connections per server, as a fleet of processes would have many.
  const transports = target.urls.flatMap((baseUrl) =>
    Array.from({ length: 4 }, () => ({ baseUrl, transport: createGrpcTransport({ baseUrl }) })),
  );
  const stamp = Date.now().toString(36);
  await Promise.all(
    Array.from({ length: options.keepers }, (_, i) => {
      const { baseUrl, transport } = transports[i % transports.length] as (typeof transports)[0];
      return openKeeper(baseUrl, transport, `bench-keeper-${stamp}-${i}`, options, (beat) =>
        beats.start(i, beat),
      );
    }),
  );
}

async function holdEtcd(url: string, options: HoldOptions, beats: Beats): Promise<void> {
  const client = new Etcd3({ hosts: url });
  const stamp = Date.now().toString(36);
  await Promise.all(
    Array.from({ length: options.keepers }, async (_, i) => {
      const { ID } = await client.leaseClient.leaseGrant({ TTL: options.ttlSeconds });
      const stream = await client.leaseClient.leaseKeepAlive();
      const sent: number[] = [];
      const answered: ((ms: number) => void)[] = [];
      stream.on("data", (res) => {
        const t = sent.shift() ?? performance.now();
        answered.shift()?.(performance.now() - t);
        if (Number(res.TTL) <= 0) beats.firstError ??= `etcd lease ${ID} expired`;
      });
      beats.start(
        i,
        () =>
          new Promise<number>((resolve) => {
            sent.push(performance.now());
            answered.push(resolve);
            stream.write({ ID });
          }),
      );
      let next = 0;
      const putOne = async () => {
        while (next < options.leasesPerKeeper) {
          const key = Buffer.from(`/bench-keeper/${stamp}/${i}/session-${next++}`);
          await putAgainWhenOverloaded(() =>
            client.kv.put({ key, value: Buffer.from("held"), lease: ID }),
          );
        }
      };
      await Promise.all(Array.from({ length: 32 }, putOne));
    }),
  );
}

/**
 * One put of etcd's set-up, sent again while etcd is overloaded by it (3,200
 * puts in flight on a loaded machine time out, and the etcd3 client's
 * circuit breaker then refuses every call for 5 s): the set-up is not what
 * is measured, the hold after it is, so a put is retried for up to a minute
 * rather than failing the scenario. The set-up time printed includes it.
 */
async function putAgainWhenOverloaded(put: () => Promise<unknown>): Promise<void> {
  const giveUpAt = performance.now() + 60_000;
  for (let pause = 100; ; pause = Math.min(pause * 2, 2_000)) {
    try {
      await put();
      return;
    } catch (error) {
      if (performance.now() > giveUpAt) throw error;
      await new Promise((resolve) => setTimeout(resolve, pause));
    }
  }
}

async function main(): Promise<void> {
  const options = loadOptions<HoldOptions>();
  const beats = new Beats(options.heartbeatMs, options.keepers);
  const setupStart = performance.now();
  if (options.target.kind === "keepers") await holdKeepers(options.target, options, beats);
  else await holdEtcd(options.target.url, options, beats);
  const setupSeconds = (performance.now() - setupStart) / 1000;
  const window = new MeasuredWindow(options);
  beats.window = window;
  await window.done;
  beats.stop();
  const result: HoldResult = {
    leases: options.keepers * options.leasesPerKeeper,
    setupSeconds: Math.round(setupSeconds * 10) / 10,
    heartbeats: beats.heartbeats,
    lost: beats.lost,
    errors: beats.lost,
    firstError: beats.firstError,
    roundTrip: beats.roundTrip.summary(),
    seconds: window.seconds,
    loadCpuCores: Math.round(window.cpuCores * 100) / 100,
  };
  send({ phase: "result", result });
  process.exit(0);
}

await main();
