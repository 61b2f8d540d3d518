// The native path's KeepAlive codec (keepalive-wire.ts) writes the renewed
// lease by hand: its bytes must be protobuf-es's, byte for byte, for every
// lease a database row can hold and for every mix of answers in one write,
// and read back as the lease they were made from. It reads requests by hand
// too: whatever it reads must be what protobuf-es reads, and what it does not
// read it must leave to protobuf-es.

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  KeepAliveRequestSchema,
  KeepAliveResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import type { LossCause } from "../src/protocol/errors.js";
import type { LeaseRecord } from "../src/server/lease/types.js";
import { encodeFrame } from "../src/server/rpc/grpc-wire.js";
import {
  decodeKeepAliveRequest,
  encodeKeepAliveAnswers,
} from "../src/server/rpc/keepalive-wire.js";
import { keepAliveAnswer } from "../src/server/rpc/stream-service.js";
import type { KeepAliveAnswer } from "../src/server/streams/keepalive.js";

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
const lease: fc.Arbitrary<LeaseRecord> = fc.record({
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
});

const asBuffer = (bytes: Uint8Array) => Buffer.from(bytes.buffer, bytes.byteOffset, bytes.length);

/** What the server reads: the fast path, else protobuf-es (FrameReader). */
function read(bytes: Buffer) {
  return decodeKeepAliveRequest(bytes) ?? fromBinary(KeepAliveRequestSchema, bytes);
}

const request = fc.record(
  {
    key: fc.record({ accountId: text, sessionId: text }, { requiredKeys: [] }),
    runId: fc.oneof(fc.uuid(), text),
    ttl: fc.record(
      {
        seconds: fc.oneof(fc.bigInt({ min: 0n, max: 86_400n }), int64),
        nanos: fc.oneof(
          fc.integer({ min: 0, max: 999_999_999 }),
          fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 }),
        ),
      },
      { requiredKeys: [] },
    ),
  },
  { requiredKeys: [] },
);

describe("KeepAlive requests off the wire", () => {
  it("every encoded request reads as protobuf-es reads it", () => {
    fc.assert(
      fc.property(request, (init) => {
        const bytes = asBuffer(
          toBinary(KeepAliveRequestSchema, create(KeepAliveRequestSchema, init)),
        );
        expect(read(bytes)).toStrictEqual(fromBinary(KeepAliveRequestSchema, bytes));
      }),
      { numRuns: 2_000 },
    );
  });

  it("the usual request takes the fast path", () => {
    const bytes = asBuffer(
      toBinary(
        KeepAliveRequestSchema,
        create(KeepAliveRequestSchema, {
          key: { accountId: "acct", sessionId: "s-1" },
          runId: "0b5c6a43-3f0e-4d7c-9a57-8f4c1d2e3a4b",
          ttl: { seconds: 15n },
        }),
      ),
    );
    const fast = decodeKeepAliveRequest(bytes);
    expect(fast).toStrictEqual(fromBinary(KeepAliveRequestSchema, bytes));
  });

  it("numbers at the edges of the fast path read as protobuf-es reads them", () => {
    const varint = (n: bigint) => {
      const out: number[] = [];
      let v = BigInt.asUintN(64, n);
      while (v >= 128n) {
        out.push(Number(v & 127n) | 128);
        v >>= 7n;
      }
      out.push(Number(v));
      return out;
    };
    const ttl = (field: number, n: bigint) => {
      const duration = [(field << 3) | 0, ...varint(n)];
      return Buffer.from([0x1a, duration.length, ...duration]);
    };
    for (const n of [
      0n,
      1n,
      127n,
      128n,
      2n ** 31n - 1n,
      2n ** 31n,
      2n ** 32n + 5n,
      2n ** 35n,
      2n ** 49n - 1n,
      2n ** 49n,
      2n ** 63n - 1n,
      -1n,
    ]) {
      for (const field of [1, 2]) {
        const bytes = ttl(field, n);
        expect(read(bytes), `field ${field} = ${n}`).toStrictEqual(
          fromBinary(KeepAliveRequestSchema, bytes),
        );
      }
    }
  });

  it("any bytes read as protobuf-es reads them, or fail as it fails", () => {
    // Valid requests with bytes changed, cut short or appended, and noise.
    const mangled = fc
      .tuple(
        request,
        fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 4 }),
        fc.nat(),
        fc.uint8Array({ maxLength: 8 }),
      )
      .map(([init, edits, cut, tail]) => {
        const b = Buffer.from(
          toBinary(KeepAliveRequestSchema, create(KeepAliveRequestSchema, init)),
        );
        for (const [at, value] of edits) if (b.length > 0) b[at % b.length] = value;
        return Buffer.concat([b.subarray(0, b.length - (cut % (b.length + 1))), tail]);
      });
    fc.assert(
      fc.property(fc.oneof(mangled, fc.uint8Array({ maxLength: 64 }).map(asBuffer)), (bytes) => {
        let expected: unknown;
        try {
          expected = fromBinary(KeepAliveRequestSchema, bytes);
        } catch {
          expect(decodeKeepAliveRequest(bytes)).toBeUndefined();
          return;
        }
        expect(read(bytes)).toStrictEqual(expected);
      }),
      { numRuns: 5_000 },
    );
  });
});
