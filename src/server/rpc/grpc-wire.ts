// The gRPC wire format as the native path (grpc-native.ts) needs it: the
// messages of a request body, read as the bytes arrive, and the frames and
// status trailers of an answer. The frames themselves are the codec's
// (src/protocol/grpc-frame.ts), shared with the client's transport.

import type http2 from "node:http2";
import { create, type DescMessage, fromBinary, type Message, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { setTrailerStatus } from "@connectrpc/connect/protocol-grpc";
import { policyText } from "../../call/error-texts.js";
import {
  encodeFrame as encodeMessageFrame,
  FrameDecoder,
  FrameError,
  type FrameSink,
} from "../../protocol/grpc-frame.js";

export const grpcContentType = "application/grpc+proto";

/** A successful call's trailers. Node sends a headers object as it is; nothing mutates this one. */
export const okTrailers: http2.OutgoingHttpHeaders = Object.freeze({ "grpc-status": "0" });

/** The frame of one message: a flags byte (0: not compressed), a 4-byte length, the bytes. */
export function encodeFrame(desc: DescMessage, message: unknown): Buffer {
  const m =
    (message as Message).$typeName === desc.typeName
      ? (message as Message)
      : create(desc, message as Record<string, unknown>);
  return encodeMessageFrame(toBinary(desc, m), allocate);
}

/** The status of a failed call as trailers (grpc-status, grpc-message, grpc-status-details-bin). */
export function errorTrailers(error: ConnectError): http2.OutgoingHttpHeaders {
  const out: http2.OutgoingHttpHeaders = {};
  for (const [name, value] of setTrailerStatus(new Headers(), error)) out[name] = value;
  return out;
}

/**
 * Reads the message frames of a request body as its chunks arrive (the
 * codec, src/protocol/grpc-frame.ts, reads the frames). A message larger
 * than `maxMessageBytes` is RESOURCE_EXHAUSTED (what the Connect adapter
 * answers), a compressed one (the native path takes no grpc-encoding) or
 * one that is not protobuf is INVALID_ARGUMENT.
 */
export class FrameReader<T extends Message> implements FrameSink {
  private readonly decoder: FrameDecoder;
  /** The messages of the chunk being read. */
  private messages: T[] = [];

  /**
   * `fast` reads the usual shape of a message without protobuf-es and
   * answers undefined for anything else, which protobuf-es then reads.
   */
  constructor(
    private readonly desc: DescMessage,
    maxMessageBytes: number,
    private readonly fast?: (bytes: Uint8Array) => T | undefined,
  ) {
    this.decoder = new FrameDecoder(maxMessageBytes, { rejectCompressed: true, allocate });
  }

  /** The messages completed by `chunk`, in order. Throws on a bad frame. */
  push(chunk: Buffer): T[] {
    const messages: T[] = [];
    this.messages = messages;
    try {
      this.decoder.push(chunk, this);
    } catch (error) {
      if (!(error instanceof FrameError)) throw error;
      throw error.kind === "compressed"
        ? new ConnectError(policyText.flaggedCompressed, Code.InvalidArgument)
        : new ConnectError(error.message, Code.ResourceExhausted);
    }
    return messages;
  }

  /** True when the body ended inside a frame. */
  get incomplete(): boolean {
    return this.decoder.incomplete;
  }

  /** The decoder's sink: one frame's message, read. */
  onFrame(_flags: number, bytes: Uint8Array): boolean {
    this.messages.push(this.decode(bytes));
    return true;
  }

  private decode(bytes: Uint8Array): T {
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

// Buffer.allocUnsafe, looked up when called (a test counts the bytes copied through it).
const allocate = (size: number): Buffer => Buffer.allocUnsafe(size);
