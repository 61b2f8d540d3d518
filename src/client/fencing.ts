// Fencing headers (DESIGN §5): calls made on behalf of a lease carry its
// fencing token and session key, so a guarded service can refuse a stale run
// without extra code in the caller. A run whose lease is lost stops
// presenting itself as the holder (L2): its calls fail before being sent.

import { Code, ConnectError, createContextKey, type Interceptor } from "@connectrpc/connect";
import { fencingHeaderNames } from "../protocol/headers.js";
import { CanceledError, LeaseholdError, LeaseLostError } from "./errors.js";

export { fencingHeaderNames } from "../protocol/headers.js";

/** What a call made on behalf of a lease presents. */
export interface FencingSource {
  /** The session the lease is for. */
  readonly key: { readonly accountId: string; readonly sessionId: string };
  /** The lease's fencing token. */
  readonly fencingToken: bigint;
  /** Aborted when the lease is lost; calls then fail instead of being sent. */
  readonly signal?: AbortSignal;
  /**
   * Throws when calls may no longer be made for this lease; called before
   * every call and by `fencingHeaders`, which fall back to `signal` when it
   * is absent. `runExclusive`'s context reads its local deadline from the
   * monotonic clock here, so a call made after the deadline passed is
   * refused even when the timer that aborts `signal` has not run yet (an
   * event loop blocked past it).
   */
  throwIfLost?(): void;
}

/**
 * Per-call context value naming the lease a call is made for. `runExclusive`
 * sets it in `ctx.callOptions()`; `fencingInterceptor()` reads it.
 */
export const fencingContextKey = createContextKey<FencingSource | undefined>(undefined, {
  description: "leasehold fencing source",
});

/**
 * The error that says why a call may not present a lease whose signal has
 * aborted: the signal's LeaseLostError, or a CanceledError when the run was
 * cancelled by its caller.
 */
export function refusalOf(reason: unknown): LeaseLostError | CanceledError {
  if (reason instanceof LeaseLostError) return reason;
  return new CanceledError("the run was cancelled; the call was not sent", Code.Canceled, {
    cause: reason,
  });
}

/** Throws when `source` may no longer be presented (L2), see `FencingSource.throwIfLost`. */
function throwIfEnded(source: FencingSource): void {
  source.throwIfLost?.();
  if (source.signal?.aborted) throw refusalOf(source.signal.reason);
}

/**
 * The three fencing headers for a lease. Throws instead once the lease can
 * no longer be presented (L2: its signal aborted, or `throwIfLost` throws):
 * a lost lease has no headers.
 */
export function fencingHeaders(source: FencingSource): Headers {
  throwIfEnded(source);
  return new Headers({
    [fencingHeaderNames.fencingToken]: source.fencingToken.toString(),
    [fencingHeaderNames.accountId]: source.key.accountId,
    [fencingHeaderNames.sessionId]: source.key.sessionId,
  });
}

/**
 * A client interceptor that adds the fencing headers to every call made on
 * behalf of a lease. The lease comes from the call's context values
 * (`fencingContextKey`, as set by `ctx.callOptions()`), else from `bound`
 * (a fixed source or a function returning the current one). Calls with
 * neither pass through untouched. A call for a lease that has ended is never
 * sent: one whose signal has aborted, or (a `runExclusive` context) whose
 * local deadline has passed on the monotonic clock, read as the call is
 * made. It fails with a ConnectError whose cause is the run's
 * LeaseLostError (or a CanceledError when the run was cancelled by its
 * caller); `toLeaseholdError` returns that cause.
 */
export function fencingInterceptor(
  bound?: FencingSource | (() => FencingSource | undefined),
): Interceptor {
  return (next) => async (req) => {
    const source =
      req.contextValues.get(fencingContextKey) ?? (typeof bound === "function" ? bound() : bound);
    if (source === undefined) return next(req);
    let headers: Headers;
    try {
      headers = fencingHeaders(source);
    } catch (error) {
      if (!(error instanceof LeaseholdError)) throw error;
      // Connect wraps whatever an interceptor throws in a ConnectError; give
      // it the right code, and keep the typed error as its cause
      // (toLeaseholdError unwraps it).
      throw new ConnectError(error.message, error.code, undefined, undefined, error);
    }
    for (const [name, value] of headers) req.header.set(name, value);
    return next(req);
  };
}
