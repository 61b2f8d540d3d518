// Typed errors of the client. Every error the server sends arrives as a
// ConnectError; `toLeaseholdError` turns it into one of these classes by its
// code and ErrorInfo reason, and keeps the ConnectError as `cause` so nothing
// the server said is lost.

import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema, ErrorInfoSchema } from "../gen/google/rpc/error_details_pb.js";
import type { Lease } from "../gen/leasehold/v1/lease_pb.js";
import {
  type AuthFailure,
  asAuthFailure,
  asNotHeldCause,
  ErrorMetadata,
  ErrorReason,
  errorDomain,
  type LossCause,
  type NotHeldCause,
} from "../protocol/errors.js";

export {
  type AuthFailure,
  errorDomain,
  type LossCause,
  type NotHeldCause,
} from "../protocol/errors.js";

/**
 * Why `runExclusive` aborted its work's signal: a cause the server reported,
 * `"deadline"` when the local deadline passed without a confirmed renewal,
 * `"token_expired"` when the server ended the KeepAlive stream because the
 * client's fixed token expired (a fixed token cannot be renewed; the cause
 * is an UnauthenticatedError with failure `expired`; a token function
 * avoids it), or `"renewal_failed"` when the server refused to renew for
 * another reason.
 */
export type LeaseLossReason = LossCause | "deadline" | "token_expired" | "renewal_failed";

/**
 * Base class of every error this client throws. `code` is the gRPC/Connect
 * code (`Code` of @connectrpc/connect); `cause` is the original error.
 */
export class LeaseholdError extends Error {
  override readonly name: string = "LeaseholdError";
  /** The gRPC/Connect code of the failure. */
  readonly code: Code;
  /** The ErrorInfo reason the server sent, if any (e.g. `LEASE_NOT_HELD`). */
  readonly reason: string | undefined;
  /** The ErrorInfo metadata the server sent (empty when none). */
  readonly metadata: Readonly<Record<string, string>>;

  constructor(
    message: string,
    code: Code,
    options: { cause?: unknown; reason?: string; metadata?: Record<string, string> } = {},
  ) {
    super(message, { cause: options.cause });
    this.code = code;
    this.reason = options.reason;
    this.metadata = options.metadata ?? {};
  }
}

/** A request field broke a rule (INVALID_ARGUMENT); `field` names it. */
export class InvalidArgumentError extends LeaseholdError {
  override readonly name = "InvalidArgumentError";
  /** The request field the server rejected, e.g. `ttl` or `key.session_id`. */
  readonly field: string;
  /** The rule it broke, e.g. `must be between 1s and 1h, got 0s`. */
  readonly rule: string;

  constructor(message: string, field: string, rule: string, options: { cause?: unknown } = {}) {
    super(message, Code.InvalidArgument, { ...options, reason: ErrorReason.invalidArgument });
    this.field = field;
    this.rule = rule;
  }
}

/**
 * Renew (or a KeepAlive renewal) for a run that does not hold a valid lease,
 * or Acquire by a run whose own lease on that session ended: a run never
 * holds a session again after its lease was released, revoked or let expire
 * (FAILED_PRECONDITION, reason LEASE_NOT_HELD). `lossCause` says why:
 * `never_held` (from Renew) when the run never held the session.
 */
export class LeaseNotHeldError extends LeaseholdError {
  override readonly name = "LeaseNotHeldError";
  /** Why the run does not hold the lease; undefined when the server did not say. */
  readonly lossCause: NotHeldCause | undefined;

  constructor(
    message: string,
    lossCause: NotHeldCause | undefined,
    options: { cause?: unknown } = {},
  ) {
    super(message, Code.FailedPrecondition, {
      ...options,
      reason: ErrorReason.leaseNotHeld,
      metadata: lossCause ? { [ErrorMetadata.cause]: lossCause } : {},
    });
    this.lossCause = lossCause;
  }
}

/**
 * A guarded resource refused a fencing token lower than the highest it has
 * seen for the session (ABORTED, reason STALE_FENCING_TOKEN): a newer run
 * holds, or held, the session. The write did not happen; do not retry it.
 */
export class StaleFencingTokenError extends LeaseholdError {
  override readonly name = "StaleFencingTokenError";
  /** The token that was presented, when the server said. */
  readonly presentedToken: bigint | undefined;
  /** The highest token the resource has seen for the session, when the server said. */
  readonly highestToken: bigint | undefined;

  constructor(
    message: string,
    presentedToken: bigint | undefined,
    highestToken: bigint | undefined,
    options: { cause?: unknown } = {},
  ) {
    super(message, Code.Aborted, { ...options, reason: ErrorReason.staleFencingToken });
    this.presentedToken = presentedToken;
    this.highestToken = highestToken;
  }
}

/**
 * The session is held by another run (`acquired = false`). `current` is the
 * lease that blocked the grant, so a UI can say "running on desktop, 12 s left";
 * `lockDelayUntil` says until when a lock-delay keeps the key from everyone.
 */
export class NotAcquiredError extends LeaseholdError {
  override readonly name: string = "NotAcquiredError";
  /** The valid lease that blocked the grant, when the server sent it. */
  readonly current: Lease | undefined;
  /**
   * When no valid lease blocked the grant but a lock-delay did (the key's
   * last lease was on a keeper that expired, K2): when the delay ends, on
   * the database clock. Undefined otherwise.
   */
  readonly lockDelayUntil: Date | undefined;

  constructor(
    message: string,
    current: Lease | undefined,
    options: { cause?: unknown; lockDelayUntil?: Date | undefined } = {},
  ) {
    super(message, Code.FailedPrecondition, { cause: options.cause });
    this.current = current;
    this.lockDelayUntil = options.lockDelayUntil;
  }

  /** The holder label of the blocking lease ("" when it has none or is unknown). */
  get holder(): string {
    return this.current?.holder ?? "";
  }
}

/**
 * A grant whose response arrived after its own local deadline (L2): by the
 * time the client could use it, the lease may already have expired on the
 * server. It counts as not acquired, and the client released it.
 */
export class LateGrantError extends NotAcquiredError {
  override readonly name = "LateGrantError";
  /** The lease the late response granted (already released by the client). */
  readonly lateLease: Lease | undefined;
  /** How long the response took, measured on the monotonic clock, in ms. */
  readonly elapsedMs: number;

  constructor(lateLease: Lease | undefined, elapsedMs: number) {
    super(
      `the grant arrived ${Math.round(elapsedMs)}ms after the request was sent, past its local deadline; it was released`,
      undefined,
    );
    this.lateLease = lateLease;
    this.elapsedMs = elapsedMs;
  }
}

/**
 * The reason `runExclusive` gives when it aborts its work's signal: the run
 * lost (or can no longer vouch for) its lease. `lossReason` says which.
 */
export class LeaseLostError extends LeaseholdError {
  override readonly name = "LeaseLostError";
  /** Why the lease was lost. */
  readonly lossReason: LeaseLossReason;

  constructor(message: string, lossReason: LeaseLossReason, options: { cause?: unknown } = {}) {
    super(message, Code.FailedPrecondition, options);
    this.lossReason = lossReason;
  }
}

/** The server did not accept the credentials (UNAUTHENTICATED). */
export class UnauthenticatedError extends LeaseholdError {
  override readonly name = "UnauthenticatedError";

  /** Why, as the server named it; undefined when it did not say. */
  get failure(): AuthFailure | undefined {
    return asAuthFailure(this.metadata[ErrorMetadata.cause]);
  }
}

/** The caller may not touch this account, session or method (PERMISSION_DENIED). */
export class PermissionDeniedError extends LeaseholdError {
  override readonly name = "PermissionDeniedError";
}

/** A limit or quota was reached (RESOURCE_EXHAUSTED). */
export class ResourceExhaustedError extends LeaseholdError {
  override readonly name = "ResourceExhaustedError";
}

/**
 * No configured server could answer, or the database behind it could not
 * (UNAVAILABLE). Safe to retry: every call the client makes is idempotent.
 */
export class UnavailableError extends LeaseholdError {
  override readonly name = "UnavailableError";
}

/** The call or the database statement ran out of time (DEADLINE_EXCEEDED). */
export class DeadlineExceededError extends LeaseholdError {
  override readonly name = "DeadlineExceededError";
}

/** The call was cancelled by the caller's signal (CANCELED). */
export class CanceledError extends LeaseholdError {
  override readonly name = "CanceledError";
}

function parseBigInt(text: string | undefined): bigint | undefined {
  if (text === undefined || !/^-?\d+$/.test(text)) return undefined;
  return BigInt(text);
}

/**
 * True for a call cut by its connection (a reset or destroyed socket), which
 * connect-node reports as ABORTED. No server sent it: a server's ABORTED
 * carries an ErrorInfo and no Node system error as its cause. It must not
 * read as a stale fencing token; it is as retryable as UNAVAILABLE.
 */
export function brokenConnection(ce: ConnectError): boolean {
  if (ce.code !== Code.Aborted || ce.details.length > 0) return false;
  const cause: unknown = ce.cause;
  return cause instanceof Error && typeof (cause as { code?: unknown }).code === "string";
}

/**
 * Converts any error from a call into a typed LeaseholdError (errors that
 * already are one pass through). The original error is kept as `cause`.
 */
export function toLeaseholdError(error: unknown): LeaseholdError {
  if (error instanceof LeaseholdError) return error;
  const ce = ConnectError.from(error);
  // A typed error thrown on the client side (by an interceptor) and wrapped
  // by Connect on its way out.
  if (ce.cause instanceof LeaseholdError) return ce.cause;
  const info = ce
    .findDetails(ErrorInfoSchema)
    .find((d) => d.domain === errorDomain || d.domain === "");
  const reason = info?.reason;
  const metadata = info?.metadata ?? {};
  const message = ce.rawMessage || ce.message;
  const options = { cause: error, reason, metadata };
  if (reason === ErrorReason.leaseNotHeld || (ce.code === Code.FailedPrecondition && !reason)) {
    return new LeaseNotHeldError(message, asNotHeldCause(metadata[ErrorMetadata.cause]), {
      cause: error,
    });
  }
  if (brokenConnection(ce)) return new UnavailableError(message, Code.Unavailable, options);
  if (reason === ErrorReason.staleFencingToken || ce.code === Code.Aborted) {
    return new StaleFencingTokenError(
      message,
      parseBigInt(metadata[ErrorMetadata.presentedToken]),
      parseBigInt(metadata[ErrorMetadata.highestToken]),
      { cause: error },
    );
  }
  switch (ce.code) {
    case Code.InvalidArgument: {
      const violation = ce.findDetails(BadRequestSchema)[0]?.fieldViolations[0];
      const field = violation?.field ?? metadata[ErrorMetadata.field] ?? "";
      return new InvalidArgumentError(message, field, violation?.description ?? message, {
        cause: error,
      });
    }
    case Code.Unauthenticated:
      return new UnauthenticatedError(message, ce.code, options);
    case Code.PermissionDenied:
      return new PermissionDeniedError(message, ce.code, options);
    case Code.ResourceExhausted:
      return new ResourceExhaustedError(message, ce.code, options);
    case Code.Unavailable:
      return new UnavailableError(message, ce.code, options);
    case Code.DeadlineExceeded:
      return new DeadlineExceededError(message, ce.code, options);
    case Code.Canceled:
      return new CanceledError(message, ce.code, options);
    default:
      return new LeaseholdError(message, ce.code, options);
  }
}

/**
 * A google.rpc.Status answered inside a stream (a refused Keep request, an
 * undecided KeepAlive renewal) as the typed error a unary call would throw.
 */
export function errorOfStatus(status: {
  code: number;
  message: string;
  details: { typeUrl: string; value: Uint8Array }[];
}): LeaseholdError {
  const ce = new ConnectError(status.message, status.code as Code);
  for (const any of status.details) {
    ce.details.push({
      type: any.typeUrl.slice(any.typeUrl.lastIndexOf("/") + 1),
      value: any.value,
    });
  }
  return toLeaseholdError(ce);
}
