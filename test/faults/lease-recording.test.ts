// The interceptor sees attempts, not calls: the library's retry of a call
// left without an answer continues the call's operation.

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createContextValues } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import {
  AcquireRequestSchema,
  AcquireResponseSchema,
  KeepAliveRequestSchema,
  KeepAliveResponseSchema,
  LeaseSchema,
  LeaseService,
} from "../../src/gen/leasehold/v1/lease_pb.js";
import { recordingInterceptor } from "./lease-recording.js";
import { createRecorder, type OpEvent } from "./op-history.js";

function setUp() {
  const events: OpEvent[] = [];
  const recorder = createRecorder({
    client: 0,
    stride: 1,
    originNs: process.hrtime.bigint(),
    emit: (e) => events.push(e),
  });
  // One interceptor for every attempt, as the client has.
  const interceptor = recordingInterceptor(recorder);
  const attempt = (answer: () => unknown) =>
    interceptor(async () => ({ message: answer() }) as never)({
      stream: false,
      method: LeaseService.method.acquire,
      message: create(AcquireRequestSchema, {
        key: { accountId: "a", sessionId: "s" },
        runId: "A",
      }),
      contextValues: createContextValues(),
    } as never);
  return { events, attempt };
}

describe("lease call recording", () => {
  it("an attempt left unanswered keeps its operation open; the retry completes it", async () => {
    const { events, attempt } = setUp();
    await expect(
      attempt(() => {
        throw new ConnectError("connection reset", Code.Unavailable);
      }),
    ).rejects.toThrow();
    expect(events.map((e) => e.type)).toEqual(["invoke"]);
    const lease = create(LeaseSchema, { runId: "A", fencingToken: 7n });
    await attempt(() => create(AcquireResponseSchema, { acquired: true, lease }));
    expect(events.map((e) => [e.type, e.process, e.token, e.value?.unanswered])).toEqual([
      ["invoke", 0, undefined, undefined],
      ["ok", 0, 7, 1],
    ]);
  });

  it("a refusal completes its operation `fail`; the next call is an operation of its own", async () => {
    const { events, attempt } = setUp();
    await expect(
      attempt(() => {
        throw new ConnectError("lease not held", Code.FailedPrecondition);
      }),
    ).rejects.toThrow();
    await attempt(() => create(AcquireResponseSchema, { acquired: false }));
    expect(events.map((e) => [e.type, e.error?.code])).toEqual([
      ["invoke", undefined],
      ["fail", "FailedPrecondition"],
      ["invoke", undefined],
      ["fail", undefined],
    ]);
  });
});

describe("KeepAlive renewal recording", () => {
  // The server may have renewed a lease whose answer it then dropped: a
  // stream it ends with RESOURCE_EXHAUSTED (the client did not read its
  // answers) or UNAUTHENTICATED (the token expired mid-stream) discards the
  // answers not yet written, and a renewal decided in the database stays
  // decided. None of its unanswered renewals certainly did not happen.
  for (const code of [Code.ResourceExhausted, Code.Unauthenticated, Code.FailedPrecondition]) {
    it(`a renewal left unanswered by a stream ended with ${Code[code]} completes \`info\`, not \`fail\``, async () => {
      const events: OpEvent[] = [];
      const recorder = createRecorder({
        client: 0,
        stride: 1,
        originNs: process.hrtime.bigint(),
        emit: (e) => events.push(e),
      });
      const interceptor = recordingInterceptor(recorder);
      const key = { accountId: "a", sessionId: "s" };
      async function* requests() {
        yield create(KeepAliveRequestSchema, { key, runId: "A" });
        yield create(KeepAliveRequestSchema, { key, runId: "A" });
      }
      const res = await interceptor(async (req) => {
        // The transport sends every request, then the server answers the
        // first one and ends the stream.
        for await (const _ of req.message as AsyncIterable<unknown>);
        async function* answers() {
          yield create(KeepAliveResponseSchema, {
            key,
            runId: "A",
            result: { case: "lease", value: create(LeaseSchema, { runId: "A", fencingToken: 7n }) },
          });
          throw new ConnectError("the stream ended", code);
        }
        return { stream: true, message: answers() } as never;
      })({
        stream: true,
        method: LeaseService.method.keepAlive,
        message: requests(),
        contextValues: createContextValues(),
      } as never);
      await expect(
        (async () => {
          for await (const _ of (res as unknown as { message: AsyncIterable<unknown> }).message);
        })(),
      ).rejects.toThrow();
      expect(events.map((e) => [e.f, e.type, e.token, e.error?.code])).toEqual([
        ["keepalive", "invoke", undefined, undefined],
        ["keepalive", "invoke", undefined, undefined],
        ["keepalive", "ok", 7, undefined],
        ["keepalive", "info", undefined, Code[code]],
      ]);
    });
  }
});
