// A loss cause as the KeepAlive stream's `lost.reason` carries it: the
// LossReason enum of lease.proto, one value per LossCause.

import { LossReason } from "../gen/leasehold/v1/lease_pb.js";
import type { LossCause } from "./errors.js";

const reasons: Record<LossCause, LossReason> = {
  expired: LossReason.EXPIRED,
  released: LossReason.RELEASED,
  taken_over: LossReason.TAKEN_OVER,
  revoked: LossReason.REVOKED,
  not_found: LossReason.NOT_FOUND,
};

export function lossReasonFromCause(cause: LossCause): LossReason {
  return reasons[cause];
}

/** Undefined for LOSS_REASON_UNSPECIFIED or a value this release does not know. */
export function lossCauseFromReason(reason: LossReason): LossCause | undefined {
  for (const [cause, r] of Object.entries(reasons)) if (r === reason) return cause as LossCause;
  return undefined;
}
