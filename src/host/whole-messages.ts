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
//
// A body that stalls while a message is due (inside an envelope; for a call
// that takes one message, anywhere before the body's end) fails with
// DEADLINE_EXCEEDED after the read timeout: a client that sends part of a
// message and then nothing must not hold what it sent, nor its stream,
// forever. Time the server spends not reading (its handler busy, the
// decoder not asking) does not count.

import { Code, ConnectError } from "@connectrpc/connect";
import {
  FrameDecoder,
  FrameError,
  type FrameSink,
  frameHeaderBytes,
  readTimeoutText,
} from "../protocol/grpc-frame.js";

/** Called with each whole message before it is handed on; may throw a ConnectError to end the call. */
export type MessageCheck = (payload: Uint8Array, flags: number) => void;

/** How long a body may stall while a message is due, and whom to tell when it did. */
export interface ReadTimeout {
  ms: number;
  /** The call takes one message: the whole body is due, not only the inside of an envelope. */
  wholeBodyDue: boolean;
  /** Called when the body stalled, before the read fails. */
  onStall?: () => void;
}

/** Enveloped bodies (gRPC, gRPC-Web, Connect streaming): one chunk per envelope. */
export async function* wholeEnvelopes(
  body: AsyncIterable<Uint8Array>,
  maxMessageBytes: number,
  check?: MessageCheck,
  timeout?: ReadTimeout,
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
  const chunks = new TimedChunks(body, timeout);
  try {
    for (;;) {
      const due = timeout?.wholeBodyDue === true || decoder.incomplete;
      const chunk = await chunks.next(!passThrough && due);
      if (chunk === undefined) break;
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
  } finally {
    chunks.close();
  }
}

/** A Connect unary body (not enveloped): one chunk for the whole body. */
export async function* wholeBody(
  body: AsyncIterable<Uint8Array>,
  maxMessageBytes: number,
  check?: MessageCheck,
  timeout?: ReadTimeout,
): AsyncGenerator<Uint8Array> {
  const pending = new Pending();
  let passThrough = false;
  const chunks = new TimedChunks(body, timeout);
  try {
    for (;;) {
      // The body is the message: all of it is due.
      const chunk = await chunks.next(!passThrough);
      if (chunk === undefined) break;
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
  } finally {
    chunks.close();
  }
}

const allocate = (size: number): Buffer => Buffer.allocUnsafe(size);

/**
 * The chunks of a body, each read failing after the read timeout when a
 * message is due. Leaving early (an error, a refused message) ends the
 * body's iterator, as `for await` would; after a stall it is left pending
 * (ending it would wait for the read that never comes), and the request is
 * cut where it entered (request-end.ts).
 */
class TimedChunks {
  private readonly it: AsyncIterator<Uint8Array>;
  private stalled = false;
  private done = false;

  constructor(
    body: AsyncIterable<Uint8Array>,
    private readonly timeout: ReadTimeout | undefined,
  ) {
    this.it = body[Symbol.asyncIterator]();
  }

  /** The next chunk, or undefined at the body's end. */
  async next(due: boolean): Promise<Uint8Array | undefined> {
    const result = await this.read(due);
    if (result.done) {
      this.done = true;
      return undefined;
    }
    return result.value;
  }

  /** Ends the body's iterator when left before its end, unless a read of it is still pending. */
  close(): void {
    if (this.done || this.stalled) return;
    this.done = true;
    void this.it.return?.()?.catch(() => {});
  }

  private read(due: boolean): Promise<IteratorResult<Uint8Array>> {
    const timeout = this.timeout;
    if (timeout === undefined || !due) return this.it.next();
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.stalled = true;
        timeout.onStall?.();
        reject(new ConnectError(readTimeoutText(timeout.ms), Code.DeadlineExceeded));
      }, timeout.ms);
      this.it.next().then(
        (result) => {
          clearTimeout(timer);
          resolve(result);
        },
        (error: unknown) => {
          clearTimeout(timer);
          reject(error);
        },
      );
    });
  }
}

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
