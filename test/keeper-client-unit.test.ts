// The keeper client's own rules (L2 and re-attach), against a scripted Keep
// server: the answers a real server gives only in a fault (held past the
// deadline, a stream cut while an acquire is in flight) are sent on cue.
// The rules against a real server and PostgreSQL: test/keeper-client.test.ts.

import { once } from "node:events";
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { afterEach, describe, expect, it } from "vitest";
import { createLeaseClient, durationFromMs, LeaseLostError } from "../src/client/index.js";
import { RequestQueue } from "../src/client/request-queue.js";
import {
  KeeperSchema,
  type KeepRequest,
  type KeepResponseSchema,
  LeaseSchema,
  LeaseService,
  LossReason,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { listen } from "../src/host/listener.js";

type Answer = MessageInitShape<typeof KeepResponseSchema>;

/** One Keep stream as the script sees it: what came in, and a way to answer or cut it. */
interface ScriptedStream {
  readonly n: number;
  answer(message: Answer): void;
  cut(): void;
}

async function scriptedKeepServer(
  onRequest: (stream: ScriptedStream, request: KeepRequest) => void,
) {
  let streams = 0;
  const listener = await listen({
    host: "127.0.0.1",
    port: 0,
    handler: connectNodeAdapter({
      routes: (router: ConnectRouter) =>
        router.service(LeaseService, {
          keep: (requests) => {
            const out = new RequestQueue<Answer | Error>();
            const stream: ScriptedStream = {
              n: ++streams,
              answer: (message) => out.push(message),
              cut: () => out.push(new ConnectError("cut by the script", Code.Unavailable)),
            };
            void (async () => {
              for await (const request of requests) onRequest(stream, request);
            })().catch(() => {});
            return (async function* () {
              for await (const message of out) {
                if (message instanceof Error) throw message;
                yield message;
              }
            })();
          },
        }),
    }),
  });
  return { url: `http://127.0.0.1:${listener.port}`, close: () => listener.close(0) };
}

const keeperAnswer = (id: bigint, remainingMs: number): Answer => ({
  id,
  result: {
    case: "keeper",
    value: create(KeeperSchema, { keeperId: "k", remaining: durationFromMs(remainingMs) }),
  },
});

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
});

describe("keeper client, scripted server", () => {
  it("L2: the keeper's local deadline is the open's send time + remaining − margin; a heartbeat answered after it revives nothing", async () => {
    const held: { stream: ScriptedStream; id: bigint }[] = [];
    const opens: string[] = [];
    const server = await scriptedKeepServer((stream, request) => {
      if (request.op.case === "open") {
        opens.push(request.op.value.keeperId);
        // Only the first open is answered: every later one (the stall
        // watch's reconnects) stalls as the heartbeats do.
        if (opens.length === 1) stream.answer(keeperAnswer(request.id, 1_000));
        else held.push({ stream, id: request.id });
      } else {
        held.push({ stream, id: request.id });
      }
    });
    cleanups.push(server.close);
    const client = createLeaseClient({
      baseUrl: server.url,
      reconnectBackoff: { initialMs: 10, maxMs: 20 },
    });
    cleanups.push(() => client.close());
    const before = performance.now();
    const keeper = await client.openKeeper({ accountId: "acme", ttlMs: 1_000 });
    const after = performance.now();
    await once(keeper.signal, "abort");
    const abortedAt = performance.now();
    const reason = keeper.signal.reason as LeaseLostError;
    expect(reason).toBeInstanceOf(LeaseLostError);
    expect(reason.lossReason).toBe("deadline");
    // Sent between `before` and `after`; 1 000 ms remaining − the 100 ms margin.
    expect(abortedAt).toBeGreaterThanOrEqual(before + 900);
    expect(abortedAt).toBeLessThan(after + 1_000);
    // The stalled stream was given up and the same keeper re-attached.
    expect(opens.length).toBeGreaterThanOrEqual(2);
    expect(new Set(opens)).toEqual(new Set([keeper.id]));
    // A late answer arrives: the keeper stays lost.
    for (const { stream, id } of held) stream.answer(keeperAnswer(id, 1_000));
    expect(keeper.signal.aborted).toBe(true);
    expect(keeper.remainingMs()).toBe(0);
  });

  it("re-attach: a stream cut while an acquire is in flight re-opens the same keeper and sends the acquire again with its run id", async () => {
    const acquires: { stream: number; runId: string }[] = [];
    const opens: { stream: number; keeperId: string }[] = [];
    const server = await scriptedKeepServer((stream, request) => {
      switch (request.op.case) {
        case "open":
          opens.push({ stream: stream.n, keeperId: request.op.value.keeperId });
          stream.answer(keeperAnswer(request.id, 10_000));
          break;
        case "acquire": {
          const { key, runId } = request.op.value;
          acquires.push({ stream: stream.n, runId });
          if (stream.n === 1) {
            stream.cut();
            break;
          }
          stream.answer({
            id: request.id,
            result: {
              case: "acquire",
              value: {
                acquired: true,
                lease: create(LeaseSchema, {
                  key,
                  runId,
                  fencingToken: 7n,
                  remaining: durationFromMs(10_000),
                }),
              },
            },
          });
          break;
        }
        default:
          break;
      }
    });
    cleanups.push(server.close);
    const client = createLeaseClient({
      baseUrl: server.url,
      reconnectBackoff: { initialMs: 10, maxMs: 20 },
    });
    cleanups.push(() => client.close());
    const keeper = await client.openKeeper({ accountId: "acme", ttlMs: 10_000 });
    const answer = await keeper.acquire({ key: { accountId: "acme", sessionId: "s1" } });
    expect(answer.acquired).toBe(true);
    expect(answer.lease?.fencingToken).toBe(7n);
    expect(acquires.map((a) => a.stream)).toEqual([1, 2]);
    expect(acquires[1]?.runId).toBe(acquires[0]?.runId);
    expect(opens).toEqual([
      { stream: 1, keeperId: keeper.id },
      { stream: 2, keeperId: keeper.id },
    ]);
    expect(keeper.signal.aborted).toBe(false);
  });

  it("K1: lease_lost of one lease aborts only its run; the keeper's lost aborts every run at once", async () => {
    const runs = new Map<string, ScriptedStream>();
    const server = await scriptedKeepServer((stream, request) => {
      if (request.op.case === "open") stream.answer(keeperAnswer(request.id, 10_000));
      if (request.op.case === "acquire") {
        const { key, runId } = request.op.value;
        runs.set(key?.sessionId ?? "", stream);
        stream.answer({
          id: request.id,
          result: {
            case: "acquire",
            value: {
              acquired: true,
              lease: create(LeaseSchema, { key, runId, remaining: durationFromMs(10_000) }),
            },
          },
        });
      }
    });
    cleanups.push(server.close);
    const client = createLeaseClient({ baseUrl: server.url });
    cleanups.push(() => client.close());
    const keeper = await client.openKeeper({ accountId: "acme", ttlMs: 10_000 });
    const contexts = new Map<string, { signal: AbortSignal; runId: string }>();
    let allHeld!: () => void;
    const held = new Promise<void>((resolve) => {
      allHeld = resolve;
    });
    const run = (sessionId: string) =>
      keeper.runExclusive({ accountId: "acme", sessionId }, async (ctx) => {
        contexts.set(sessionId, ctx);
        if (contexts.size === 3) allHeld();
        if (!ctx.signal.aborted) await once(ctx.signal, "abort");
        return (ctx.signal.reason as LeaseLostError).lossReason;
      });
    const done = Promise.all(["a", "b", "c"].map(run));
    await held;
    const a = contexts.get("a");
    if (!a) throw new Error("run a is not held");
    runs.get("a")?.answer({
      id: 0n,
      result: {
        case: "leaseLost",
        value: {
          key: { accountId: "acme", sessionId: "a" },
          runId: a?.runId,
          reason: LossReason.REVOKED,
        },
      },
    });
    if (!a.signal.aborted) await once(a.signal, "abort");
    expect((a.signal.reason as LeaseLostError).lossReason).toBe("revoked");
    expect(contexts.get("b")?.signal.aborted).toBe(false);
    expect(contexts.get("c")?.signal.aborted).toBe(false);
    expect(keeper.signal.aborted).toBe(false);
    runs.get("b")?.answer({
      id: 0n,
      result: { case: "lost", value: { reason: LossReason.REVOKED, detail: "by the test" } },
    });
    expect(await done).toEqual(["revoked", "revoked", "revoked"]);
    expect((keeper.signal.reason as LeaseLostError).message).toMatch(/revoked: by the test/);
  });
});
