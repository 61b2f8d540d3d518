// The gRPC message frame ("length-prefixed message" of the gRPC HTTP/2
// protocol, and the envelope of gRPC-Web and Connect streaming): a flags
// byte (bit 0: compressed), the message length as 4 bytes big-endian, the
// message. One codec for the server's native gRPC path
// (src/server/rpc/grpc-wire.ts), the client's gRPC transport
// (src/client/grpc-transport.ts) and the Connect adapter's request bodies
// (src/host/whole-messages.ts, which hands frames on whole), on Uint8Array
// alone so that a web page could bundle it. The callers pass Node's
// Buffer.allocUnsafe as the allocator; the frames are then Buffers, which
// Node writes without a copy.
//
// What a caller answers for a broken frame (a status code, its own words for
// a compressed message) is its own; the text of an oversized message is
// written once, here, in the words connect-es uses for it.

/** The bytes before the message: flags, then the length. */
export const frameHeaderBytes = 5;

/** Flags bit 0: the message is compressed with the call's grpc-encoding. */
export const compressedFlag = 1;

/** Allocates the bytes of a frame or of a message read across chunks. */
export type Allocate = (size: number) => Uint8Array;

const newBytes: Allocate = (size) => new Uint8Array(size);

/**
 * The one text for a message over a size limit, in connect-es's words
 * (its Connect adapter answers the same for the same limit).
 */
export function messageSizeText(
  limit: "readMaxBytes" | "writeMaxBytes",
  size: number,
  max: number,
): string {
  return `message size ${size} is larger than configured ${limit} ${max}`;
}

/**
 * The one text for a request body that stalled while a message was due
 * (DEADLINE_EXCEEDED), on the Connect adapter and the native gRPC path.
 */
export function readTimeoutText(ms: number): string {
  const shown = ms % 1000 === 0 ? `${ms / 1000}s` : `${ms}ms`;
  return `request message: nothing arrived for ${shown} while a message was due; the server's read timeout (--read-timeout) ended the call`;
}

/**
 * A frame that breaks a rule of the reader or the writer: a message over
 * the size limit ("tooLarge"), or one flagged compressed where the reader
 * takes none ("compressed"). The caller chooses the status code.
 */
export class FrameError extends Error {
  constructor(
    readonly kind: "tooLarge" | "compressed",
    message: string,
  ) {
    super(message);
    this.name = "FrameError";
  }
}

/** Writes an uncompressed frame's header for a message of `length` bytes at `offset`. */
export function writeFrameHeader(target: Uint8Array, offset: number, length: number): void {
  target[offset] = 0;
  target[offset + 1] = length >>> 24;
  target[offset + 2] = (length >>> 16) & 0xff;
  target[offset + 3] = (length >>> 8) & 0xff;
  target[offset + 4] = length & 0xff;
}

/**
 * One uncompressed frame holding `message`. A message longer than
 * `maxBytes` throws a FrameError ("tooLarge", worded for writeMaxBytes).
 */
export function encodeFrame<B extends Uint8Array = Uint8Array>(
  message: Uint8Array,
  allocate: (size: number) => B = newBytes as (size: number) => B,
  maxBytes = 0xffffffff,
): B {
  const length = message.byteLength;
  if (length > maxBytes) {
    throw new FrameError("tooLarge", messageSizeText("writeMaxBytes", length, maxBytes));
  }
  const frame = allocate(frameHeaderBytes + length);
  writeFrameHeader(frame, 0, length);
  frame.set(message, frameHeaderBytes);
  return frame;
}

/** Receives the frames a FrameDecoder reads. */
export interface FrameSink {
  /**
   * One whole frame: its flags and its message (the frame itself, header
   * included, with `wholeFrames`). Returning false ends the reading: the
   * decoder drops the rest and reads nothing more.
   */
  onFrame(flags: number, message: Uint8Array): boolean;
}

export interface FrameDecoderOptions {
  /**
   * Refuse a frame flagged compressed from its header alone (the server,
   * which takes no grpc-encoding). Otherwise the flags reach the sink.
   */
  rejectCompressed?: boolean;
  /** Allocates a message read across chunks (default: a new Uint8Array). */
  allocate?: Allocate;
  /**
   * Hand the sink each frame whole, its header included, where it is
   * otherwise handed the message alone (the Connect adapter passes frames
   * on to connect-es's own decoder).
   */
  wholeFrames?: boolean;
}

/**
 * Reads the frames of a body as its chunks arrive: a frame may span chunks
 * and a chunk may hold several frames. A frame inside one chunk reaches the
 * sink as a view of that chunk, without a copy; a frame spread over several
 * is copied once, when it is whole (copying on every chunk costs O(n²) for
 * a message trickled in 1-byte chunks). Until then only the bytes that
 * arrived are held, never the length a header announces. A header whose
 * length exceeds `maxMessageBytes` (or that is flagged compressed, with
 * `rejectCompressed`) throws a FrameError before the message arrives; the
 * bytes from that header on are then `unread()`.
 */
export class FrameDecoder {
  /** The chunks (or their tails) holding the frame begun and not yet whole. */
  private parts: Uint8Array[] = [];
  /** Their total length, header included. */
  private buffered = 0;
  /** The begun frame's flags and message length, once its header is in; -1 before. */
  private flags = 0;
  private length = -1;
  private stopped = false;
  private failure: { error: unknown } | undefined;
  private readonly rejectCompressed: boolean;
  private readonly allocate: Allocate;
  /** The header bytes left out of what the sink is handed: all of them, or none (wholeFrames). */
  private readonly dropped: number;

  constructor(
    private readonly maxMessageBytes: number,
    options: FrameDecoderOptions = {},
  ) {
    this.rejectCompressed = options.rejectCompressed ?? false;
    this.allocate = options.allocate ?? newBytes;
    this.dropped = options.wholeFrames === true ? 0 : frameHeaderBytes;
  }

  /** True when the bytes read so far end inside a frame. */
  get incomplete(): boolean {
    return this.buffered > 0;
  }

  /**
   * The bytes pushed and not handed to the sink, as they arrived: the frame
   * begun, or after a FrameError for a header, everything from that header
   * on in the chunks pushed (a caller that leaves the refusal to another
   * reader hands these on to it).
   */
  unread(): Uint8Array[] {
    return [...this.parts];
  }

  /**
   * Reads `chunk`, handing each frame it completes to `sink`, in order.
   * Throws a FrameError for a bad header, or what the sink threw; the
   * decoder then throws that again on every later push.
   */
  push(chunk: Uint8Array, sink: FrameSink): void {
    if (this.failure !== undefined) throw this.failure.error;
    if (this.stopped || chunk.byteLength === 0) return;
    try {
      this.read(chunk, sink);
    } catch (error) {
      this.failure = { error };
      throw error;
    }
  }

  private read(chunk: Uint8Array, sink: FrameSink): void {
    const n = chunk.byteLength;
    let off = 0;
    if (this.buffered > 0) {
      // First the frame begun in earlier chunks.
      if (this.length < 0) {
        if (this.buffered + n < frameHeaderBytes) {
          this.hold(chunk);
          return;
        }
        this.splitHeader(chunk);
      }
      const missing = frameHeaderBytes + this.length - this.buffered;
      if (n < missing) {
        this.hold(chunk);
        return;
      }
      const message = this.join(chunk.subarray(0, missing));
      off = missing;
      if (!sink.onFrame(this.flags, message)) {
        this.stopped = true;
        return;
      }
    }
    while (n - off >= frameHeaderBytes) {
      const flags = chunk[off] as number;
      const length = readLength(chunk, off + 1);
      const refusal = this.refusal(flags, length);
      if (refusal !== undefined) {
        this.hold(chunk.subarray(off));
        throw refusal;
      }
      const start = off + frameHeaderBytes;
      if (n - start < length) {
        this.flags = flags;
        this.length = length;
        break;
      }
      const end = start + length;
      if (!sink.onFrame(flags, chunk.subarray(off + this.dropped, end))) {
        this.stopped = true;
        return;
      }
      off = end;
    }
    if (off < n) this.hold(chunk.subarray(off));
  }

  /** The FrameError for a header that breaks a rule, if it does. */
  private refusal(flags: number, length: number): FrameError | undefined {
    if (length > this.maxMessageBytes) {
      return new FrameError(
        "tooLarge",
        messageSizeText("readMaxBytes", length, this.maxMessageBytes),
      );
    }
    if (this.rejectCompressed && (flags & compressedFlag) !== 0) {
      return new FrameError("compressed", "message flagged compressed");
    }
    return undefined;
  }

  private hold(part: Uint8Array): void {
    this.parts.push(part);
    this.buffered += part.byteLength;
  }

  /** Reads a header that began in the held parts and ends in `chunk`. */
  private splitHeader(chunk: Uint8Array): void {
    let flags = -1;
    let length = 0;
    let read = 0;
    const take = (part: Uint8Array) => {
      for (let i = 0; i < part.byteLength && read < frameHeaderBytes; i++, read++) {
        const b = part[i] as number;
        if (flags < 0) flags = b;
        else length = length * 256 + b;
      }
    };
    for (const part of this.parts) take(part);
    take(chunk);
    const refusal = this.refusal(flags, length);
    if (refusal !== undefined) {
      this.hold(chunk);
      throw refusal;
    }
    this.flags = flags;
    this.length = length;
  }

  /** The begun frame's message (or whole frame), completed by `last`, as one array; the decoder is then between frames. */
  private join(last: Uint8Array): Uint8Array {
    this.parts.push(last);
    const message = this.allocate(frameHeaderBytes + this.length - this.dropped);
    let skip = this.dropped;
    let pos = 0;
    for (const part of this.parts) {
      if (skip >= part.byteLength) {
        skip -= part.byteLength;
        continue;
      }
      message.set(skip > 0 ? part.subarray(skip) : part, pos);
      pos += part.byteLength - skip;
      skip = 0;
    }
    this.parts = [];
    this.buffered = 0;
    this.length = -1;
    return message;
  }
}

/** A frame header's length field (4 bytes big-endian) at `offset`. */
function readLength(bytes: Uint8Array, offset: number): number {
  return (
    (bytes[offset] as number) * 0x1000000 +
    (((bytes[offset + 1] as number) << 16) |
      ((bytes[offset + 2] as number) << 8) |
      (bytes[offset + 3] as number))
  );
}
