// Request bodies handed to connect-node one whole message per chunk.
//
// connect-es's envelope decoder (gRPC, gRPC-Web and Connect streaming
// bodies) keeps the chunks of an unfinished message in a list and sums the
// whole list on every chunk that arrives, so a message sent as n tiny HTTP/2
// DATA frames (or HTTP/1.1 chunks) costs O(n²): a 60 KB message in 1-byte
// frames took 15.7 s of CPU, before any authentication. Here the chunks are
// gathered with a running count and concatenated once, so the decoder is
// handed each message as one chunk. Nothing is allocated from a declared
// length: only bytes that arrived are kept, and a message declared larger
// than the server's bound is left to the decoder, which refuses it at its
// header (RESOURCE_EXHAUSTED), as before.

/** Called with each whole message before it is handed on; may throw a ConnectError to end the call. */
export type MessageCheck = (payload: Uint8Array, flags: number) => void;

const headerBytes = 5;

/** Enveloped bodies (gRPC, gRPC-Web, Connect streaming): one chunk per envelope. */
export async function* wholeEnvelopes(
  body: AsyncIterable<Uint8Array>,
  maxMessageBytes: number,
  check?: MessageCheck,
): AsyncGenerator<Uint8Array> {
  const pending = new Pending();
  let need = headerBytes;
  let payloadBytes: number | undefined;
  let passThrough = false;
  for await (const chunk of body) {
    if (passThrough) {
      yield chunk;
      continue;
    }
    pending.add(chunk);
    while (pending.bytes >= need) {
      const bytes = pending.take();
      if (payloadBytes === undefined) {
        payloadBytes = new DataView(bytes.buffer, bytes.byteOffset, headerBytes).getUint32(1);
        if (payloadBytes > maxMessageBytes) {
          // The decoder refuses it from the header; pass everything on.
          passThrough = true;
          yield bytes;
          break;
        }
        pending.add(bytes);
        need = headerBytes + payloadBytes;
        continue;
      }
      const message = bytes.subarray(0, need);
      check?.(message.subarray(headerBytes), message[0] ?? 0);
      yield message;
      if (bytes.byteLength > need) pending.add(bytes.subarray(need));
      need = headerBytes;
      payloadBytes = undefined;
    }
  }
  // An unfinished envelope: the decoder says so.
  if (pending.bytes > 0) yield pending.take();
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
    const [only] = this.chunks;
    const all =
      this.chunks.length === 1 && only !== undefined
        ? only
        : Buffer.concat(this.chunks, this.bytes);
    this.chunks = [];
    this.bytes = 0;
    return all;
  }
}
