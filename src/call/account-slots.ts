// Slots per account, on this instance: the call policy's Watch quota (DESIGN
// §7, open Watch streams per account). A full account is answered
// RESOURCE_EXHAUSTED with the limit's name, so a client knows which flag an
// operator would raise. Counting is per instance: N instances allow N times
// the number of watchers, which bounds each instance's memory, the point.

import { ResourceExhaustedError } from "../lease/errors.js";
import type { LimitName } from "../protocol/errors.js";

export interface AccountSlots {
  /** Takes a slot for `account`, or throws; call the returned function once to give it back. */
  enter(account: string): () => void;
  /** Slots in use by `account`. */
  used(account: string): number;
}

export function createAccountSlots(max: number, what: string, limit: LimitName): AccountSlots {
  const counts = new Map<string, number>();
  return {
    enter: (account) => {
      const n = counts.get(account) ?? 0;
      if (n >= max) {
        throw new ResourceExhaustedError(
          `the account already has ${n} ${what} open on this server, the limit (--${limit}) is ${max}`,
          limit,
          max,
        );
      }
      counts.set(account, n + 1);
      let left = false;
      return () => {
        if (left) return;
        left = true;
        const now = (counts.get(account) ?? 1) - 1;
        if (now === 0) counts.delete(account);
        else counts.set(account, now);
      };
    },
    used: (account) => counts.get(account) ?? 0,
  };
}
