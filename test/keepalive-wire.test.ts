// The native path's KeepAlive answer encoder (keepalive-wire.ts) writes the
// renewed lease by hand: its bytes must be protobuf-es's, byte for byte, for
// every lease a database row can hold and for every mix of answers in one
// write, and read back as the lease they were made from. (Reading by hand:
// test/wire-reader.test.ts.)

import { fromBinary } from "@bufbuild/protobuf";
import { type Any, anyUnpack } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { KeepAliveResponseSchema } from "../src/gen/leasehold/v1/lease_pb.js";
import type { LeaseRecord } from "../src/lease/types.js";
import type { LossCause } from "../src/protocol/errors.js";
import { encodeFrame } from "../src/server/rpc/grpc-wire.js";
import { encodeKeepAliveAnswers } from "../src/server/rpc/keepalive-wire.js";
import { keepAliveAnswer } from "../src/server/rpc/stream-service.js";
import type { KeepAliveAnswer } from "../src/server/streams/keepalive.js";
import { RenewalUndecidedError } from "../src/server/streams/renewal-batcher.js";

const int64 = fc.bigInt({ min: -(2n ** 63n), max: 2n ** 63n - 1n });
// Times and durations as the database gives them, and the edges of the
// encoding: zero, negatives (ten-byte varints), beyond 2^53, whole seconds.
const micros = fc.oneof(
  fc.bigInt({ min: 1_600_000_000_000_000n, max: 2_100_000_000_000_000n }),
  fc.bigInt({ min: -10_000_000n, max: 10_000_000n }),
  fc.bigInt({ min: -(2n ** 60n), max: 2n ** 60n }),
  fc.bigInt({ min: 0n, max: 1_000n }).map((s) => s * 1_000_000n),
  fc.constant(0n),
);
const text = fc.oneof(
  fc.string({ maxLength: 40 }),
  fc.string({ unit: "grapheme", maxLength: 20 }),
  fc.string({ unit: "binary", maxLength: 20 }),
  fc.string({ minLength: 120, maxLength: 300 }),
);
const ownLease: fc.Arbitrary<LeaseRecord> = fc.record({
  accountId: text,
  sessionId: text,
  runId: fc.oneof(fc.uuid(), text),
  fencingToken: fc.oneof(int64, fc.bigInt({ min: 0n, max: 1_000_000n })),
  holder: text,
  ttlMs: fc.oneof(
    fc.bigInt({ min: 0n, max: 86_400_000n }),
    fc.bigInt({ min: -(2n ** 40n), max: 2n ** 40n }),
  ),
  acquiredAtUs: micros,
  expiresAtUs: micros,
  remainingUs: micros,
});
// A keeper's lease carries its keeper's id (Lease.keeper_id, field 9); a lease of its own none.
const lease: fc.Arbitrary<LeaseRecord> = fc
  .tuple(ownLease, fc.option(fc.oneof(fc.uuid(), text), { nil: undefined }))
  .map(([l, keeperId]) => (keeperId === undefined ? l : { ...l, keeperId }));
const causes: LossCause[] = ["expired", "released", "taken_over", "revoked", "not_found"];
const answer: fc.Arbitrary<KeepAliveAnswer> = fc.oneof(
  { weight: 4, arbitrary: lease.map((l): KeepAliveAnswer => ({ kind: "lease", lease: l })) },
  fc.record({
    kind: fc.constant("lost" as const),
    key: fc.record({ accountId: text, sessionId: text }),
    runId: fc.uuid(),
    cause: fc.constantFrom(...causes),
  }),
  fc.record({
    kind: fc.constant("handoff" as const),
    key: fc.record({ accountId: text, sessionId: text }),
    runId: fc.uuid(),
    requesterHolder: text,
    reason: text,
    atUs: micros,
  }),
  fc.record({
    kind: fc.constant("undecided" as const),
    key: fc.record({ accountId: text, sessionId: text }),
    runId: fc.uuid(),
    error: fc
      .constantFrom("57014", "55P03")
      .map((state) => new RenewalUndecidedError("the renewal was not decided", state)),
  }),
);

const reference = (a: KeepAliveAnswer) => encodeFrame(KeepAliveResponseSchema, keepAliveAnswer(a));

describe("KeepAlive answers on the wire", () => {
  it("a renewed lease is encoded exactly as protobuf-es encodes it", () => {
    fc.assert(
      fc.property(lease, (l) => {
        const a: KeepAliveAnswer = { kind: "lease", lease: l };
        expect(encodeKeepAliveAnswers([a]).equals(reference(a))).toBe(true);
      }),
      { numRuns: 2_000 },
    );
  });

  it("a write of many answers is their frames in order", () => {
    fc.assert(
      fc.property(fc.array(answer, { maxLength: 30 }), (answers) => {
        const expected = Buffer.concat(answers.map(reference));
        expect(encodeKeepAliveAnswers(answers).equals(expected)).toBe(true);
      }),
      { numRuns: 500 },
    );
  });

  it("reads back as the lease it was made from", () => {
    const l: LeaseRecord = {
      accountId: "acct-ü",
      sessionId: "session-1",
      runId: "0b5c6a43-3f0e-4d7c-9a57-8f4c1d2e3a4b",
      fencingToken: 9_007_199_254_740_993n,
      holder: "desktop ✓",
      ttlMs: 15_250n,
      acquiredAtUs: 1_764_000_000_123_456n,
      expiresAtUs: 1_764_000_015_373_456n,
      remainingUs: 14_999_001n,
    };
    const frame = encodeKeepAliveAnswers([{ kind: "lease", lease: l }]);
    expect(frame[0]).toBe(0);
    expect(frame.readUInt32BE(1)).toBe(frame.length - 5);
    const m = fromBinary(KeepAliveResponseSchema, frame.subarray(5));
    expect(m.key).toMatchObject({ accountId: l.accountId, sessionId: l.sessionId });
    expect(m.runId).toBe(l.runId);
    expect(m.result.case).toBe("lease");
    const got = m.result.value as NonNullable<typeof m.result.value> & { case?: never };
    expect(got).toMatchObject({
      runId: l.runId,
      fencingToken: l.fencingToken,
      holder: l.holder,
      ttl: { seconds: 15n, nanos: 250_000_000 },
      acquiredAt: { seconds: 1_764_000_000n, nanos: 123_456_000 },
      expiresAt: { seconds: 1_764_000_015n, nanos: 373_456_000 },
      remaining: { seconds: 14n, nanos: 999_001_000 },
    });
  });

  it("an undecided renewal reads back as UNAVAILABLE, DATABASE_UNAVAILABLE with the SQLSTATE, and its key and run", () => {
    const key = { accountId: "acct-1", sessionId: "session-1" };
    const runId = "0b5c6a43-3f0e-4d7c-9a57-8f4c1d2e3a4b";
    const error = new RenewalUndecidedError(
      "the renewal was not decided (the database statement timed out)",
      "57014",
    );
    const frame = encodeKeepAliveAnswers([{ kind: "undecided", key, runId, error }]);
    const m = fromBinary(KeepAliveResponseSchema, frame.subarray(5));
    expect(m.key).toMatchObject(key);
    expect(m.runId).toBe(runId);
    expect(m.result.case).toBe("undecided");
    const status = m.result.value as { code: number; message: string; details: Any[] };
    expect(status.code).toBe(Code.Unavailable);
    expect(status.message).toBe(error.message);
    const info = status.details.map((d) => anyUnpack(d, ErrorInfoSchema)).find((d) => d);
    expect(info).toMatchObject({
      reason: "DATABASE_UNAVAILABLE",
      domain: "leasehold.dev",
      metadata: { sql_state: "57014" },
    });
  });
});
