// Domain errors of the lease service. They carry no transport types: the
// one table that turns them into Connect codes is `error-codes.ts`.

/** Why a run does not hold its lease (the `reason` of LeaseNotHeldError). */
export type LossCause = "expired" | "released" | "taken_over" | "revoked" | "not_found";

/** A request field broke a rule. The message names the field and the rule. */
export class InvalidArgumentError extends Error {
  override readonly name = "InvalidArgumentError";
  constructor(
    readonly field: string,
    readonly rule: string,
  ) {
    super(`${field} ${rule}`);
  }
}

/** Renew (or a KeepAlive renewal) for a run that does not hold a valid lease. */
export class LeaseNotHeldError extends Error {
  override readonly name = "LeaseNotHeldError";
  constructor(readonly reason: LossCause) {
    super(`lease not held: ${reason.replace("_", " ")}`);
  }
}

/** A fencing token lower than the highest one seen for the session (S7). */
export class StaleFencingTokenError extends Error {
  override readonly name = "StaleFencingTokenError";
  constructor(
    readonly presented: bigint,
    readonly highest: bigint,
  ) {
    super(`fencing token ${presented} is stale: the highest token seen is ${highest}`);
  }
}

/** The named thing does not exist (a guarded store document, for one). */
export class NotFoundError extends Error {
  override readonly name = "NotFoundError";
}

/** A limit or quota was reached. */
export class ResourceExhaustedError extends Error {
  override readonly name = "ResourceExhaustedError";
}

/** The caller may not touch this account, session or method. */
export class PermissionDeniedError extends Error {
  override readonly name = "PermissionDeniedError";
}

/** Why credentials were refused: the `cause` of the UNAUTHENTICATED ErrorInfo. */
export type AuthFailure =
  | "missing"
  | "malformed"
  | "expired"
  | "bad_signature"
  | "algorithm"
  | "claims"
  | "account_claim";

/** The caller did not present valid credentials. */
export class UnauthenticatedError extends Error {
  override readonly name = "UnauthenticatedError";

  constructor(
    message: string,
    readonly failure: AuthFailure,
  ) {
    super(message);
  }
}

/**
 * The database could not decide: unreachable, restarting, or a row lock held
 * past lock_timeout (S8: fail fast, never hang). Safe to retry.
 */
export class DatabaseUnavailableError extends Error {
  override readonly name = "DatabaseUnavailableError";
  constructor(
    message: string,
    readonly sqlState?: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** A statement ran past statement_timeout. */
export class DatabaseTimeoutError extends Error {
  override readonly name = "DatabaseTimeoutError";
}

// SQLSTATEs (and postgres.js client codes) that mean "the database cannot
// answer right now", as opposed to a bug in a statement.
const unavailableStates = new Set([
  "55P03", // lock_not_available: lock_timeout (S8)
  "40001", // serialization_failure
  "40P01", // deadlock_detected
  "57P01", // admin_shutdown
  "57P02", // crash_shutdown
  "57P03", // cannot_connect_now
  "53300", // too_many_connections
  "25P03", // idle_in_transaction_session_timeout
]);
const clientCodes = new Set([
  "ECONNREFUSED",
  "ECONNRESET",
  "ETIMEDOUT",
  "EPIPE",
  "ENOTFOUND",
  "CONNECTION_CLOSED",
  "CONNECTION_ENDED",
  "CONNECTION_DESTROYED",
  "CONNECT_TIMEOUT",
]);

/**
 * Classifies an error thrown by postgres.js: database trouble becomes a
 * retryable domain error; anything else is returned unchanged (a bug).
 */
export function classifyDatabaseError(error: unknown): unknown {
  if (!(error instanceof Error)) return error;
  const code = (error as { code?: unknown }).code;
  if (typeof code !== "string") return error;
  if (code === "57014") {
    return new DatabaseTimeoutError("the database statement timed out", { cause: error });
  }
  if (code === "55P03") {
    return new DatabaseUnavailableError(
      "the session's lease row is locked by another transaction (lock_timeout); retry",
      code,
      { cause: error },
    );
  }
  if (unavailableStates.has(code) || code.startsWith("08") || clientCodes.has(code)) {
    return new DatabaseUnavailableError(`the database is unavailable (${code})`, code, {
      cause: error,
    });
  }
  return error;
}
