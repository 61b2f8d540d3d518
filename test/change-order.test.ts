// The watch order guard, a pure part of the change path: changes arriving
// late, twice or out of order never show a watcher an older grant after a
// newer one (S6 orders grants). The notification wire format is tested in
// streams/notify-codec.test.ts.

import fc from "fast-check";
import { describe, expect, it } from "vitest";
import type { ChangeType, LeaseChange } from "../src/lease/lease-change.js";
import { OrderGuard } from "../src/server/streams/watch-hub.js";
import { leaseChange as change } from "./support/lease-changes.js";

describe("watch order guard", () => {
  it("S6: whatever order and duplication changes arrive in, a watcher never sees an older grant after a newer one", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: 6 }),
        fc.array(fc.nat(), { minLength: 0, maxLength: 60 }),
        fc.array(fc.nat(), { minLength: 0, maxLength: 20 }),
        fc.constantFrom<ChangeType>("released", "expired", "revoked"),
        (grants, shuffle, dupes, ending) => {
          // The true history: grants 1..n, each acquired, maybe asked to hand
          // off, then ended.
          const history: LeaseChange[] = [];
          for (let t = 1n; t <= BigInt(grants); t++) {
            history.push(change("acquired", t));
            history.push(change("handoff_requested", t));
            history.push(change(ending, t));
          }
          // Deliveries: the history with duplicates, in a scrambled order.
          const delivered = [...history];
          for (const d of dupes) delivered.push(history[d % history.length] as LeaseChange);
          shuffle.forEach((s, i) => {
            const j = s % delivered.length;
            const k = i % delivered.length;
            [delivered[j], delivered[k]] = [
              delivered[k] as LeaseChange,
              delivered[j] as LeaseChange,
            ];
          });
          const guard = new OrderGuard();
          const shown = delivered.filter((c) => guard.accept(c));
          let last = 0n;
          let ended = false;
          const seen = new Set<string>();
          for (const c of shown) {
            const id = `${c.type}:${c.fencingToken}`;
            // Never twice.
            expect(seen.has(id)).toBe(false);
            seen.add(id);
            // Never an older grant after a newer one.
            expect(c.fencingToken).toBeGreaterThanOrEqual(last);
            if (c.fencingToken === last) {
              // Nothing about a grant after its end.
              expect(ended).toBe(false);
              expect(c.type).not.toBe("acquired");
            }
            ended = c.type === ending;
            last = c.fencingToken;
          }
          // The newest state always gets through: the last grant's end is shown.
          expect(shown.some((c) => c.fencingToken === BigInt(grants) && c.type === ending)).toBe(
            true,
          );
        },
      ),
    );
  });

  it("a snapshot's tombstones make late changes about ended grants stale", () => {
    const guard = new OrderGuard();
    guard.seed([{ accountId: "acct", sessionId: "s", fencingToken: 5n, valid: false }]);
    expect(guard.accept(change("acquired", 5n))).toBe(false);
    expect(guard.accept(change("released", 5n))).toBe(false);
    expect(guard.accept(change("released", 4n))).toBe(false);
    expect(guard.accept(change("acquired", 6n))).toBe(true);
    expect(guard.covers({ accountId: "acct", sessionId: "s", fencingToken: 6n, valid: true })).toBe(
      true,
    );
    expect(
      guard.covers({ accountId: "acct", sessionId: "s", fencingToken: 6n, valid: false }),
    ).toBe(false);
    expect(guard.covers({ accountId: "acct", sessionId: "t", fencingToken: 1n, valid: true })).toBe(
      false,
    );
  });
});
