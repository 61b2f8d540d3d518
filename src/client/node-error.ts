// Node and HTTP/2 failures of the gRPC transport's calls as ConnectErrors,
// with connect-node's codes (its node-error.ts), on purpose: failoverTransport
// and toLeaseholdError (transport.ts, errors.ts) tell a connection lost under
// a call (CANCELED from an RST_STREAM CANCEL, ABORTED from a reset socket,
// UNAVAILABLE for a refused connection) from a server's answer by them.

import { Code, ConnectError } from "@connectrpc/connect";

/** True when `error` or one of its causes carries Node's error code `code`. */
export function hasNodeCode(error: unknown, code: string): boolean {
  const seen = new Set<unknown>();
  for (let e: unknown = error; e instanceof Error && !seen.has(e); e = e.cause) {
    seen.add(e);
    if ((e as { code?: unknown }).code === code) return true;
  }
  return false;
}

/**
 * A Node error as a ConnectError, with connect-node's codes: a destroyed
 * stream or a reset connection is ABORTED, an unreachable or refused host
 * UNAVAILABLE, anything else INTERNAL. The Node error stays the cause.
 */
export function connectErrorFromNodeReason(reason: unknown): ConnectError {
  let code = Code.Internal;
  if (hasNodeCode(reason, "ERR_STREAM_WRITE_AFTER_END")) {
    code = Code.Aborted;
  } else if (
    hasNodeCode(reason, "ERR_STREAM_DESTROYED") ||
    hasNodeCode(reason, "ERR_HTTP2_INVALID_STREAM") ||
    hasNodeCode(reason, "ECONNRESET")
  ) {
    code = Code.Aborted;
  } else if (
    hasNodeCode(reason, "ETIMEDOUT") ||
    hasNodeCode(reason, "ENOTFOUND") ||
    hasNodeCode(reason, "EAI_AGAIN") ||
    hasNodeCode(reason, "ECONNREFUSED")
  ) {
    code = Code.Unavailable;
  }
  const ce = ConnectError.from(reason, code);
  if (ce !== reason) ce.cause = reason;
  return ce;
}

const h2CodeNames: Record<number, string> = {
  1: "PROTOCOL_ERROR",
  2: "INTERNAL_ERROR",
  3: "FLOW_CONTROL_ERROR",
  4: "SETTINGS_TIMEOUT",
  6: "FRAME_SIZE_ERROR",
  7: "REFUSED_STREAM",
  8: "CANCEL",
  9: "COMPRESSION_ERROR",
  10: "CONNECT_ERROR",
  11: "ENHANCE_YOUR_CALM",
  12: "INADEQUATE_SECURITY",
  13: "HTTP_1_1_REQUIRED",
};

const h2Codes: Record<number, Code> = {
  1: Code.Internal,
  2: Code.Internal,
  3: Code.Internal,
  4: Code.Internal,
  6: Code.Internal,
  7: Code.Unavailable,
  8: Code.Canceled,
  9: Code.Internal,
  10: Code.Internal,
  11: Code.ResourceExhausted,
  12: Code.PermissionDenied,
  13: Code.PermissionDenied,
};

/** connect-node's code for an RST_STREAM code; NO_ERROR and STREAM_CLOSED map to none. */
export function connectErrorFromH2ResetCode(rstCode: number): ConnectError | undefined {
  const code = h2Codes[rstCode];
  if (code === undefined) return undefined;
  return new ConnectError(
    `http/2 stream closed with error code ${h2CodeNames[rstCode]} (0x${rstCode.toString(16)})`,
    code,
  );
}
