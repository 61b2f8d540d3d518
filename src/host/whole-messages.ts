// Request bodies handed to connect-node one whole message per chunk.
//
// connect-es's envelope decoder (gRPC, gRPC-Web and Connect streaming
// bodies) keeps the chunks of an unfinished message in a list and sums the
// whole list on every chunk that arrives, so a message sent as n tiny HTTP/2
// DATA frames (or HTTP/1.1 chunks) costs O(n²): a 60 KB message in 1-byte
// frames took 15.7 s of CPU, before any authentication. Here the chunks are
// gathered with a running count and concatenated once, so the decoder is
// handed each message as one chunk: envelopes are split by the gRPC frame
// codec (src/protocol/grpc-frame.ts, which they share the format of), a
// unary body by a running count. Nothing is allocated from a declared
// length: only bytes that arrived are kept, and a message declared larger
// than the server's bound is left to the decoder, which refuses it at its
// header (RESOURCE_EXHAUSTED), as before.

import {
  FrameDecoder,
  FrameError,
  type FrameSink,
  frameHeaderBytes,
} from "../protocol/grpc-frame.js";

/** Called with each whole message before it is handed on; may throw a ConnectError to end the call. */
export type MessageCheck = (payload: Uint8Array, flags: number) => void;

/** Enveloped bodies (gRPC, gRPC-Web, Connect streaming): one chunk per envelope. */
export async function* wholeEnvelopes(
  body: AsyncIterable<Uint8Array>,
  maxMessageBytes: number,
  check?: MessageCheck,
): AsyncGenerator<Uint8Array> {
  // The envelope is the gRPC frame: its codec splits the body.
  const decoder = new FrameDecoder(maxMessageBytes, { wholeFrames: true, allocate });
  const envelopes: Uint8Array[] = [];
  const sink: FrameSink = {
    onFrame(_flags, envelope) {
      envelopes.push(envelope);
      return true;
    },
  };
  let passThrough = false;
  for await (const chunk of body) {
    if (passThrough) {
      yield chunk;
      continue;
    }
    let refused = false;
    try {
      decoder.push(chunk, sink);
    } catch (error) {
      if (!(error instanceof FrameError && error.kind === "tooLarge")) throw error;
      refused = true;
    }
    for (const envelope of envelopes) {
      check?.(envelope.subarray(frameHeaderBytes), envelope[0] ?? 0);
      yield envelope;
    }
    envelopes.length = 0;
    if (refused) {
      // The decoder refuses it from the header; pass everything on.
      passThrough = true;
      yield joined(decoder.unread());
    }
  }
  // An unfinished envelope: the decoder says so.
  if (!passThrough && decoder.incomplete) yield joined(decoder.unread());
}

/** A Connect unary body (not enveloped): one chunk for the whole body. */
export async function* wholeBody(
  body: AsyncIterable<Uint8Array>,
  maxMessageBytes: number,
  check?: MessageCheck,
): AsyncGenerator<Uint8Array> {
  const pending = new Pending();
  let passThrough = false;
  for await (const chunk of body) {
    if (passThrough) {
      yield chunk;
      continue;
    }
    pending.add(chunk);
    if (pending.bytes > maxMessageBytes) {
      // Too large: the reader refuses it (RESOURCE_EXHAUSTED); pass it on.
      passThrough = true;
      yield pending.take();
    }
  }
  if (passThrough) return;
  const bytes = pending.take();
  check?.(bytes, 0);
  yield bytes;
}

const allocate = (size: number): Buffer => Buffer.allocUnsafe(size);

/** `parts` as one chunk (no copy when it is one already). */
function joined(parts: Uint8Array[]): Uint8Array {
  const [only] = parts;
  return parts.length === 1 && only !== undefined ? only : Buffer.concat(parts);
}

/** Chunks received and not yet handed on, with their total: adding is O(1), taking copies once. */
class Pending {
  private chunks: Uint8Array[] = [];
  bytes = 0;

  add(chunk: Uint8Array): void {
    if (chunk.byteLength === 0) return;
    this.chunks.push(chunk);
    this.bytes += chunk.byteLength;
  }

  /** Everything pending as one chunk (no copy when it is one already); pending is empty after. */
  take(): Uint8Array {
    const all = joined(this.chunks);
    this.chunks = [];
    this.bytes = 0;
    return all;
  }
}
