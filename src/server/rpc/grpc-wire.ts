// The gRPC wire format as the native path (grpc-native.ts) needs it: the
// length-prefixed message frames of a request body, read as the bytes
// arrive, and the frames and status trailers of an answer.

import type http2 from "node:http2";
import { create, type DescMessage, fromBinary, type Message, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { setTrailerStatus } from "@connectrpc/connect/protocol-grpc";
import { policyText } from "../../call/error-texts.js";

export const grpcContentType = "application/grpc+proto";

/** A successful call's trailers. Node sends a headers object as it is; nothing mutates this one. */
export const okTrailers: http2.OutgoingHttpHeaders = Object.freeze({ "grpc-status": "0" });

/** The frame of one message: a flags byte (0: not compressed), a 4-byte length, the bytes. */
export function encodeFrame(desc: DescMessage, message: unknown): Buffer {
  const m =
    (message as Message).$typeName === desc.typeName
      ? (message as Message)
      : create(desc, message as Record<string, unknown>);
  const bytes = toBinary(desc, m);
  const frame = Buffer.allocUnsafe(5 + bytes.length);
  frame[0] = 0;
  frame.writeUInt32BE(bytes.length, 1);
  frame.set(bytes, 5);
  return frame;
}

/** The status of a failed call as trailers (grpc-status, grpc-message, grpc-status-details-bin). */
export function errorTrailers(error: ConnectError): http2.OutgoingHttpHeaders {
  const out: http2.OutgoingHttpHeaders = {};
  for (const [name, value] of setTrailerStatus(new Headers(), error)) out[name] = value;
  return out;
}

/**
 * Reads the message frames of a request body as its chunks arrive: a frame
 * may span chunks and a chunk may hold several frames. A message larger
 * than `maxMessageBytes` is RESOURCE_EXHAUSTED (what the Connect adapter
 * answers), a compressed one (the native path takes no grpc-encoding) or
 * one that is not protobuf is INVALID_ARGUMENT.
 */
export class FrameReader<T extends Message> {
  // The chunks of the frame being read, with their total. A frame trickled
  // in tiny chunks (1-byte HTTP/2 DATA frames) is concatenated once, when
  // it is whole: concatenating on every chunk copied O(n²) bytes.
  private chunks: Buffer[] = [];
  private buffered = 0;
  /** The length of the frame being read (header included), once its header is in. */
  private frameBytes: number | undefined;

  /**
   * `fast` reads the usual shape of a message without protobuf-es and
   * answers undefined for anything else, which protobuf-es then reads.
   */
  constructor(
    private readonly desc: DescMessage,
    private readonly maxMessageBytes: number,
    private readonly fast?: (bytes: Buffer) => T | undefined,
  ) {}

  /** The messages completed by `chunk`, in order. Throws on a bad frame. */
  push(chunk: Buffer): T[] {
    if (chunk.length > 0) {
      this.chunks.push(chunk);
      this.buffered += chunk.length;
    }
    const messages: T[] = [];
    while (this.buffered >= 5) {
      if (this.frameBytes === undefined) {
        const head = this.joined();
        const length = head.readUInt32BE(1);
        if (length > this.maxMessageBytes) {
          throw new ConnectError(
            `message size ${length} is larger than configured readMaxBytes ${this.maxMessageBytes}`,
            Code.ResourceExhausted,
          );
        }
        if ((head[0] ?? 0) & 1) {
          throw new ConnectError(policyText.flaggedCompressed, Code.InvalidArgument);
        }
        this.frameBytes = 5 + length;
      }
      if (this.buffered < this.frameBytes) break;
      const buffer = this.joined();
      messages.push(this.decode(buffer.subarray(5, this.frameBytes)));
      const rest = buffer.subarray(this.frameBytes);
      this.chunks = rest.length > 0 ? [rest] : [];
      this.buffered = rest.length;
      this.frameBytes = undefined;
    }
    return messages;
  }

  /** True when the body ended inside a frame. */
  get incomplete(): boolean {
    return this.buffered > 0;
  }

  /** The buffered chunks as one (copied only when there are several). */
  private joined(): Buffer {
    const [first] = this.chunks;
    if (this.chunks.length === 1 && first !== undefined) return first;
    const all = Buffer.concat(this.chunks, this.buffered);
    this.chunks = [all];
    return all;
  }

  private decode(bytes: Buffer): T {
    const message = this.fast?.(bytes);
    if (message) return message;
    try {
      return fromBinary(this.desc, bytes) as T;
    } catch (error) {
      // The same words the Connect path uses (parse-errors.ts).
      throw new ConnectError(
        `request message: parse binary: ${(error as Error).message}`,
        Code.InvalidArgument,
      );
    }
  }
}
