// Errors of postgres.js, classified: database trouble (unreachable, lock
// timeout, statement timeout) becomes a retryable domain error, anything
// else is a bug and passes unchanged. Every module that runs SQL sends its
// errors through here.

import { DatabaseTimeoutError, DatabaseUnavailableError } from "../lease/errors.js";

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
  "25006", // read_only_sql_transaction: connected to a standby, or to a primary being demoted
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
