// The KeepAlive load generator's count of unanswered renewals: a renewal the
// server never answers must fail the scenario (bench/scenario-keepalive.ts),
// also when the same lease is renewed again, and answered, in the window.
// No database or sockets: this is the load generator's bookkeeping alone.

import { describe, expect, it } from "vitest";
import { createRenewalTally } from "../bench/renewal-tally.js";

describe("benchmark KeepAlive renewal tally", () => {
  it("a renewal left unanswered stays unanswered when a later renewal of the same lease is answered", () => {
    const tally = createRenewalTally(2);
    tally.sent(0, true); // the server never answers this one (undecided)
    tally.sent(1, true);
    expect(tally.answered(1)).toBe(true);
    tally.sent(0, true); // the next round of lease 0, answered
    expect(tally.answered(0)).toBe(true);
    expect(tally.unanswered).toBe(1);
  });

  it("every renewal answered: none unanswered, and answers to renewals sent before the window do not count", () => {
    const tally = createRenewalTally(2);
    tally.sent(1, false);
    tally.sent(0, true);
    tally.sent(0, true);
    expect(tally.answered(1)).toBe(false);
    expect(tally.answered(0)).toBe(true);
    expect(tally.answered(0)).toBe(true);
    expect(tally.answered(0)).toBe(false);
    expect(tally.unanswered).toBe(0);
  });
});
