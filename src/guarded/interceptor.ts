// A Connect server interceptor that fences a downstream service (DESIGN §5).
// It reads the session and token from the request headers, runs the fence
// check in a transaction of the service's own database, and hands that
// transaction to the handler: writes made on it commit together with the
// check (S7), or not at all.

import type { DescMethod } from "@bufbuild/protobuf";
import { Code, ConnectError, createContextKey, type Interceptor } from "@connectrpc/connect";
import { toConnectError } from "../call/error-codes.js";
import { defaultLimits, type Limits } from "../lease/limits.js";
import { classifyDatabaseError } from "../postgres/database-errors.js";
import type { Sql } from "../postgres/pool.js";
import { fence, highestToken, type Transaction } from "./fence.js";
import { type FenceClaim, readFenceClaim } from "./headers.js";
import { checkWrite, type LiveCheck } from "./live-check.js";

/** What a fenced handler finds in `context.values.get(fencedCallKey)`. */
export interface FencedCall {
  claim: FenceClaim;
  /** The highest token seen for the session once this call's token passed. */
  highestToken: bigint;
  /**
   * The transaction the check ran in, holding the session's fence row lock.
   * Make the guarded writes on it; it commits when the handler returns and
   * rolls back when it throws.
   */
  tx: Transaction;
}

export const fencedCallKey = createContextKey<FencedCall | undefined>(undefined, {
  description: "leasehold fenced call",
});

export interface FencingInterceptorOptions {
  /** The service's database, where migrations/fence/0001_fence.sql is applied. */
  sql: Sql;
  /** Methods that need a token (default: every method). Reads may go unfenced. */
  fenced?: (method: DescMethod) => boolean;
  /** Live mode: also ask the lease server that the token is the valid lease's, for every call. */
  live?: LiveCheck;
  /**
   * The grant check (`createGrantCheck`): a call whose token would raise the
   * session's fence is confirmed with the lease server first. Without it (or
   * `live`) the interceptor trusts the token in the headers: whoever can
   * reach the service can raise a fence to any number.
   */
  granted?: LiveCheck;
  limits?: Pick<Limits, "maxIdLength">;
}

/**
 * Rejects calls without valid fencing headers (INVALID_ARGUMENT naming the
 * header) and calls with a stale token (ABORTED, ErrorInfo reason
 * STALE_FENCING_TOKEN with `highest_token`). Unary methods only: a streamed
 * response outlives the call, so its writes could not share the transaction.
 */
export function fencingInterceptor(options: FencingInterceptorOptions): Interceptor {
  const limits = options.limits ?? defaultLimits;
  return (next) => async (req) => {
    if (options.fenced && !options.fenced(req.method)) return next(req);
    try {
      if (req.method.methodKind !== "unary") {
        throw new ConnectError(
          `${req.method.parent.typeName}/${req.method.name} is not unary: the fencing interceptor cannot guard it`,
          Code.Unimplemented,
        );
      }
      const claim = readFenceClaim(req.header, limits);
      // Before the transaction: no row lock is held across a network call.
      await checkWrite(options, claim.key, claim.token, () => highestToken(options.sql, claim.key));
      return (await options.sql.begin(async (tx) => {
        const highestToken = await fence(tx, claim.key, claim.token);
        req.contextValues.set(fencedCallKey, { claim, highestToken, tx });
        try {
          return await next(req);
        } finally {
          req.contextValues.delete(fencedCallKey);
        }
      })) as Awaited<ReturnType<typeof next>>;
    } catch (error) {
      throw toConnectError(classifyDatabaseError(error));
    }
  };
}
