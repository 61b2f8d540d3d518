// What a resource asks the lease server before a write (DESIGN §5, §7), both
// through CheckFence:
// - the grant check: a write that would raise a session's fence must present
//   the newest token the lease server has granted for that session, so no
//   caller can push the fence past every grant (a Put with 2^63−1 would lock
//   every real run out of the session for good);
// - live mode: every write's token must be the one of the session's valid
//   lease, so a holder whose lease expired is refused even when nobody
//   replaced it.

import { type Client, Code, ConnectError } from "@connectrpc/connect";
import type { LeaseService } from "../gen/leasehold/v1/lease_pb.js";
import { LeaseNotHeldError, StaleFencingTokenError } from "../lease/errors.js";
import type { SessionKey } from "../lease/types.js";

/** Resolves when the lease server confirms `token` for `key`; throws a domain error otherwise. */
export type LiveCheck = (key: SessionKey, token: bigint) => Promise<void>;

export interface LiveCheckOptions {
  /** Deadline of each CheckFence call. */
  timeoutMs: number;
}

/** The lease server's CheckFence answer; UNAVAILABLE when it cannot be had. */
async function checkFence(
  leases: Client<typeof LeaseService>,
  options: LiveCheckOptions,
  key: SessionKey,
  token: bigint,
): Promise<{ current: boolean; highestToken: bigint }> {
  try {
    return await leases.checkFence({ key, fencingToken: token }, { timeoutMs: options.timeoutMs });
  } catch (error) {
    // Whatever the lease server said, this resource could not confirm the
    // token; the caller may retry. Its own codes (e.g. UNAUTHENTICATED
    // between the two servers) are not the caller's doing.
    const cause = ConnectError.from(error);
    throw new ConnectError(
      `the lease server could not confirm the fencing token: ${cause.message}`,
      Code.Unavailable,
      undefined,
      undefined,
      cause,
    );
  }
}

/** Live mode: `token` must be the valid lease's. */
export function createLiveCheck(
  leases: Client<typeof LeaseService>,
  options: LiveCheckOptions,
): LiveCheck {
  return async (key, token) => {
    const answer = await checkFence(leases, options, key, token);
    if (answer.current) return;
    // A newer grant exists: the same answer monotonic mode gives.
    if (answer.highestToken > token) throw new StaleFencingTokenError(token, answer.highestToken);
    // The token is the newest grant but its lease is no longer valid: the
    // holder expired (or released, or was revoked) and nobody took over.
    // CheckFence cannot tell these apart; expiry is the case a late writer
    // is in. A token above every grant was never granted.
    if (answer.highestToken === token) throw new LeaseNotHeldError("expired");
    throw neverGranted(key, token, answer.highestToken);
  };
}

/**
 * The grant check: `token` must be the newest token granted for `key`,
 * valid lease or not (monotonic mode does not ask for liveness). A token
 * above every grant was never granted (LEASE_NOT_HELD, not_found); one below
 * the newest grant belongs to a replaced run (STALE_FENCING_TOKEN).
 */
export function createGrantCheck(
  leases: Client<typeof LeaseService>,
  options: LiveCheckOptions,
): LiveCheck {
  return async (key, token) => {
    const answer = await checkFence(leases, options, key, token);
    if (answer.highestToken === token) return;
    if (answer.highestToken > token) throw new StaleFencingTokenError(token, answer.highestToken);
    throw neverGranted(key, token, answer.highestToken);
  };
}

/**
 * A token above every grant of the session: LEASE_NOT_HELD with cause
 * not_found on the wire, in words that say what happened (a bare "not
 * found" read as a missing document).
 */
function neverGranted(
  key: { accountId: string; sessionId: string },
  token: bigint,
  highest: bigint,
): LeaseNotHeldError {
  return new LeaseNotHeldError(
    "not_found",
    `lease not held: fencing token ${token} was never granted for ${key.accountId}/${key.sessionId} ` +
      `(${highest === 0n ? "no token was ever granted for it" : `the newest grant is ${highest}`}); ` +
      "write with the token your Acquire returned",
  );
}

/** The checks a resource runs before its fenced write transaction. */
export interface WriteChecks {
  /** Live mode: asked for every write. */
  live?: LiveCheck;
  /** Asked for a write whose token is above the highest this resource has seen. */
  granted?: LiveCheck;
}

/**
 * Runs the checks for a write of `token`, outside any transaction (no row
 * lock is held across a call to the lease server). A write at or below the
 * highest token seen cannot raise the fence and needs no grant check, so it
 * proceeds while the lease server is unreachable. Sound because a fence only
 * ever rises: the transaction's fence then accepts this token only if the
 * fence has not passed it meanwhile, and never raises it past a token that
 * was checked here.
 */
export async function checkWrite(
  checks: WriteChecks,
  key: SessionKey,
  token: bigint,
  highestSeen: () => Promise<bigint>,
): Promise<void> {
  if (checks.live) return checks.live(key, token);
  if (checks.granted && token > (await highestSeen())) await checks.granted(key, token);
}
