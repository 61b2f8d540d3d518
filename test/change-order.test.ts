// Pure parts of the change path: the notification wire format (payloads stay
// under PostgreSQL's 8000-byte limit and read back exactly) and the watch
// order guard (changes arriving late, twice or out of order never show a
// watcher an older grant after a newer one — S6 orders grants).

import fc from "fast-check";
import { describe, expect, it } from "vitest";
import type { ChangeType, LeaseChange } from "../src/server/lease/lease-change.js";
import { decodeMessage, encodeChanges } from "../src/server/streams/notifier.js";
import { OrderGuard } from "../src/server/streams/watch-hub.js";

function change(type: ChangeType, token: bigint, extra: Partial<LeaseChange> = {}): LeaseChange {
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

describe("notification payloads", () => {
  it("pack many changes per payload, each under 8000 bytes, and read back exactly", () => {
    const changes: LeaseChange[] = [];
    for (let i = 1n; i <= 500n; i++) {
      changes.push(
        change(i % 2n === 0n ? "acquired" : "handoff_requested", i, {
          // Multi-byte text: the limit is in bytes, not characters.
          reason: "континуировать на этом устройстве ✓".repeat(3),
          requesterHolder: "браузер",
          lease:
            i % 2n === 0n
              ? {
                  accountId: "acct",
                  sessionId: "s",
                  runId: "r",
                  fencingToken: i,
                  holder: "desktop",
                  ttlMs: 15_000n,
                  acquiredAtUs: 1n,
                  expiresAtUs: 15_000_001n,
                  remainingUs: 14_999_000n,
                }
              : undefined,
        }),
      );
    }
    const payloads = encodeChanges("instance-a", changes);
    expect(payloads.length).toBeGreaterThan(1);
    expect(payloads.length).toBeLessThan(changes.length / 10);
    const back: LeaseChange[] = [];
    for (const p of payloads) {
      expect(Buffer.byteLength(p)).toBeLessThan(8000);
      const m = decodeMessage(p);
      expect(m?.kind).toBe("changes");
      if (m?.kind === "changes") {
        expect(m.source).toBe("instance-a");
        back.push(...m.changes);
      }
    }
    expect(back).toEqual(
      changes.map((c) => (c.lease ? { ...c, lease: { ...c.lease, runId: c.runId } } : c)),
    );
  });

  it("ignores payloads it cannot read instead of failing", () => {
    expect(decodeMessage("not json")).toBeUndefined();
    expect(decodeMessage(JSON.stringify({ v: 2, s: "x", c: [] }))).toBeUndefined();
    expect(decodeMessage(JSON.stringify({ v: 1, s: "x", c: [["nonsense"]] }))).toBeUndefined();
  });
});

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
