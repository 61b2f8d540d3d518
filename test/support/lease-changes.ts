// A committed lease change built in memory, for the tests of the change path
// that need no database (the payload codec, the watch order guard).

import type { ChangeType, LeaseChange } from "../../src/lease/lease-change.js";

/** A change of session acct/s by the run with fencing token `token`. */
export function leaseChange(
  type: ChangeType,
  token: bigint,
  extra: Partial<LeaseChange> = {},
): LeaseChange {
  return {
    type,
    accountId: "acct",
    sessionId: "s",
    runId: `00000000-0000-4000-8000-${token.toString().padStart(12, "0")}`,
    fencingToken: token,
    holder: "desktop",
    atUs: 1_700_000_000_000_000n + token,
    lease: undefined,
    reason: "",
    requesterHolder: "",
    eventId: token,
    ...extra,
  };
}
