// Hostile input on the Keep stream (npm run test:hostile), on both gRPC
// paths: generated requests with hostile values in every field (ids 0 and
// reused, keys and run ids no rule accepts, durations out of range, ops
// missing), junk bytes as request messages, and a flood of requests past the
// stream's in-flight bound. Every request is answered with a documented code
// in its own `error` or a proper answer, a stream ends OK or with a
// documented code, never INTERNAL or UNKNOWN, and the server keeps serving
// (a fresh keeper opens and heartbeats after each part).

import { randomUUID } from "node:crypto";
import { create, fromBinary, type MessageInitShape } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import {
  KeepRequestSchema as KeepRequestDesc,
  type KeepRequestSchema,
  KeepResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { defaultLimits } from "../src/lease/limits.js";
import { documentedCodes } from "./support/documented-codes.js";
import { useTestServer } from "./support/fixture.js";
import { frame, openRawCall } from "./support/raw-grpc.js";
import { ms, openKeep } from "./support/streams.js";
import { waitFor } from "./support/wait.js";

type KeepInit = MessageInitShape<typeof KeepRequestSchema>;

const hostileStrings = [
  "",
  " ",
  "*",
  "' OR 1=1 --",
  "\u0000",
  "\u202e",
  "a".repeat(129),
  "x".repeat(3000),
  "\ud800",
  "not-a-uuid",
  "00000000-0000-0000-0000-000000000000",
];
const text = fc.oneof(
  fc.constantFrom(...hostileStrings),
  fc.string({ unit: "binary", maxLength: 100 }),
);
const duration = fc.oneof(
  fc.constant(undefined),
  fc.record({
    seconds: fc.bigInt({ min: -(2n ** 63n), max: 2n ** 63n - 1n }),
    nanos: fc.integer({ min: -2_000_000_000, max: 2_000_000_000 }),
  }),
  fc.integer({ min: 0, max: 400_000 }).map((n) => ms(n)),
);
const idOf = fc.oneof(
  fc.constant(0n),
  fc.bigInt({ min: 1n, max: 20n }),
  fc.bigInt({ min: 0n, max: 2n ** 64n - 1n }),
);

function hostileRequest(accountId: string): fc.Arbitrary<KeepInit> {
  const account = fc.oneof(fc.constant(accountId), text);
  const key = fc.option(
    fc.record({ accountId: account, sessionId: fc.oneof(fc.constant("s"), text) }),
    {
      nil: undefined,
    },
  );
  const runId = fc.oneof(fc.uuid(), text);
  const op = fc.oneof(
    fc.record({
      case: fc.constant("acquire" as const),
      value: fc.record({
        key,
        runId,
        ttl: duration,
        wait: duration,
        holder: text,
        keeperId: fc.oneof(fc.constant(""), text),
      }),
    }),
    fc.record({ case: fc.constant("release" as const), value: fc.record({ key, runId }) }),
    fc.record({ case: fc.constant("get" as const), value: fc.record({ key }) }),
    fc.record({ case: fc.constant("heartbeat" as const), value: fc.record({ ttl: duration }) }),
    fc.record({
      case: fc.constant("open" as const),
      value: fc.record({
        accountId: account,
        keeperId: text,
        holder: text,
        ttl: duration,
        lockDelay: duration,
      }),
    }),
    fc.constant({ case: undefined }),
  );
  return fc.record({ id: idOf, op }) as fc.Arbitrary<KeepInit>;
}

for (const mode of ["native", "connect"] as const) {
  describe(`hostile input on Keep, --grpc-path ${mode}`, () => {
    const { client, server } = useTestServer({
      args: ["--grpc-path", mode, "--max-keeper-ops-in-flight", "16"],
      overrides: { limits: { ...defaultLimits, maxKeeperOpsInFlight: 16 } },
    });

    /** A fresh keeper opens, heartbeats and closes: the server still serves. */
    async function stillServing() {
      const keep = openKeep(client);
      keep.send({
        id: 1n,
        op: {
          case: "open",
          value: { accountId: `ok-${randomUUID().slice(0, 8)}`, ttl: ms(10_000) },
        },
      });
      expect((await keep.answer(1n)).result.case).toBe("keeper");
      keep.send({ id: 2n, op: { case: "heartbeat", value: {} } });
      expect((await keep.answer(2n)).result.case).toBe("keeper");
      keep.send({ id: 3n, op: { case: "close", value: {} } });
      expect((await keep.answer(3n)).result.case).toBe("keeper");
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
    }

    it("2,000 generated requests with hostile values: every answer is a documented code in the request's error or a proper answer; streams end OK or with a documented code", async () => {
      const accountId = `hostile-${randomUUID().slice(0, 8)}`;
      const batches = fc.sample(
        fc.array(hostileRequest(accountId), { minLength: 50, maxLength: 50 }),
        40,
      );
      const codes = new Map<number, number>();
      for (const batch of batches) {
        const keep = openKeep(client);
        keep.send({ id: 1n, op: { case: "open", value: { accountId, ttl: ms(30_000) } } });
        for (const request of batch) keep.send(request);
        // A close ends the stream (OK) after its answer, whatever is still waiting.
        keep.send({ id: 2n ** 64n - 1n, op: { case: "close", value: {} } });
        keep.end();
        await keep.reader.finished;
        if (keep.reader.error) {
          expect(documentedCodes.has(keep.reader.error.code), keep.reader.error.message).toBe(true);
        }
        for (const answer of keep.reader.received) {
          if (answer.result.case !== "error") continue;
          const status = answer.result.value;
          codes.set(status.code, (codes.get(status.code) ?? 0) + 1);
          expect(documentedCodes.has(status.code), `${status.code} ${status.message}`).toBe(true);
          if (status.code === Code.InvalidArgument) {
            const info = status.details
              .filter((d) => d.typeUrl.endsWith("google.rpc.ErrorInfo"))
              .map((d) => fromBinary(ErrorInfoSchema, d.value))[0];
            expect(info?.metadata.field, status.message).toBeTruthy();
          }
        }
      }
      expect(codes.get(Code.InvalidArgument) ?? 0).toBeGreaterThan(100);
      await stillServing();
    });

    it("junk bytes as request messages after an open end the stream with INVALID_ARGUMENT, never INTERNAL", async () => {
      const junk = fc.sample(fc.uint8Array({ minLength: 1, maxLength: 200 }), 60);
      for (const bytes of junk) {
        const call = openRawCall(server.url, "/leasehold.v1.LeaseService/Keep");
        call.read();
        call.send(
          frame(KeepRequestDesc, {
            id: 1n,
            op: {
              case: "open",
              value: { accountId: `junk-${randomUUID().slice(0, 8)}`, ttl: ms(10_000) },
            },
          }),
        );
        const framed = new Uint8Array(5 + bytes.length);
        new DataView(framed.buffer).setUint32(1, bytes.length);
        framed.set(bytes, 5);
        call.send(framed);
        call.end();
        const end = await call.ended;
        call.close();
        // Bytes that happen to decode are requests like any other: OK at the end.
        expect([Code.InvalidArgument, 0]).toContain(end.status);
        for (const f of call.frames) {
          const answer = fromBinary(KeepResponseSchema, f);
          if (answer.result.case === "error") {
            expect(documentedCodes.has(answer.result.value.code)).toBe(true);
          }
        }
      }
      await stillServing();
    });

    it("a flood of 3,000 waiting acquires past the in-flight bound: the ones past it are answered RESOURCE_EXHAUSTED naming the limit, the others when the key frees", async () => {
      const accountId = `flood-${randomUUID().slice(0, 8)}`;
      const key = { accountId, sessionId: "held" };
      const blocker = await client.acquire({ key, ttl: ms(60_000) });
      const keep = openKeep(client);
      keep.send({ id: 1n, op: { case: "open", value: { accountId, ttl: ms(60_000) } } });
      expect((await keep.answer(1n)).result.case).toBe("keeper");
      const total = 3_000;
      for (let i = 0; i < total; i++) {
        keep.send({
          id: BigInt(10 + i),
          op: { case: "acquire", value: { key, wait: create(DurationSchema, { seconds: 30n }) } },
        });
      }
      // Every request past the 16 in flight is answered at once.
      await waitFor(
        () => keep.reader.received.filter((m) => m.result.case === "error").length >= total - 16,
        { what: "the requests past the bound answered", timeoutMs: 60_000 },
      );
      const refused = keep.reader.received.filter((m) => m.result.case === "error");
      expect(refused.length).toBeGreaterThanOrEqual(total - 16);
      for (const m of refused) {
        if (m.result.case !== "error") continue;
        expect(m.result.value.code).toBe(Code.ResourceExhausted);
        const info = fromBinary(
          ErrorInfoSchema,
          m.result.value.details[0]?.value ?? new Uint8Array(),
        );
        expect(info.metadata.limit).toBe("max-keeper-ops-in-flight");
      }
      await client.release({ key, runId: blocker.lease?.runId ?? "" });
      const granted = await keep.reader.take(
        (m) => m.result.case === "acquire" && m.result.value.acquired,
      );
      expect(granted.result.case).toBe("acquire");
      keep.abort();
      await stillServing();
    });
  });
}
