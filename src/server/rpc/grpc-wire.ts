// The gRPC wire format as the native path (grpc-native.ts) needs it: the
// length-prefixed message frames of a request body, read as the bytes
// arrive, and the frames and status trailers of an answer.

import type http2 from "node:http2";
import { create, type DescMessage, fromBinary, type Message, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { setTrailerStatus } from "@connectrpc/connect/protocol-grpc";
import { policyText } from "./error-texts.js";

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
  private pending: Buffer | undefined;

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
    let buffer = this.pending ? Buffer.concat([this.pending, chunk]) : chunk;
    this.pending = undefined;
    const messages: T[] = [];
    while (buffer.length >= 5) {
      const length = buffer.readUInt32BE(1);
      if (length > this.maxMessageBytes) {
        throw new ConnectError(
          `message size ${length} is larger than configured readMaxBytes ${this.maxMessageBytes}`,
          Code.ResourceExhausted,
        );
      }
      if ((buffer[0] ?? 0) & 1) {
        throw new ConnectError(policyText.flaggedCompressed, Code.InvalidArgument);
      }
      if (buffer.length < 5 + length) break;
      messages.push(this.decode(buffer.subarray(5, 5 + length)));
      buffer = buffer.subarray(5 + length);
    }
    if (buffer.length > 0) this.pending = buffer;
    return messages;
  }

  /** True when the body ended inside a frame. */
  get incomplete(): boolean {
    return this.pending !== undefined;
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
