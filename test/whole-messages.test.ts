// The request body gatherer of src/host/whole-messages.ts, without
// sockets (test/trickled-messages.test.ts has it on real ones): whatever
// the chunking, envelopes come out one per chunk with their bytes unchanged,
// a message declared beyond the bound passes through untouched for the
// decoder to refuse, and an unfinished one is handed on for the decoder to
// report. No invariant of DESIGN.md; this is the input to every RPC.

import { create, toBinary } from "@bufbuild/protobuf";
import { BinaryWriter, WireType } from "@bufbuild/protobuf/wire";
import fc from "fast-check";
import { describe, expect, it, vi } from "vitest";
import { type AcquireRequest, AcquireRequestSchema } from "../src/gen/leasehold/v1/lease_pb.js";
import { unknownJsonFields } from "../src/host/json-fields.js";
import { type MessageCheck, wholeBody, wholeEnvelopes } from "../src/host/whole-messages.js";
import { FrameReader } from "../src/server/rpc/grpc-wire.js";

function envelope(flags: number, payload: Uint8Array): Uint8Array {
  const out = new Uint8Array(5 + payload.byteLength);
  out[0] = flags;
  new DataView(out.buffer).setUint32(1, payload.byteLength);
  out.set(payload, 5);
  return out;
}

/** `bytes` cut at the given offsets, as a body would arrive. */
async function* chunked(bytes: Uint8Array, cuts: number[]) {
  let from = 0;
  for (const cut of [...new Set(cuts)].sort((a, b) => a - b)) {
    if (cut <= from || cut >= bytes.byteLength) continue;
    yield bytes.subarray(from, cut);
    from = cut;
  }
  yield bytes.subarray(from);
}

async function collect(it: AsyncIterable<Uint8Array>): Promise<Uint8Array[]> {
  const out: Uint8Array[] = [];
  for await (const chunk of it) out.push(new Uint8Array(chunk));
  return out;
}

const concat = (parts: Uint8Array[]) => new Uint8Array(Buffer.concat(parts));

describe("wholeEnvelopes", () => {
  it("hands on every envelope as one chunk, bytes unchanged, however the body is cut", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(
          fc.record({
            flags: fc.integer({ min: 0, max: 1 }),
            payload: fc.uint8Array({ maxLength: 300 }),
          }),
          { maxLength: 8 },
        ),
        fc.array(fc.nat(3000), { maxLength: 400 }),
        async (messages, cuts) => {
          const envelopes = messages.map((m) => envelope(m.flags, m.payload));
          const body = concat(envelopes);
          const seen: [number, Uint8Array][] = [];
          const check: MessageCheck = (payload, flags) =>
            seen.push([flags, new Uint8Array(payload)]);
          const out = await collect(wholeEnvelopes(chunked(body, cuts), 1000, check));
          expect(out).toEqual(envelopes);
          expect(seen).toEqual(messages.map((m) => [m.flags, m.payload]));
        },
      ),
    );
  });

  it("a body of 1-byte chunks comes out as one chunk per envelope", async () => {
    const body = concat([
      envelope(0, new Uint8Array(5000).fill(1)),
      envelope(0, new Uint8Array(7)),
    ]);
    const cuts = Array.from({ length: body.byteLength }, (_, i) => i);
    const out = await collect(wholeEnvelopes(chunked(body, cuts), 60_000));
    expect(out.map((c) => c.byteLength)).toEqual([5005, 12]);
  });

  it("a message declared beyond the bound is passed on as it came, for the decoder to refuse", async () => {
    const header = envelope(0, new Uint8Array(0));
    new DataView(header.buffer).setUint32(1, 2 ** 31);
    const body = concat([header, new Uint8Array([1, 2, 3])]);
    const out = await collect(wholeEnvelopes(chunked(body, [2, 6, 7]), 1000));
    expect(concat(out)).toEqual(body);
    // Nothing beyond the header waited for the rest of the declared length.
    expect(out.length).toBeGreaterThan(1);
  });

  it("an unfinished envelope is handed on at the end, for the decoder to report", async () => {
    const whole = envelope(0, new Uint8Array([1, 2, 3]));
    const body = concat([whole, whole.subarray(0, 6)]);
    const out = await collect(wholeEnvelopes(chunked(body, [1, 9]), 1000));
    expect(out).toEqual([whole, whole.subarray(0, 6)]);
  });

  it("a check that throws ends the body with its error", async () => {
    const body = envelope(0, new Uint8Array([1]));
    const failing: MessageCheck = () => {
      throw new Error("refused");
    };
    await expect(collect(wholeEnvelopes(chunked(body, [3]), 1000, failing))).rejects.toThrow(
      "refused",
    );
  });
});

describe("wholeBody", () => {
  it("hands on a Connect unary body as one chunk, and one beyond the bound as it came", async () => {
    const body = new Uint8Array(300).map((_, i) => i % 251);
    const cuts = Array.from({ length: 300 }, (_, i) => i);
    expect(await collect(wholeBody(chunked(body, cuts), 1000))).toEqual([body]);
    const over = await collect(wholeBody(chunked(body, cuts), 100));
    expect(concat(over)).toEqual(body);
    expect(over.length).toBeGreaterThan(1);
  });
});

describe("unknownJsonFields", () => {
  it("names unknown keys by path, knows JSON and proto names, and leaves well-known types alone", () => {
    expect(
      unknownJsonFields(AcquireRequestSchema, {
        key: { accountId: "a", session_id: "s", sesionId: "x" },
        run_id: "r",
        ttl: "10s",
        wait: { seconds: 1, bogus: 2 },
        holdr: "typo",
        holder: null,
      }),
    ).toEqual(["key.sesionId", "holdr"]);
    expect(unknownJsonFields(AcquireRequestSchema, "not an object")).toEqual([]);
    expect(unknownJsonFields(AcquireRequestSchema, { key: null, ttl: null })).toEqual([]);
  });
});

describe("the native gRPC path's FrameReader", () => {
  it("reads a frame trickled in 1-byte chunks copying each byte at most twice (it copied O(n²) bytes)", () => {
    const message = create(AcquireRequestSchema, { key: { accountId: "a", sessionId: "s" } });
    message.$unknown = [
      {
        no: 1000,
        wireType: WireType.LengthDelimited,
        data: new BinaryWriter().bytes(new Uint8Array(5000).fill(7)).finish(),
      },
    ];
    const frame = Buffer.from(envelope(0, toBinary(AcquireRequestSchema, message)));
    const twice = Buffer.concat([frame, frame]);
    // The reader copies a frame spread over chunks into one Buffer.allocUnsafe, once.
    const allocate = vi.spyOn(Buffer, "allocUnsafe");
    try {
      const reader = new FrameReader<AcquireRequest>(AcquireRequestSchema, 65_536);
      const read: AcquireRequest[] = [];
      for (let i = 0; i < twice.length; i++) read.push(...reader.push(twice.subarray(i, i + 1)));
      expect(read.map((m) => m.key?.sessionId)).toEqual(["s", "s"]);
      expect(reader.incomplete).toBe(false);
      const copied = allocate.mock.calls.reduce((sum, [size]) => sum + size, 0);
      // Copied at all: the spy sees the reader's copies.
      expect(copied).toBeGreaterThan(0);
      expect(copied).toBeLessThanOrEqual(2 * twice.length);
    } finally {
      allocate.mockRestore();
    }
  });

  it("still refuses a frame beyond the bound, or flagged compressed, from its header alone", () => {
    const big = Buffer.from(envelope(0, new Uint8Array(0)));
    big.writeUInt32BE(70_000, 1);
    expect(() => new FrameReader(AcquireRequestSchema, 65_536).push(big)).toThrow(
      "message size 70000 is larger than configured readMaxBytes 65536",
    );
    const compressed = Buffer.from(envelope(1, new Uint8Array(10)));
    const reader = new FrameReader(AcquireRequestSchema, 65_536);
    expect(reader.push(compressed.subarray(0, 3))).toEqual([]);
    expect(() => reader.push(compressed.subarray(3, 6))).toThrow("flagged compressed");
  });
});
