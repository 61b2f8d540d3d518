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

export const WINDOW_UPDATE = 8;

/** An HTTP/2 connection driven frame by frame, with everything the server sent kept in order. */
export interface RawH2Connection {
  readonly frames: InboundFrame[];
  send(frame: Buffer): void;
  /** Resolves with the first frame (from index `from`) that `match` accepts. */
  next(match: (frame: InboundFrame) => boolean, from?: number): Promise<InboundFrame>;
  /**
   * A PING round trip: once its ACK is back, the server has handled every
   * frame sent before it and written what it wrote in answer to them.
   */
  barrier(): Promise<void>;
  /** The stream's flow-control window the server grants (its SETTINGS), in bytes. */
  readonly initialWindow: number;
  close(): void;
}

/** Opens a cleartext HTTP/2 connection: preface, SETTINGS exchanged. */
export async function openRawH2(port: number): Promise<RawH2Connection> {
  const { connect } = await import("node:net");
  const socket = connect(port, "127.0.0.1");
  socket.on("error", () => {});
  const frames: InboundFrame[] = [];
  const waiters = new Set<() => void>();
  let initialWindow = 65_535;
  let closed = false;
  socket.on("close", () => {
    closed = true;
    for (const w of waiters) w();
  });
  readFrames(socket, (f) => {
    if (f.type === FRAME.SETTINGS && (f.flags & FLAG.ACK) === 0) {
      for (let i = 0; i + 6 <= f.payload.length; i += 6) {
        if (f.payload.readUInt16BE(i) === 4) initialWindow = f.payload.readUInt32BE(i + 2);
      }
      socket.write(h2Frame(FRAME.SETTINGS, FLAG.ACK, 0));
    }
    frames.push(f);
    for (const w of waiters) w();
  });
  await new Promise<void>((resolve) => socket.once("connect", () => resolve()));
  socket.write(Buffer.concat([preface, h2Frame(FRAME.SETTINGS, 0, 0)]));
  let pings = 0;
  const next = (match: (frame: InboundFrame) => boolean, from = 0) =>
    new Promise<InboundFrame>((resolve, reject) => {
      const check = () => {
        const found = frames.slice(from).find(match);
        if (found) {
          waiters.delete(check);
          resolve(found);
        } else if (closed) {
          waiters.delete(check);
          reject(new Error("the connection closed first"));
        }
      };
      waiters.add(check);
      check();
    });
  const connection: RawH2Connection = {
    frames,
    send: (frame) => socket.write(frame),
    next,
    barrier: async () => {
      const data = Buffer.alloc(8);
      data.writeUInt32BE(++pings, 4);
      socket.write(h2Frame(FRAME.PING, 0, 0, data));
      await next(
        (f) => f.type === FRAME.PING && (f.flags & FLAG.ACK) !== 0 && f.payload.equals(data),
      );
    },
    get initialWindow() {
      return initialWindow;
    },
    close: () => socket.destroy(),
  };
  await next((f) => f.type === FRAME.SETTINGS && (f.flags & FLAG.ACK) === 0);
  return connection;
}
