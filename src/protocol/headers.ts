// Request and response headers with a meaning in Leasehold, defined once for
// the server, the client library, the guarded store and the web page.

/**
 * The headers that carry a fencing token to a downstream service (DESIGN §5).
 * The client library sets them; a guarded service's fencing interceptor reads
 * them, and names them as the field of every error about them.
 */
export const fencingHeaderNames = {
  fencingToken: "leasehold-fencing-token",
  accountId: "leasehold-account-id",
  sessionId: "leasehold-session-id",
} as const;

/** Correlates a call with the server's log line; echoed on every answer. */
export const requestIdHeader = "x-request-id";
