// HTTP/2 by hand over a TCP socket (RFC 9113), for what a well-behaved
// client never sends: streams beyond the server's limit, floods of HEADERS,
// CONTINUATION or RST_STREAM. Frames out are built here; frames in are split
// here and handed to the caller one at a time.

import type net from "node:net";

export const preface = Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");

export const FRAME = {
  DATA: 0,
  HEADERS: 1,
  RST_STREAM: 3,
  SETTINGS: 4,
  PING: 6,
  GOAWAY: 7,
  CONTINUATION: 9,
};

export const FLAG = { END_STREAM: 1, ACK: 1, END_HEADERS: 4 };

export function h2Frame(
  type: number,
  flags: number,
  streamId: number,
  payload: Uint8Array = new Uint8Array(),
): Buffer {
  const head = Buffer.alloc(9);
  head.writeUIntBE(payload.length, 0, 3);
  head[3] = type;
  head[4] = flags;
  head.writeUInt32BE(streamId & 0x7fffffff, 5);
  return Buffer.concat([head, payload]);
}

/** HPACK integer with an n-bit prefix (RFC 7541 §5.1). */
function hpackInt(value: number, prefixBits: number, firstByte = 0): Buffer {
  const max = (1 << prefixBits) - 1;
  if (value < max) return Buffer.from([firstByte | value]);
  const bytes = [firstByte | max];
  let rest = value - max;
  while (rest >= 128) {
    bytes.push((rest % 128) + 128);
    rest = Math.floor(rest / 128);
  }
  bytes.push(rest);
  return Buffer.from(bytes);
}

/** A header block of literals without indexing and without Huffman coding. */
export function headerBlock(headers: [string, string][]): Buffer {
  const parts: Buffer[] = [];
  for (const [name, value] of headers) {
    const n = Buffer.from(name);
    const v = Buffer.from(value);
    parts.push(Buffer.from([0]), hpackInt(n.length, 7), n, hpackInt(v.length, 7), v);
  }
  return Buffer.concat(parts);
}

export interface InboundFrame {
  type: number;
  flags: number;
  streamId: number;
  payload: Buffer;
}

/** Calls `onFrame` with every whole frame the socket delivers, in order. */
export function readFrames(socket: net.Socket, onFrame: (frame: InboundFrame) => void): void {
  let buffered = Buffer.alloc(0);
  socket.on("data", (chunk: Buffer) => {
    buffered = Buffer.concat([buffered, chunk]);
    while (buffered.length >= 9) {
      const length = buffered.readUIntBE(0, 3);
      if (buffered.length < 9 + length) break;
      onFrame({
        type: buffered[3] ?? 0,
        flags: buffered[4] ?? 0,
        streamId: buffered.readUInt32BE(5) & 0x7fffffff,
        payload: buffered.subarray(9, 9 + length),
      });
      buffered = buffered.subarray(9 + length);
    }
  });
}
