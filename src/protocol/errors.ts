// The error vocabulary of the wire, defined once for the server, the client
// library, the guarded store and the web page: the ErrorInfo domain and
// reasons Leasehold sends, and the values of their `cause` metadata. Changing
// a value here changes what clients of every language read (docs/client.md).

/** The ErrorInfo domain of every error detail Leasehold sends. */
export const errorDomain = "leasehold.dev";

/** ErrorInfo reasons (google.rpc.ErrorInfo.reason), by the condition they name. */
export const ErrorReason = {
  /** FAILED_PRECONDITION: the run does not hold a valid lease; metadata `cause` is a LossCause. */
  leaseNotHeld: "LEASE_NOT_HELD",
  /** ABORTED: a fencing token below the highest seen; metadata `presented_token`, `highest_token`. */
  staleFencingToken: "STALE_FENCING_TOKEN",
  /** INVALID_ARGUMENT: metadata `field` names the request field (also in BadRequest). */
  invalidArgument: "INVALID_ARGUMENT",
  /**
   * UNAVAILABLE: the database could not decide; metadata `sql_state` when it
   * said why. Also the status of a KeepAlive renewal answered `undecided`
   * (sql_state 57014 statement timeout, 55P03 lock timeout).
   */
  databaseUnavailable: "DATABASE_UNAVAILABLE",
  /** UNAUTHENTICATED: metadata `cause` is an AuthFailure. */
  unauthenticated: "UNAUTHENTICATED",
  /**
   * RESOURCE_EXHAUSTED: a bound of the server was reached; metadata `limit`
   * names it (a LimitName) and `max` is its value.
   */
  limitExceeded: "LIMIT_EXCEEDED",
  /**
   * FAILED_PRECONDITION: the keeper named is not valid (docs/keepers.md);
   * metadata `cause` is expired, closed, revoked or not_found.
   */
  keeperNotHeld: "KEEPER_NOT_HELD",
} as const;

export type ErrorReason = (typeof ErrorReason)[keyof typeof ErrorReason];

/** Metadata keys of the ErrorInfo details above. */
export const ErrorMetadata = {
  cause: "cause",
  field: "field",
  presentedToken: "presented_token",
  highestToken: "highest_token",
  sqlState: "sql_state",
  limit: "limit",
  max: "max",
} as const;

/**
 * The bounds a LIMIT_EXCEEDED names: the server flag that sets each, where
 * one does. A client may adapt to one (the client library opens another
 * KeepAlive stream when a stream carries `max-leases-per-stream` leases).
 */
export const LimitName = {
  leasesPerStream: "max-leases-per-stream",
  watchersPerAccount: "max-watchers-per-account",
  leasesPerAccount: "max-leases-per-account",
  /** Open leases on one keeper. */
  leasesPerKeeper: "max-leases-per-keeper",
  /** Open keepers of one account. */
  keepersPerAccount: "max-keepers-per-account",
  /** Requests one Keep stream has in flight. */
  keeperOpsInFlight: "max-keeper-ops-in-flight",
  /** Answers a KeepAlive stream's client has not read (no flag). */
  streamBacklog: "stream-backlog",
  /** Documents of one session in the guarded store (no flag). */
  documentsPerSession: "documents-per-session",
} as const;
export type LimitName = (typeof LimitName)[keyof typeof LimitName];

/**
 * Why a run does not hold its lease: the `cause` of LEASE_NOT_HELD, and (as
 * the LossReason enum of lease.proto) the reason of a KeepAlive `lost`.
 */
export const lossCauses = ["expired", "released", "taken_over", "revoked", "not_found"] as const;
export type LossCause = (typeof lossCauses)[number];

/** Narrows a `cause` read off the wire; undefined for a value this release does not know. */
export function asLossCause(text: string | undefined): LossCause | undefined {
  return lossCauses.find((c) => c === text);
}

/**
 * The `cause` of LEASE_NOT_HELD: a LossCause, or, from unary Renew only,
 * `never_held`: the session's lease is another run's and this run never
 * held it (where `taken_over` says this run held it before the other).
 * KeepAlive's loss reasons stay the LossCause values.
 */
export const notHeldCauses = [...lossCauses, "never_held"] as const;
export type NotHeldCause = (typeof notHeldCauses)[number];

/** Narrows a LEASE_NOT_HELD `cause` read off the wire; undefined for a value this release does not know. */
export function asNotHeldCause(text: string | undefined): NotHeldCause | undefined {
  return notHeldCauses.find((c) => c === text);
}

/**
 * Why credentials were refused: the `cause` of UNAUTHENTICATED. No token, not
 * a JWT, expired (time to fetch a new one), a signature the server's keys do
 * not verify, an algorithm it does not accept, a failed `iss`/`aud`/`nbf`
 * check, or no valid account claim. For client certificates (mutual TLS):
 * none presented where one is required, expired, not yet valid, not issued
 * by the configured CA bundle, not for client authentication, otherwise
 * unusable; and a bearer token whose account is not the certificate's.
 */
export const authFailures = [
  "missing",
  "malformed",
  "expired",
  "bad_signature",
  "algorithm",
  "claims",
  "account_claim",
  "certificate_missing",
  "certificate_expired",
  "certificate_not_yet_valid",
  "certificate_untrusted",
  "certificate_usage",
  "certificate_invalid",
  "identity_conflict",
] as const;
export type AuthFailure = (typeof authFailures)[number];

/** Narrows a `cause` read off the wire; undefined for a value this release does not know. */
export function asAuthFailure(text: string | undefined): AuthFailure | undefined {
  return authFailures.find((f) => f === text);
}
