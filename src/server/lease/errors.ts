// Domain errors of the lease service. They carry no transport types: the
// one table that turns them into wire codes is rpc/error-codes.ts.

import type { AuthFailure, LimitName, LossCause } from "../../protocol/errors.js";

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

/** A limit or quota was reached: `limit` names it, `max` is its value. */
export class ResourceExhaustedError extends Error {
  override readonly name = "ResourceExhaustedError";

  constructor(
    message: string,
    readonly limit: LimitName,
    readonly max: number,
  ) {
    super(message);
  }
}

/** The caller may not touch this account, session or method. */
export class PermissionDeniedError extends Error {
  override readonly name = "PermissionDeniedError";
}

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
