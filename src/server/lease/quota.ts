// The per-account quota of held leases (DESIGN §7), as a decorator of the
// lease store: every grant attempt, waiting or not, passes through it.
//
// The count is a separate statement before the acquire, on the primary
// key's account prefix, not a condition inside the acquire statement. Both
// read a READ COMMITTED snapshot that cannot see grants still being
// committed, so both let the same overshoot through: at most one extra
// lease per acquire of that account running concurrently with it, on any
// instance (bounded by the instances' pool sizes). An exact quota would need
// every acquire of an account to queue behind one lock, coupling sessions
// that S8 keeps independent; and the acquire statement that S1–S6 rest on
// stays unchanged. The count excludes the requested session, so an
// idempotent retry or a takeover at the quota still succeeds. Its cost is
// the account's rows in the primary key up to the quota-th valid one,
// tombstones included: small for accounts with few sessions, and the reason
// the quota can be turned off (0) for accounts that cycle through many.

import { ResourceExhaustedError } from "./errors.js";
import type { LeaseCounts, LeaseStore } from "./types.js";

export function withLeaseQuota(
  store: LeaseStore,
  counts: LeaseCounts,
  maxLeasesPerAccount: number,
  onReject: () => void = () => {},
): LeaseStore {
  if (maxLeasesPerAccount <= 0) return store;
  return {
    ...store,
    acquire: async (input) => {
      const held = await counts.heldByAccount(
        input.accountId,
        input.sessionId,
        maxLeasesPerAccount,
      );
      if (held >= maxLeasesPerAccount) {
        onReject();
        throw new ResourceExhaustedError(
          `the account holds ${maxLeasesPerAccount} leases, the most its quota (--max-leases-per-account) allows: release one first`,
        );
      }
      return store.acquire(input);
    },
  };
}
