// What happens to a request body the server no longer reads: a call answered
// before its client finished sending (refused from its headers, refused
// mid-stream, or stalled past the read timeout). Nothing more of it is kept,
// and it does not hold its stream or connection.
//
// HTTP/2: once the answer is out, the stream is reset with NO_ERROR (RFC 9113
// §8.1: a server that has sent a complete response may ask the client to stop
// sending that way). Not at once: connect-node's client reports a reset that
// arrives before it has read the status as a premature close, so a client
// that stops sending when it sees the status is left to end the stream
// itself; the stream is reset on the next bytes it sends. What waits until
// then is consumed and dropped, so a client held back by flow control (its
// window spent on bytes nobody read) gets window to send them. A stalled
// body gets no such wait: nothing more is coming.
//
// Armed on the next turn of the event loop, not now: the status is given to
// nghttp2 from inside its send or receive loop, and a reset submitted before
// that loop returns marks the stream closing before the status is packed:
// nghttp2 then drops the status and the client sees its stream end without one.
//
// HTTP/1.1: Node's server reads and drops the rest of a body nobody read
// once the answer is written (nothing of it is kept); a stalled body's
// connection is closed, since nothing more is coming.
//
// The native gRPC path (src/server/rpc/grpc-native.ts) uses the first two
// on its own streams; `cutUnreadBody` does it for a request the Connect
// adapter answered.

import type http from "node:http";
import http2 from "node:http2";

/** Resets `stream` (NO_ERROR) on the next bytes it receives; what arrives is dropped. */
export function resetOnMoreData(
  stream: http2.ServerHttp2Stream,
  resume: () => void = () => stream.resume(),
): void {
  setImmediate(() => {
    if (stream.destroyed) return;
    stream.on("data", () => {
      if (!stream.closed) stream.close(http2.constants.NGHTTP2_NO_ERROR);
    });
    // Also when the stream is closed already (the client had finished
    // sending): Node destroys it, and frees its place among the
    // connection's streams, only once what it received has been read.
    resume();
  });
}

/** Resets `stream` (NO_ERROR) now that its answer is out: its body stalled. */
export function resetStalled(
  stream: http2.ServerHttp2Stream,
  resume: () => void = () => stream.resume(),
): void {
  setImmediate(() => {
    if (stream.destroyed) return;
    if (!stream.closed) stream.close(http2.constants.NGHTTP2_NO_ERROR);
    resume();
  });
}

type NodeRequest = http.IncomingMessage | http2.Http2ServerRequest;
/** What is used of a response: connect-node's type of it narrows `write`. */
type NodeResponse = Pick<http.ServerResponse | http2.Http2ServerResponse, "once">;

/**
 * Once `res` is answered, cuts what is left of `req`'s body (see above).
 * Returns a function that marks the body stalled: then it is cut at once.
 */
export function cutUnreadBody(req: NodeRequest, res: NodeResponse): () => void {
  let stalled = false;
  if ("stream" in req) {
    // Node's compatibility response always asks for trailers (even none)
    // once it has sent its headers and body: its status is given to nghttp2
    // by then. This listener runs after the response's own, which sends them.
    const stream = req.stream;
    stream.once("wantTrailers", () => {
      if (req.complete) return;
      const resume = () => req.resume();
      if (stalled) resetStalled(stream, resume);
      else resetOnMoreData(stream, resume);
    });
  } else {
    // Node reads and drops the rest of an unread HTTP/1.1 body itself once
    // the answer is out; a stalled one would hold the connection forever.
    const socket = req.socket;
    res.once("finish", () => {
      if (stalled && !req.complete) socket.destroy();
    });
  }
  return () => {
    stalled = true;
  };
}
