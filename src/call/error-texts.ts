// The error texts the lease server's serving paths answer on their own
// (beyond the domain errors, whose texts live with their rules): one message
// per call, a stream that ends inside a message, a message flagged compressed
// without a compression, a deadline, a cancel, an expired token. Both paths
// (the Connect adapter and the native gRPC path) answer in these words. The
// text of a message over the size limit is the frame codec's
// (src/protocol/grpc-frame.ts, messageSizeText), shared with the client, and
// so is the text of a body that stalled past --read-timeout (readTimeoutText),
// which the host answers before this policy sees a message.

/** Error texts the serving paths answer themselves, in one place. */
export const policyText = {
  oneMessageGotNone: "request message: this call takes exactly one message, got none",
  oneMessageGotMore: "request message: this call takes exactly one message, got more than one",
  endedInsideMessage: "request message: the stream ended inside a message",
  flaggedCompressed: "request message: flagged compressed, but the request names no compression",
  timedOut: "the operation timed out",
  cancelled: "the call was cancelled",
  tokenExpired: "token expired",
  certificateExpired: "client certificate refused: it has expired since the connection opened",
} as const;
