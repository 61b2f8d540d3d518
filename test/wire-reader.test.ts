// The hand readers of the hot streams' messages (src/protocol/wire-reader.ts:
// KeepAlive requests on the server, KeepAlive answers and Watch events in the
// client) stand in for protobuf-es: whatever they read must be exactly what
// protobuf-es reads, what they do not read they must leave to it (answer
// undefined), and bytes protobuf-es refuses they must never accept.

import { create, type DescMessage, fromBinary, toBinary } from "@bufbuild/protobuf";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  KeepAliveRequestSchema,
  KeepAliveResponseSchema,
  WatchResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import {
  readKeepAliveRequest,
  readKeepAliveResponse,
  readWatchResponse,
} from "../src/protocol/wire-reader.js";

const int64 = fc.oneof(
  fc.bigInt({ min: 0n, max: 2n ** 49n }),
  fc.bigInt({ min: -(2n ** 63n), max: 2n ** 63n - 1n }),
);
const int32 = fc.oneof(
  fc.integer({ min: 0, max: 999_999_999 }),
  fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 }),
);
const text = fc.oneof(
  fc.string({ maxLength: 40 }),
  fc.uuid(),
  fc.string({ unit: "grapheme", maxLength: 12 }),
  fc.string({ unit: "binary", maxLength: 12 }),
);
const key = fc.record({ accountId: text, sessionId: text }, { requiredKeys: [] });
const secondsNanos = fc.record({ seconds: int64, nanos: int32 }, { requiredKeys: [] });
const lease = fc.record(
  {
    key,
    runId: text,
    fencingToken: int64,
    holder: text,
    ttl: secondsNanos,
    acquiredAt: secondsNanos,
    expiresAt: secondsNanos,
    remaining: secondsNanos,
  },
  { requiredKeys: [] },
);
const keepAliveRequest = fc.record({ key, runId: text, ttl: secondsNanos }, { requiredKeys: [] });
const keepAliveResponse = fc.record(
  {
    key,
    runId: text,
    result: fc.oneof(
      { weight: 4, arbitrary: lease.map((value) => ({ case: "lease" as const, value })) },
      fc
        .integer({ min: 0, max: 6 })
        .map((reason) => ({ case: "lost" as const, value: { reason } })),
      fc
        .record({ requesterHolder: text, reason: text, requestedAt: secondsNanos })
        .map((value) => ({ case: "handoffRequested" as const, value })),
    ),
  },
  { requiredKeys: [] },
);
const watchResponse = fc.record({
  kind: fc.oneof(
    {
      weight: 4,
      arbitrary: fc
        .record(
          {
            type: fc.oneof(fc.integer({ min: 0, max: 6 }), int32),
            key,
            runId: text,
            fencingToken: int64,
            holder: text,
            reason: text,
            at: secondsNanos,
            lease,
            requesterHolder: text,
            id: int64,
          },
          { requiredKeys: [] },
        )
        .map((value) => ({ case: "event" as const, value })),
    },
    fc
      .record({ leases: fc.array(lease, { maxLength: 3 }), at: secondsNanos }, { requiredKeys: [] })
      .map((value) => ({ case: "snapshot" as const, value })),
  ),
});

interface Case {
  name: string;
  schema: DescMessage;
  init: fc.Arbitrary<object>;
  read: (bytes: Uint8Array) => unknown;
  usual: object;
}

const usualLease = {
  key: { accountId: "acct", sessionId: "s-1" },
  runId: "0b5c6a43-3f0e-4d7c-9a57-8f4c1d2e3a4b",
  fencingToken: 41n,
  holder: "desktop",
  ttl: { seconds: 15n },
  acquiredAt: { seconds: 1_764_000_000n, nanos: 123_456_000 },
  expiresAt: { seconds: 1_764_000_015n, nanos: 123_456_000 },
  remaining: { seconds: 14n, nanos: 999_001_000 },
};

const cases: Case[] = [
  {
    name: "KeepAlive request",
    schema: KeepAliveRequestSchema,
    init: keepAliveRequest,
    read: readKeepAliveRequest,
    usual: { key: usualLease.key, runId: usualLease.runId, ttl: { seconds: 15n } },
  },
  {
    name: "KeepAlive answer",
    schema: KeepAliveResponseSchema,
    init: keepAliveResponse,
    read: readKeepAliveResponse,
    usual: {
      key: usualLease.key,
      runId: usualLease.runId,
      result: { case: "lease", value: usualLease },
    },
  },
  {
    name: "Watch event",
    schema: WatchResponseSchema,
    init: watchResponse,
    read: readWatchResponse,
    usual: {
      kind: {
        case: "event",
        value: {
          type: 2,
          key: usualLease.key,
          runId: usualLease.runId,
          fencingToken: 41n,
          holder: "desktop",
          at: usualLease.acquiredAt,
          lease: usualLease,
          id: 7n,
        },
      },
    },
  },
];

const encode = (schema: DescMessage, init: object) =>
  toBinary(schema, create(schema, init as Record<string, unknown>));

describe.each(cases)("$name read by hand", ({ schema, init, read, usual }) => {
  /** What the client or server ends up with: the hand reader, else protobuf-es. */
  // Sockets hand over Buffers (a subclass of Uint8Array, whose subarray is
  // a Buffer too); tests encode plain Uint8Arrays. Both must read alike.
  const readBoth = (bytes: Uint8Array) => {
    const fromView = read(bytes);
    expect(read(Buffer.from(bytes))).toStrictEqual(fromView);
    return fromView;
  };
  const decode = (bytes: Uint8Array) => readBoth(bytes) ?? fromBinary(schema, bytes);

  it("the usual message takes the hand reader and reads as protobuf-es reads it", () => {
    const bytes = encode(schema, usual);
    const fast = readBoth(bytes);
    expect(fast).toBeDefined();
    expect(fast).toStrictEqual(fromBinary(schema, bytes));
  });

  it("every encoded message reads as protobuf-es reads it", () => {
    fc.assert(
      fc.property(init, (message) => {
        const bytes = encode(schema, message);
        expect(decode(bytes)).toStrictEqual(fromBinary(schema, bytes));
      }),
      { numRuns: 1_500 },
    );
  });

  it("two messages one after the other read as protobuf-es merges them (fields met twice)", () => {
    fc.assert(
      fc.property(init, init, (first, second) => {
        const a = encode(schema, first);
        const b = encode(schema, second);
        const bytes = new Uint8Array(a.length + b.length);
        bytes.set(a);
        bytes.set(b, a.length);
        expect(decode(bytes)).toStrictEqual(fromBinary(schema, bytes));
      }),
      { numRuns: 1_000 },
    );
  });

  it("any bytes read as protobuf-es reads them, and what it refuses is never read", () => {
    // Encoded messages with bytes changed, cut short or appended, and noise.
    const mangled = fc
      .tuple(
        init,
        fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 4 }),
        fc.nat(),
        fc.uint8Array({ maxLength: 8 }),
      )
      .map(([message, edits, cut, tail]) => {
        const b = Uint8Array.from(encode(schema, message));
        for (const [at, value] of edits) if (b.length > 0) b[at % b.length] = value;
        const kept = b.subarray(0, b.length - (cut % (b.length + 1)));
        const out = new Uint8Array(kept.length + tail.length);
        out.set(kept);
        out.set(tail, kept.length);
        return out;
      });
    fc.assert(
      fc.property(fc.oneof(mangled, fc.uint8Array({ maxLength: 64 })), (bytes) => {
        let expected: unknown;
        try {
          expected = fromBinary(schema, bytes);
        } catch {
          expect(read(bytes)).toBeUndefined();
          return;
        }
        expect(decode(bytes)).toStrictEqual(expected);
      }),
      { numRuns: 4_000 },
    );
  });
});

describe("numbers at the edges of the hand reader", () => {
  it("read as protobuf-es reads them", () => {
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
    const edges = [0n, 1n, 127n, 128n, 2n ** 31n - 1n, 2n ** 31n, 2n ** 32n + 5n, 2n ** 35n];
    for (const n of [...edges, 2n ** 49n - 1n, 2n ** 49n, 2n ** 63n - 1n, -1n]) {
      for (const field of [1, 2]) {
        const inner = [(field << 3) | 0, ...varint(n)];
        const bytes = Uint8Array.from([0x1a, inner.length, ...inner]);
        expect(
          readKeepAliveRequest(bytes) ?? fromBinary(KeepAliveRequestSchema, bytes),
          `ttl field ${field} = ${n}`,
        ).toStrictEqual(fromBinary(KeepAliveRequestSchema, bytes));
      }
    }
  });
});
