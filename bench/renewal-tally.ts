// What the KeepAlive load generator (bench/keepalive.ts) counts of the
// renewals it sends in its measured window: each must be answered, with the
// lease or `lost`, and one never answered fails the scenario
// (scenario-keepalive.ts). The server may leave a renewal unanswered (one
// its database could not decide: a row locked past lock_timeout, a batch
// statement past statement_timeout), and the same lease is often renewed
// again before the window ends (every round of a saturating load):
// each renewal sent is owed its own answer.

export interface RenewalTally {
  /** Lease `i`'s renewal was sent; `inWindow`: it counts. */
  sent(i: number, inWindow: boolean): void;
  /** Lease `i` was answered (its lease, or lost); true when the answer settles a renewal of the window. */
  answered(i: number): boolean;
  /** Renewals of the window still owed an answer. */
  readonly unanswered: number;
}

export function createRenewalTally(leases: number): RenewalTally {
  // Renewals of the window each lease is still owed an answer for. A flag
  // per lease (as before) let the answer to a lease's next renewal settle
  // one the server had left unanswered, so the scenario passed with it.
  const owed = new Uint16Array(leases);
  let outstanding = 0;
  return {
    sent(i, inWindow) {
      if (!inWindow) return;
      owed[i] = (owed[i] ?? 0) + 1;
      outstanding++;
    },
    answered(i) {
      if ((owed[i] ?? 0) === 0) return false;
      owed[i] = (owed[i] ?? 0) - 1;
      outstanding--;
      return true;
    },
    get unanswered() {
      return outstanding;
    },
  };
}
