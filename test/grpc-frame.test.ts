// The gRPC frame codec (src/protocol/grpc-frame.ts), shared by the server's
// native gRPC path, the client's gRPC transport and the Connect adapter's
// request bodies: a flags byte, a 4-byte big-endian length, the message;
// read from chunks cut anywhere.

import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  encodeFrame,
  FrameDecoder,
  type FrameDecoderOptions,
  FrameError,
  messageSizeText,
} from "../src/protocol/grpc-frame.js";

interface Frame {
  flags: number;
  message: Uint8Array;
}

/** Decodes `chunks` in order, keeping every frame (copied: a view may be of a chunk). */
function decodeAll(
  chunks: Uint8Array[],
  maxMessageBytes = 1 << 20,
  options?: FrameDecoderOptions,
): { frames: Frame[]; decoder: FrameDecoder } {
  const decoder = new FrameDecoder(maxMessageBytes, options);
  const frames: Frame[] = [];
  const sink = {
    onFrame(flags: number, message: Uint8Array) {
      frames.push({ flags, message: message.slice() });
      return true;
    },
  };
  for (const chunk of chunks) decoder.push(chunk, sink);
  return { frames, decoder };
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.byteLength, 0));
  let pos = 0;
  for (const p of parts) {
    out.set(p, pos);
    pos += p.byteLength;
  }
  return out;
}

/** `bytes` cut at the given offsets (sorted, deduplicated, empty pieces kept). */
function cut(bytes: Uint8Array, at: number[]): Uint8Array[] {
  const cuts = [...new Set(at.map((c) => Math.min(c, bytes.byteLength)))].sort((a, b) => a - b);
  const out: Uint8Array[] = [];
  let from = 0;
  for (const c of cuts) {
    out.push(bytes.subarray(from, c));
    from = c;
  }
  out.push(bytes.subarray(from));
  return out;
}

const bytesOf = (n: number, seed: number) =>
  Uint8Array.from({ length: n }, (_, i) => (i * 31 + seed) & 0xff);

// Three frames: an empty message, a short one, one longer than a header.
const messages = [new Uint8Array(0), bytesOf(3, 1), bytesOf(300, 7)];
const body = concat(messages.map((m) => encodeFrame(m)));

describe("the gRPC frame codec", () => {
  it("writes a flags byte of 0, the length big-endian, then the message", () => {
    const frame = encodeFrame(bytesOf(258, 0));
    expect([...frame.subarray(0, 5)]).toEqual([0, 0, 0, 1, 2]);
    expect(frame.subarray(5)).toEqual(bytesOf(258, 0));
    // A Node caller gets its own allocator's array (Buffer.allocUnsafe on both paths).
    expect(Buffer.isBuffer(encodeFrame(bytesOf(3, 0), (n) => Buffer.allocUnsafe(n)))).toBe(true);
  });

  it("reads frames split across two chunks at every byte boundary", () => {
    for (let i = 0; i <= body.byteLength; i++) {
      const { frames, decoder } = decodeAll([body.subarray(0, i), body.subarray(i)]);
      expect(
        frames.map((f) => f.message),
        `cut at ${i}`,
      ).toEqual(messages);
      expect(decoder.incomplete, `cut at ${i}`).toBe(false);
    }
  });

  it("reads frames trickled in 1-byte chunks, incomplete until the last byte", () => {
    const decoder = new FrameDecoder(1 << 20);
    const read: Uint8Array[] = [];
    const sink = {
      onFrame(_flags: number, message: Uint8Array) {
        read.push(message.slice());
        return true;
      },
    };
    const ends = new Set<number>();
    let end = 0;
    for (const m of messages) {
      end += 5 + m.byteLength;
      ends.add(end);
    }
    for (let i = 0; i < body.byteLength; i++) {
      decoder.push(body.subarray(i, i + 1), sink);
      expect(decoder.incomplete, `after byte ${i}`).toBe(!ends.has(i + 1));
    }
    expect(read).toEqual(messages);
  });

  it("reads several frames of one chunk as views of it, without a copy", () => {
    const views: Uint8Array[] = [];
    const decoder = new FrameDecoder(1 << 20);
    decoder.push(body, {
      onFrame(_flags, message) {
        views.push(message);
        return true;
      },
    });
    expect(views).toEqual(messages);
    for (const view of views) expect(view.buffer).toBe(body.buffer);
    expect(decoder.incomplete).toBe(false);
  });

  it("copies a frame spread over chunks once, when it is whole, through the allocator", () => {
    let allocated = 0;
    const allocate = (n: number) => {
      allocated += n;
      return new Uint8Array(n);
    };
    const chunks = Array.from({ length: body.byteLength }, (_, i) => body.subarray(i, i + 1));
    const { frames } = decodeAll(chunks, 1 << 20, { allocate });
    expect(frames.map((f) => f.message)).toEqual(messages);
    // Every message byte once (the header bytes never).
    expect(allocated).toBe(messages.reduce((n, m) => n + m.byteLength, 0));
  });

  it("a length over the limit is a FrameError in the one size text, from the header alone", () => {
    expect(messageSizeText("readMaxBytes", 70_000, 65_536)).toBe(
      "message size 70000 is larger than configured readMaxBytes 65536",
    );
    const header = Uint8Array.of(0, 0, 1, 0x11, 0x70); // 70,000 bytes announced, none sent
    for (let i = 0; i <= 5; i++) {
      const decoder = new FrameDecoder(65_536);
      const sink = { onFrame: () => true };
      const push = () => {
        decoder.push(header.subarray(0, i), sink);
        decoder.push(header.subarray(i), sink);
      };
      expect(push, `header cut at ${i}`).toThrow(
        new FrameError("tooLarge", messageSizeText("readMaxBytes", 70_000, 65_536)),
      );
      // Refused for good: a later chunk throws the same error again.
      expect(() => decoder.push(Uint8Array.of(0), sink)).toThrow("readMaxBytes 65536");
    }
    // The length is unsigned: a first byte of 0xff is not a negative length.
    expect(() => decodeAll([Uint8Array.of(0, 0xff, 0xff, 0xff, 0xf0)], 65_536)).toThrow(
      "message size 4294967280 is larger than configured readMaxBytes 65536",
    );
    // At the limit is allowed.
    expect(decodeAll([encodeFrame(bytesOf(16, 0))], 16).frames).toHaveLength(1);
  });

  it("a message over writeMaxBytes is a FrameError in the one size text", () => {
    expect(() => encodeFrame(bytesOf(17, 0), undefined, 16)).toThrow(
      new FrameError("tooLarge", "message size 17 is larger than configured writeMaxBytes 16"),
    );
    expect(encodeFrame(bytesOf(16, 0), undefined, 16).byteLength).toBe(21);
  });

  it("with rejectCompressed, a frame flagged compressed is refused from its header alone", () => {
    const compressed = concat([Uint8Array.of(1, 0, 0, 0, 10), bytesOf(3, 0)]); // 7 of 10 bytes sent
    for (let i = 0; i <= 5; i++) {
      const decoder = new FrameDecoder(65_536, { rejectCompressed: true });
      const sink = { onFrame: () => true };
      let thrown: unknown;
      try {
        decoder.push(compressed.subarray(0, i), sink);
        decoder.push(compressed.subarray(i), sink);
      } catch (error) {
        thrown = error;
      }
      expect(thrown, `header cut at ${i}`).toBeInstanceOf(FrameError);
      expect((thrown as FrameError).kind).toBe("compressed");
    }
    // The size rule comes first, as on both paths before.
    expect(() =>
      decodeAll([Uint8Array.of(1, 0, 1, 0x11, 0x70)], 65_536, { rejectCompressed: true }),
    ).toThrow("readMaxBytes");
  });

  it("without rejectCompressed, the flags reach the sink with the whole frame", () => {
    const frame = concat([Uint8Array.of(1, 0, 0, 0, 2), bytesOf(2, 5)]);
    for (let i = 0; i <= frame.byteLength; i++) {
      const { frames } = decodeAll([frame.subarray(0, i), frame.subarray(i)]);
      expect(frames, `cut at ${i}`).toEqual([{ flags: 1, message: bytesOf(2, 5) }]);
    }
  });

  it("a sink that returns false ends the reading", () => {
    const decoder = new FrameDecoder(1 << 20);
    let seen = 0;
    const sink = {
      onFrame() {
        seen++;
        return false;
      },
    };
    decoder.push(body, sink);
    decoder.push(body, sink);
    expect(seen).toBe(1);
  });

  it("with wholeFrames, the sink gets each frame header included, copied once when spread", () => {
    const frames = messages.map((m) => encodeFrame(m));
    for (let i = 0; i <= body.byteLength; i++) {
      const { frames: read } = decodeAll([body.subarray(0, i), body.subarray(i)], 1 << 20, {
        wholeFrames: true,
      });
      expect(
        read.map((f) => f.message),
        `cut at ${i}`,
      ).toEqual(frames);
    }
    let allocated = 0;
    const allocate = (n: number) => {
      allocated += n;
      return new Uint8Array(n);
    };
    const chunks = Array.from({ length: body.byteLength }, (_, i) => body.subarray(i, i + 1));
    const { frames: trickled } = decodeAll(chunks, 1 << 20, { allocate, wholeFrames: true });
    expect(trickled.map((f) => f.message)).toEqual(frames);
    expect(allocated).toBe(body.byteLength);
  });

  it("unread() holds the frame begun, and after a refused header the bytes from it on", () => {
    const whole = encodeFrame(bytesOf(3, 1));
    const sink = { onFrame: () => true };
    const begun = new FrameDecoder(1 << 20);
    begun.push(whole, sink);
    begun.push(whole.subarray(0, 2), sink);
    begun.push(whole.subarray(2, 6), sink);
    expect(concat(begun.unread())).toEqual(whole.subarray(0, 6));
    // 70,000 bytes announced after a whole frame; refused wherever the header is cut.
    const refused = concat([whole, Uint8Array.of(0, 0, 1, 0x11, 0x70), bytesOf(4, 2)]);
    for (let i = 0; i <= refused.byteLength; i++) {
      const decoder = new FrameDecoder(65_536);
      const read: Uint8Array[] = [];
      const keep = {
        onFrame(_flags: number, message: Uint8Array) {
          read.push(message.slice());
          return true;
        },
      };
      expect(() => {
        decoder.push(refused.subarray(0, i), keep);
        decoder.push(refused.subarray(i), keep);
      }, `cut at ${i}`).toThrow("readMaxBytes 65536");
      expect(read, `cut at ${i}`).toEqual([bytesOf(3, 1)]);
      // A chunk holding the whole header is refused before the next is pushed.
      const pushed = i >= whole.byteLength + 5 ? i : refused.byteLength;
      expect(concat(decoder.unread()), `cut at ${i}`).toEqual(
        refused.subarray(whole.byteLength, pushed),
      );
    }
  });

  it("encode, cut anywhere, decode is the identity (property)", () => {
    fc.assert(
      fc.property(
        fc.array(fc.uint8Array({ maxLength: 600 }), { maxLength: 8 }),
        fc.array(fc.nat(), { maxLength: 20 }),
        (written, cuts) => {
          const stream = concat(written.map((m) => encodeFrame(m)));
          const chunks = cut(
            stream,
            cuts.map((c) => c % (stream.byteLength + 1)),
          );
          const { frames, decoder } = decodeAll(chunks);
          expect(frames).toEqual(written.map((message) => ({ flags: 0, message })));
          expect(decoder.incomplete).toBe(false);
          // Cut short by a byte, the last frame stays unread and the decoder says so.
          if (stream.byteLength > 0) {
            const short = decodeAll(cut(stream.subarray(0, stream.byteLength - 1), cuts));
            expect(short.frames).toHaveLength(written.length - 1);
            expect(short.decoder.incomplete).toBe(true);
          }
        },
      ),
      { numRuns: 500 },
    );
  });
});
