// Probe: what the client library's transport costs per call, in the caller's
// process. Starts an embedded PostgreSQL and the lease server as a separate
// process, then, from this process, runs Get calls and Acquire+Release cycles
// at concurrency 1 and 32 over ONE HTTP/2 connection per client option, and
// reports calls/s and this process's CPU per call (process.cpuUsage, user +
// system, over the calls completed in the window). Each figure is the median
// of its windows; the options take turns inside every round, so a burst of
// other work on the machine falls on all of them.
//
// Run: npm run build && npx tsx bench/client-transport.ts [--rounds 3] [--window-ms 3000]
//      [--only a,c] [--json FILE]

import { randomUUID } from "node:crypto";
import { writeFileSync } from "node:fs";
import http2 from "node:http2";
import os from "node:os";
import { create, type DescMessage, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Transport } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  Http2SessionManager,
} from "@connectrpc/connect-node";
import * as grpc from "@grpc/grpc-js";
import { createLeaseClient, durationFromMs } from "../src/client/index.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { benchArgs, positiveInteger } from "./support/arguments.js";
import { spawnLeasehold, startBenchDatabase } from "./support/environment.js";

// Absent before the transport of src/client existed: the probe then prices the others.
const leaseholdGrpc = await import("../src/client/grpc-transport.js").catch(() => undefined);

const usage = `usage: npx tsx bench/client-transport.ts [options]

  --rounds N        rounds, the options taking turns in each (default 3)
  --window-ms N     measured window per option and load (default 3000)
  --warmup-ms N     warm-up before each window (default 700)
  --only LIST       options to measure, comma-separated
  --json FILE       also write the figures to FILE
`;
const { values } = benchArgs(
  {
    rounds: { type: "string", default: "3" },
    "window-ms": { type: "string", default: "3000" },
    "warmup-ms": { type: "string", default: "700" },
    only: { type: "string" },
    json: { type: "string" },
  },
  usage,
);
const rounds = positiveInteger("rounds", values.rounds, usage);
const windowMs = positiveInteger("window-ms", values["window-ms"], usage);
const warmupMs = positiveInteger("warmup-ms", values["warmup-ms"], usage);

/** The calls a probe makes: the typed surface shared by createClient and createLeaseClient. */
interface ProbeClient {
  get(request: { key: { accountId: string; sessionId: string } }): Promise<unknown>;
  acquire(request: {
    key: { accountId: string; sessionId: string };
    runId: string;
    ttl: { seconds: bigint };
  }): Promise<{ acquired: boolean }>;
  release(request: {
    key: { accountId: string; sessionId: string };
    runId: string;
  }): Promise<{ released: boolean }>;
  close(): void;
}

interface ClientOption {
  id: string;
  label: string;
  make(baseUrl: string): ProbeClient;
}

function fromTransport(transport: Transport, close: () => void): ProbeClient {
  const c = createClient(LeaseService, transport);
  return { get: c.get, acquire: c.acquire, release: c.release, close };
}

// (b) A Connect Transport over @grpc/grpc-js's generic client, unary only:
// what the probe needs to price grpc-js under the same typed client.
function grpcJsTransport(baseUrl: string): { transport: Transport; close: () => void } {
  const client = new grpc.Client(new URL(baseUrl).host, grpc.credentials.createInsecure());
  const serializers = new Map<DescMessage, (value: unknown) => Buffer>();
  const serializer = (desc: DescMessage) => {
    let s = serializers.get(desc);
    if (!s) {
      s = (value: unknown) => {
        const bytes = toBinary(desc, value as never);
        return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
      };
      serializers.set(desc, s);
    }
    return s;
  };
  const transport: Transport = {
    unary(method, signal, timeoutMs, header, input) {
      const message = create(method.input, input);
      const path = `/${method.parent.typeName}/${method.name}`;
      const metadata = new grpc.Metadata();
      if (header) for (const [k, v] of new Headers(header)) metadata.set(k, v);
      const deadline = Date.now() + (timeoutMs ?? 10_000);
      return new Promise((resolve, reject) => {
        const call = client.makeUnaryRequest(
          path,
          serializer(method.input),
          (bytes: Buffer) => fromBinary(method.output, bytes),
          message,
          metadata,
          { deadline },
          (error, value) => {
            signal?.removeEventListener("abort", onAbort);
            if (error || value === undefined) {
              reject(
                new ConnectError(
                  error?.details ?? "no message",
                  error ? (error.code as number as Code) : Code.Internal,
                ),
              );
              return;
            }
            resolve({
              stream: false,
              service: method.parent,
              method,
              header: new Headers(),
              message: value,
              trailer: new Headers(),
            } as never);
          },
        );
        const onAbort = () => call.cancel();
        signal?.addEventListener("abort", onAbort);
      });
    },
    stream() {
      throw new Error("not measured");
    },
  };
  return { transport, close: () => client.close() };
}

// (c0) The floor: a bare node:http2 gRPC unary call, no interceptors, no
// header object, no error details, a deadline timer. Not a transport to
// ship: it prices what node:http2 itself costs per call.
function bareH2Transport(baseUrl: string): { transport: Transport; close: () => void } {
  const session = http2.connect(baseUrl);
  session.on("error", () => {});
  const transport: Transport = {
    unary(method, _signal, timeoutMs, _header, input) {
      const bytes = toBinary(method.input, create(method.input, input));
      const frame = Buffer.allocUnsafe(5 + bytes.byteLength);
      frame[0] = 0;
      frame.writeUInt32BE(bytes.byteLength, 1);
      frame.set(bytes, 5);
      const timeout = timeoutMs ?? 10_000;
      return new Promise((resolve, reject) => {
        const stream = session.request({
          ":method": "POST",
          ":path": `/${method.parent.typeName}/${method.name}`,
          "content-type": "application/grpc+proto",
          te: "trailers",
          "grpc-timeout": `${timeout}m`,
        });
        const timer = setTimeout(() => stream.close(http2.constants.NGHTTP2_CANCEL), timeout);
        let body: Buffer | undefined;
        let status: string | undefined;
        stream.on("response", (h) => {
          const s = h["grpc-status"];
          if (typeof s === "string") status = s;
        });
        stream.on("trailers", (t) => {
          const s = t["grpc-status"];
          if (typeof s === "string") status = s;
        });
        stream.on("data", (chunk: Buffer) => {
          body = body ? Buffer.concat([body, chunk]) : chunk;
        });
        stream.on("end", () => {
          clearTimeout(timer);
          if (status !== "0" || !body) {
            reject(new ConnectError(`grpc-status ${status}`, Code.Unknown));
            return;
          }
          resolve({
            stream: false,
            service: method.parent,
            method,
            header: new Headers(),
            message: fromBinary(method.output, body.subarray(5, 5 + body.readUInt32BE(1))),
            trailer: new Headers(),
          } as never);
        });
        stream.on("error", (e) => {
          clearTimeout(timer);
          reject(e);
        });
        stream.end(frame);
      });
    },
    stream() {
      throw new Error("not measured");
    },
  };
  return { transport, close: () => session.destroy() };
}

const allOptions: ClientOption[] = [
  {
    id: "a",
    label: "connect-node gRPC transport (before)",
    make: (baseUrl) => {
      const sessionManager = new Http2SessionManager(baseUrl);
      const transport = createGrpcTransport({ baseUrl, sessionManager, defaultTimeoutMs: 10_000 });
      return fromTransport(transport, () => sessionManager.abort());
    },
  },
  {
    id: "b",
    label: "Transport over @grpc/grpc-js",
    make: (baseUrl) => {
      const { transport, close } = grpcJsTransport(baseUrl);
      return fromTransport(transport, close);
    },
  },
  {
    id: "c0",
    label: "bare node:http2 gRPC (floor, not shippable)",
    make: (baseUrl) => {
      const { transport, close } = bareH2Transport(baseUrl);
      return fromTransport(transport, close);
    },
  },
  {
    id: "c",
    label: "src/client/grpc-transport.ts (node:http2)",
    make: (baseUrl) => {
      if (!leaseholdGrpc) throw new Error("src/client/grpc-transport.ts is missing");
      const t = leaseholdGrpc.createGrpcTransport({ baseUrl, defaultTimeoutMs: 10_000 });
      return fromTransport(t, () => t.close());
    },
  },
  {
    id: "d",
    label: "connect-node Connect protocol (reference)",
    make: (baseUrl) => {
      const sessionManager = new Http2SessionManager(baseUrl);
      const transport = createConnectTransport({
        baseUrl,
        httpVersion: "2",
        sessionManager,
        defaultTimeoutMs: 10_000,
      });
      return fromTransport(transport, () => sessionManager.abort());
    },
  },
  {
    id: "L",
    label: "createLeaseClient({protocol: grpc}) (whole library)",
    make: (baseUrl) => {
      const c = createLeaseClient({ baseUrl, protocol: "grpc" });
      return { get: c.get, acquire: c.acquire, release: c.release, close: c.close };
    },
  },
];

const only = values.only?.split(",");
const options = only ? allOptions.filter((o) => only.includes(o.id)) : allOptions;

interface Scenario {
  id: string;
  concurrency: number;
  /** One unit of work; returns the number of calls it made. */
  work: (client: ProbeClient, worker: number, tag: string) => () => Promise<number>;
}

const accountId = `probe-${randomUUID().slice(0, 8)}`;
const scenarios: Scenario[] = [1, 32].flatMap((concurrency) => [
  {
    id: `get c=${concurrency}`,
    concurrency,
    work: (client: ProbeClient, worker: number) => {
      const request = { key: { accountId, sessionId: `get-${worker}` } };
      return async () => {
        await client.get(request);
        return 1;
      };
    },
  },
  {
    id: `acquire+release c=${concurrency}`,
    concurrency,
    work: (client: ProbeClient, worker: number, tag: string) => {
      const key = { accountId, sessionId: `ar-${tag}-${worker}` };
      const runId = randomUUID();
      const ttl = durationFromMs(30_000);
      return async () => {
        const a = await client.acquire({ key, runId, ttl });
        if (!a.acquired) throw new Error("not acquired: the probe's keys are its own");
        const r = await client.release({ key, runId });
        if (!r.released) throw new Error("not released");
        return 2;
      };
    },
  },
]);

interface Window {
  calls: number;
  seconds: number;
  cpuMs: number;
}

async function measure(client: ProbeClient, scenario: Scenario, tag: string): Promise<Window> {
  let calls = 0;
  let stop = false;
  let failure: unknown;
  const workers = Array.from({ length: scenario.concurrency }, async (_, w) => {
    const step = scenario.work(client, w, tag);
    while (!stop) {
      try {
        // Not `calls += await step()`: that reads `calls` before the await
        // and drops every increment made by the other workers meanwhile.
        const made = await step();
        calls += made;
      } catch (error) {
        failure ??= error;
        stop = true;
      }
    }
  });
  await new Promise((r) => setTimeout(r, warmupMs));
  const calls0 = calls;
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  await new Promise((r) => setTimeout(r, windowMs));
  const cpu = process.cpuUsage(cpu0);
  const seconds = (performance.now() - t0) / 1000;
  const done = calls - calls0;
  stop = true;
  await Promise.all(workers);
  if (failure) throw failure;
  return { calls: done, seconds, cpuMs: (cpu.user + cpu.system) / 1000 };
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)] ?? Number.NaN;
};

async function main() {
  const load0 = os.loadavg();
  process.stderr.write("starting PostgreSQL and the lease server…\n");
  const db = await startBenchDatabase("leasehold_client_probe");
  const server = await spawnLeasehold(db.url);
  const results: Record<string, Record<string, Window[]>> = {};
  try {
    const clients = new Map(options.map((o) => [o.id, o.make(server.url)]));
    for (let round = 0; round < rounds; round++) {
      for (const scenario of scenarios) {
        // Rotate the order each round so no option always runs first.
        const order = options.map((_, i) => options[(i + round) % options.length] as ClientOption);
        for (const option of order) {
          const client = clients.get(option.id) as ProbeClient;
          const w = await measure(client, scenario, `${option.id}${round}`);
          const byOption = results[scenario.id] ?? {};
          results[scenario.id] = byOption;
          byOption[option.id] = [...(byOption[option.id] ?? []), w];
          process.stderr.write(
            `round ${round + 1}/${rounds} ${scenario.id.padEnd(20)} ${option.id.padEnd(3)} ` +
              `${Math.round(w.calls / w.seconds)} calls/s, ${(w.cpuMs / w.calls).toFixed(3)} ms CPU/call\n`,
          );
        }
      }
    }
    for (const c of clients.values()) c.close();
  } finally {
    await server.stop();
    await db.stop();
  }
  const load1 = os.loadavg();
  console.log(
    `\nmachine: ${os.cpus().length} cores, load average ${load0[0]?.toFixed(2)} → ${load1[0]?.toFixed(2)}; ` +
      `median of ${rounds} windows of ${windowMs} ms; CPU = this process, per call\n`,
  );
  console.log("| option | scenario | calls/s | client CPU ms/call |");
  console.log("| --- | --- | ---: | ---: |");
  for (const option of options) {
    for (const scenario of scenarios) {
      const ws = results[scenario.id]?.[option.id] ?? [];
      const rate = median(ws.map((w) => w.calls / w.seconds));
      const cpu = median(ws.map((w) => w.cpuMs / w.calls));
      console.log(
        `| (${option.id}) ${option.label} | ${scenario.id} | ${Math.round(rate)} | ${cpu.toFixed(3)} |`,
      );
    }
  }
  if (values.json) {
    writeFileSync(
      values.json,
      JSON.stringify({ load0, load1, windowMs, rounds, results }, null, 2),
    );
  }
}

await main();
