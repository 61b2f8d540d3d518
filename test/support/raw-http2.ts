// HTTP/2 by hand over a TCP socket (RFC 9113), for what a well-behaved
// client never sends: streams beyond the server's limit, floods of HEADERS,
// CONTINUATION or RST_STREAM. Frames out are built here; frames in are split
// here and handed to the caller one at a time.

import net from "node:net";

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

export interface TricklingProxy {
  /** http://127.0.0.1:<port>, for HTTP/2 (h2c) clients. */
  readonly url: string;
  /** DATA frames forwarded to the server so far. */
  readonly dataFrames: number;
  close(): Promise<void>;
}

/**
 * A TCP proxy in front of an h2c server that forwards every DATA frame a
 * client sends as DATA frames of one byte each, written one per turn of the
 * event loop so that the server reads them one at a time: a peer trickling
 * its messages. Other frames, and everything the server sends, pass
 * unchanged; flow control is unaffected (the same bytes, in order).
 */
export async function startTricklingProxy(target: string): Promise<TricklingProxy> {
  const { hostname, port } = new URL(target);
  const sockets = new Set<net.Socket>();
  let dataFrames = 0;
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(port), hostname);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.setNoDelay(true);
      s.on("error", () => {});
      s.once("close", () => {
        sockets.delete(s);
        client.destroy();
        upstream.destroy();
      });
    }
    upstream.on("data", (chunk: Buffer) => client.write(chunk));
    const out: Buffer[] = [];
    let next = 0;
    let pumping = false;
    const pump = () => {
      if (pumping) return;
      pumping = true;
      const step = () => {
        const frame = out[next];
        if (frame === undefined || upstream.destroyed) {
          pumping = false;
          return;
        }
        out[next++] = Buffer.alloc(0);
        upstream.write(frame);
        setImmediate(step);
      };
      step();
    };
    let buffered = Buffer.alloc(0);
    let prefaceSeen = false;
    client.on("data", (chunk: Buffer) => {
      buffered = Buffer.concat([buffered, chunk]);
      if (!prefaceSeen) {
        if (buffered.length < preface.length) return;
        out.push(buffered.subarray(0, preface.length));
        buffered = buffered.subarray(preface.length);
        prefaceSeen = true;
      }
      while (buffered.length >= 9) {
        const length = buffered.readUIntBE(0, 3);
        if (buffered.length < 9 + length) break;
        const type = buffered[3];
        const flags = buffered[4] ?? 0;
        const streamId = buffered.readUInt32BE(5) & 0x7fffffff;
        const payload = buffered.subarray(9, 9 + length);
        const PADDED = 0x8;
        if (type === FRAME.DATA && length > 1 && (flags & PADDED) === 0) {
          for (let i = 0; i < length; i++) {
            const last = i === length - 1;
            out.push(h2Frame(FRAME.DATA, last ? flags : 0, streamId, payload.subarray(i, i + 1)));
            dataFrames += 1;
          }
        } else {
          if (type === FRAME.DATA) dataFrames += 1;
          out.push(buffered.subarray(0, 9 + length));
        }
        buffered = buffered.subarray(9 + length);
      }
      pump();
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const address = server.address() as net.AddressInfo;
  return {
    url: `http://127.0.0.1:${address.port}`,
    get dataFrames() {
      return dataFrames;
    },
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
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
