// A bare HTTP/2 gRPC call, for what the Connect client hides: here a client
// that sends and then truly stops reading, so that HTTP/2 flow control pushes
// back on the server.

import http2 from "node:http2";
import { create, type DescMessage, type MessageInitShape, toBinary } from "@bufbuild/protobuf";

export interface RawCall {
  /** Sends one message (gRPC length-prefixed framing). */
  send(bytes: Uint8Array): boolean;
  /** Ends the request side. */
  end(): void;
  /** Messages read so far (after `read`). */
  readonly frames: Uint8Array[];
  /** Starts reading. Until then the client reads nothing at all. */
  read(): void;
  /** Resolves once `done(frames)` holds, or rejects when the call ends or time runs out. */
  until(done: (frames: Uint8Array[]) => boolean, timeoutMs?: number): Promise<void>;
  /** The call's end: grpc-status and grpc-message from the trailers. */
  readonly ended: Promise<{ status: number | undefined; message: string }>;
  close(): void;
}

export function frame<S extends DescMessage>(schema: S, init: MessageInitShape<S>): Uint8Array {
  const body = toBinary(schema, create(schema, init));
  const out = new Uint8Array(5 + body.length);
  new DataView(out.buffer).setUint32(1, body.length);
  out.set(body, 5);
  return out;
}

/** Opens a call on its own HTTP/2 connection; it reads nothing until `read`. */
export function openRawCall(baseUrl: string, path: string): RawCall {
  const session = http2.connect(baseUrl);
  session.on("error", () => {});
  const stream = session.request({
    ":method": "POST",
    ":path": path,
    "content-type": "application/grpc+proto",
    te: "trailers",
  });
  stream.on("error", () => {});
  // The status: in trailers, or in the response headers of a trailers-only answer.
  let trailers: http2.IncomingHttpHeaders | undefined;
  stream.on("response", (headers) => {
    if (headers["grpc-status"] !== undefined) trailers = headers;
  });
  stream.on("trailers", (t) => {
    trailers = t;
  });
  const frames: Uint8Array[] = [];
  const listeners = new Set<() => void>();
  let buffered = Buffer.alloc(0);
  let finished = false;
  const ended = new Promise<{ status: number | undefined; message: string }>((resolve) => {
    // The response is over when its readable side ends, even while the
    // request side is still open.
    const onEnd = () => {
      if (finished) return;
      finished = true;
      for (const l of listeners) l();
      const status = trailers?.["grpc-status"];
      resolve({
        status: status === undefined ? undefined : Number(status),
        message: decodeURIComponent(String(trailers?.["grpc-message"] ?? "")),
      });
    };
    stream.on("end", onEnd);
    stream.on("close", onEnd);
  });
  return {
    frames,
    ended,
    send: (bytes) => stream.write(bytes),
    end: () => stream.end(),
    read: () => {
      stream.on("data", (chunk: Buffer) => {
        buffered = Buffer.concat([buffered, chunk]);
        while (buffered.length >= 5) {
          const length = buffered.readUInt32BE(1);
          if (buffered.length < 5 + length) break;
          frames.push(buffered.subarray(5, 5 + length));
          buffered = buffered.subarray(5 + length);
        }
        for (const l of listeners) l();
      });
    },
    until: (done, timeoutMs = 20_000) =>
      new Promise<void>((resolve, reject) => {
        const check = () => {
          if (done(frames)) finish();
          else if (finished) finish(new Error("the call ended first"));
        };
        const timer = setTimeout(() => finish(new Error("timed out")), timeoutMs);
        const finish = (error?: Error) => {
          clearTimeout(timer);
          listeners.delete(check);
          if (error) reject(error);
          else resolve();
        };
        listeners.add(check);
        check();
      }),
    close: () => {
      stream.close();
      session.close();
    },
  };
}
