// The interceptor sees attempts, not calls: the library's retry of a call
// left without an answer continues the call's operation.

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createContextValues } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import {
  AcquireRequestSchema,
  AcquireResponseSchema,
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
