// Domain errors of the lease service. They carry no transport types: the
// one table that turns them into wire codes is rpc/error-codes.ts.

import type { AuthFailure, LimitName, NotHeldCause } from "../protocol/errors.js";

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

/**
 * Renew (or a KeepAlive renewal) for a run that does not hold a valid lease,
 * or a same-run Acquire of a lease that ended (S4: a run whose lease ended
 * never holds the session again).
 */
export class LeaseNotHeldError extends Error {
  override readonly name = "LeaseNotHeldError";
  constructor(
    readonly reason: NotHeldCause,
    message = `lease not held: ${reason === "never_held" ? "never held by this run" : reason.replace("_", " ")}`,
  ) {
    super(message);
  }
}

/** The answer to a same-run Acquire of the run's own ended lease. */
export function endedLeaseNotReacquired(
  runId: string,
  cause: "released" | "revoked" | "expired",
): LeaseNotHeldError {
  return new LeaseNotHeldError(
    cause,
    `lease not held: run ${runId} ${cause === "expired" ? "let its lease expire" : `had its lease ${cause}`}; a run never holds a session again after its lease ended: acquire with a new run_id`,
  );
}

/**
 * The keeper named does not keep leases (K1; docs/keepers.md): it expired,
 * was closed or revoked, or does not exist for this account.
 */
export class KeeperNotHeldError extends Error {
  override readonly name = "KeeperNotHeldError";
  constructor(
    readonly keeperId: string,
    readonly ended: "expired" | "closed" | "revoked" | "not_found",
  ) {
    super(
      `keeper ${keeperId} is not held: ${ended === "not_found" ? "no such keeper in this account" : ended}; open a new keeper`,
    );
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
