// Live mode (DESIGN §5): besides the monotonic fence, a resource asks the
// lease server whether the token is the one of the session's valid lease,
// so a holder whose lease expired is refused even when nobody replaced it.

import { type Client, Code, ConnectError } from "@connectrpc/connect";
import type { LeaseService } from "../gen/leasehold/v1/lease_pb.js";
import { LeaseNotHeldError, StaleFencingTokenError } from "../server/lease/errors.js";
import type { SessionKey } from "../server/lease/types.js";

/** Resolves when `token` is the valid lease's; throws a domain error otherwise. */
export type LiveCheck = (key: SessionKey, token: bigint) => Promise<void>;

export interface LiveCheckOptions {
  /** Deadline of each CheckFence call. */
  timeoutMs: number;
}

export function createLiveCheck(
  leases: Client<typeof LeaseService>,
  options: LiveCheckOptions,
): LiveCheck {
  return async (key, token) => {
    let answer: { current: boolean; highestToken: bigint };
    try {
      answer = await leases.checkFence(
        { key, fencingToken: token },
        { timeoutMs: options.timeoutMs },
      );
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
    if (answer.current) return;
    // A newer grant exists: the same answer monotonic mode gives.
    if (answer.highestToken > token) throw new StaleFencingTokenError(token, answer.highestToken);
    // The token is the newest grant but its lease is no longer valid: the
    // holder expired (or released, or was revoked) and nobody took over.
    // CheckFence cannot tell these apart; expiry is the case a late writer
    // is in. A token above every grant was never granted.
    throw new LeaseNotHeldError(answer.highestToken === token ? "expired" : "not_found");
  };
}
