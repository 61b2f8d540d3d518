// The payload codec of the notification channel (streams/notify-codec.ts,
// DESIGN §3): every message kind reads back exactly as written, what is over
// PostgreSQL's NOTIFY limit (payloads of 8000 bytes or more are refused) is
// spread over payloads under it, and a payload this version cannot read is
// ignored rather than thrown at the LISTEN connection. Pure: no PostgreSQL;
// the channel itself is exercised in multi-instance.test.ts.

import fc from "fast-check";
import { describe, expect, it } from "vitest";
import type { ChangeType, LeaseChange } from "../../src/lease/lease-change.js";
import { defaultLimits } from "../../src/lease/limits.js";
import {
  decodeMessage,
  encodeChanges,
  encodeControl,
  encodePing,
  maxPayloadBytes,
  type NotifierMessage,
  ownPayloadFilter,
} from "../../src/server/streams/notify-codec.js";
import { leaseChange } from "../support/lease-changes.js";

/** PostgreSQL refuses a NOTIFY payload of this many bytes or more. */
const postgresLimitBytes = 8000;

/** What a receiver reads: the lease inside a change carries the change's key, run and token. */
function asRead(c: LeaseChange): LeaseChange {
  return c.lease
    ? {
        ...c,
        lease: {
          ...c.lease,
          accountId: c.accountId,
          sessionId: c.sessionId,
          runId: c.runId,
          fencingToken: c.fencingToken,
          holder: c.holder,
        },
      }
    : c;
}

function decodeAll(payloads: string[]): NotifierMessage[] {
  return payloads.map((p) => {
    const m = decodeMessage(p);
    if (!m) throw new Error(`unreadable payload ${p.slice(0, 80)}`);
    return m;
  });
}

// Every change type, checked complete by the compiler.
const everyType: Record<ChangeType, true> = {
  acquired: true,
  released: true,
  expired: true,
  revoked: true,
  handoff_requested: true,
  renewed: true,
};

const text = fc.string({ unit: "binary", maxLength: 40 });
const bigint64 = fc.bigInt({ min: 0n, max: 2n ** 63n - 1n });
const arbitraryChange: fc.Arbitrary<LeaseChange> = fc.record({
  type: fc.constantFrom(...(Object.keys(everyType) as ChangeType[])),
  accountId: text,
  sessionId: text,
  runId: fc.uuid(),
  fencingToken: bigint64,
  holder: text,
  atUs: bigint64,
  lease: fc.option(
    fc
      .record({
        accountId: text,
        sessionId: text,
        runId: fc.uuid(),
        fencingToken: bigint64,
        holder: text,
        ttlMs: bigint64,
        acquiredAtUs: bigint64,
        expiresAtUs: bigint64,
        remainingUs: bigint64,
        // A keeper's lease carries its keeper's id (K1); a lease of its own none.
        keeperId: fc.option(fc.uuid(), { nil: undefined }),
      })
      .map(({ keeperId, ...l }) => (keeperId === undefined ? l : { ...l, keeperId })),
    { nil: undefined },
  ),
  reason: text,
  requesterHolder: text,
  eventId: bigint64,
});

describe("L1: notification payload codec", () => {
  it("reads back every change exactly, in order, with its source", () => {
    fc.assert(
      fc.property(fc.string({ unit: "binary" }), fc.array(arbitraryChange), (source, changes) => {
        const messages = decodeAll(encodeChanges(source, changes));
        const back: LeaseChange[] = [];
        for (const m of messages) {
          expect(m.kind).toBe("changes");
          expect(m.source).toBe(source);
          if (m.kind === "changes") back.push(...m.changes);
        }
        expect(back).toEqual(changes.map(asRead));
      }),
    );
  });

  it("reads back hello, interest and ping messages exactly", () => {
    expect(decodeAll(encodeControl("i-1", { kind: "hello", source: "" }))).toEqual([
      { kind: "hello", source: "i-1" },
    ]);
    const scopes = [
      { accountId: "acct", sessionId: "s1" },
      { accountId: "аккаунт", sessionId: "сессия ✓" },
    ];
    expect(
      decodeAll(encodeControl("i-1", { kind: "interest", source: "", scopes, forMs: 30_000 })),
    ).toEqual([{ kind: "interest", source: "i-1", scopes, forMs: 30_000 }]);
    expect(decodeMessage(encodePing("i-1", "42-0.5"))).toEqual({
      kind: "ping",
      source: "i-1",
      nonce: "42-0.5",
    });
  });

  it("packs many changes per payload, each under 8000 bytes, and reads them back exactly", () => {
    const changes: LeaseChange[] = [];
    for (let i = 1n; i <= 500n; i++) {
      changes.push(
        leaseChange(i % 2n === 0n ? "acquired" : "handoff_requested", i, {
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
    for (const p of payloads) expect(Buffer.byteLength(p)).toBeLessThan(postgresLimitBytes);
    // Filled to near the limit before a new payload starts.
    for (const p of payloads.slice(0, -1)) {
      expect(Buffer.byteLength(p)).toBeGreaterThan(maxPayloadBytes - 1_000);
    }
    const back: LeaseChange[] = [];
    for (const m of decodeAll(payloads)) {
      expect(m.kind).toBe("changes");
      if (m.kind === "changes") {
        expect(m.source).toBe("instance-a");
        back.push(...m.changes);
      }
    }
    expect(back).toEqual(changes.map(asRead));
  });

  it("spreads an interest in many scopes over payloads under the limit, each with its forMs", () => {
    const scopes = Array.from({ length: 2_000 }, (_, i) => ({
      accountId: `account-${i}`,
      sessionId: `сессия-${i}-✓`,
    }));
    const payloads = encodeControl("i-1", { kind: "interest", source: "", scopes, forMs: 30_000 });
    expect(payloads.length).toBeGreaterThan(5);
    const back: { accountId: string; sessionId: string }[] = [];
    for (const p of payloads) {
      expect(Buffer.byteLength(p)).toBeLessThan(postgresLimitBytes);
      const m = decodeMessage(p);
      expect(m).toMatchObject({ kind: "interest", source: "i-1", forMs: 30_000 });
      if (m?.kind === "interest") back.push(...m.scopes);
    }
    expect(back).toEqual(scopes);
  });

  it("never cuts one change in two: a change over the limit travels whole, alone in its payload", () => {
    const big = leaseChange("released", 2n, { reason: "✓".repeat(3_000) });
    const payloads = encodeChanges("i-1", [
      leaseChange("released", 1n),
      big,
      leaseChange("released", 3n),
    ]);
    expect(payloads).toHaveLength(3);
    expect(Buffer.byteLength(payloads[1] ?? "")).toBeGreaterThan(maxPayloadBytes);
    expect(decodeMessage(payloads[1] ?? "")).toEqual({
      kind: "changes",
      source: "i-1",
      changes: [big],
    });
  });

  it("keeps the largest change the default limits allow under PostgreSQL's limit", () => {
    // Every text field at its longest, in characters of three UTF-8 bytes
    // (the most one UTF-16 unit can cost once control characters are refused).
    const wide = (n: number) => "✓".repeat(n);
    const largest = leaseChange("handoff_requested", 2n ** 63n - 1n, {
      accountId: wide(defaultLimits.maxIdLength),
      sessionId: wide(defaultLimits.maxIdLength),
      holder: wide(defaultLimits.maxHolderLength),
      reason: wide(defaultLimits.maxReasonLength),
      requesterHolder: wide(defaultLimits.maxHolderLength),
      atUs: 2n ** 63n - 1n,
      eventId: 2n ** 63n - 1n,
      lease: {
        accountId: "",
        sessionId: "",
        runId: "",
        fencingToken: 0n,
        holder: "",
        ttlMs: 2n ** 63n - 1n,
        acquiredAtUs: 2n ** 63n - 1n,
        expiresAtUs: 2n ** 63n - 1n,
        remainingUs: 2n ** 63n - 1n,
        keeperId: "0".repeat(36),
      },
    });
    const [payload, ...rest] = encodeChanges("0".repeat(36), [largest]);
    expect(rest).toEqual([]);
    expect(Buffer.byteLength(payload ?? "")).toBeLessThan(maxPayloadBytes);
  });

  it("ignores payloads it cannot read instead of throwing", () => {
    const unreadable = [
      "",
      "not json",
      "null",
      "[]",
      '"text"',
      JSON.stringify({ v: 2, s: "x", c: [] }),
      JSON.stringify({ v: 1, c: [] }),
      JSON.stringify({ v: 1, s: 7, h: 1 }),
      JSON.stringify({ v: 1, s: "x" }),
      JSON.stringify({ v: 1, s: "x", c: [["nonsense"]] }),
      JSON.stringify({ v: 1, s: "x", c: [["acquired", "a", "s", "r", "not a number"]] }),
      JSON.stringify({ v: 1, s: "x", i: [[1, 2]], f: 10 }),
      JSON.stringify({ v: 1, s: "x", i: [["a", "s"]], f: "10" }),
      encodeChanges("x", [leaseChange("released", 1n)])[0]?.slice(0, -3) ?? "",
    ];
    for (const payload of unreadable) expect(decodeMessage(payload), payload).toBeUndefined();
  });

  it("recognises this instance's own changes, interests and hellos by prefix, never its pings or another's", () => {
    const isOwn = ownPayloadFilter("i-1");
    expect(isOwn(encodeChanges("i-1", [leaseChange("released", 1n)])[0] ?? "")).toBe(true);
    expect(isOwn(encodeControl("i-1", { kind: "hello", source: "" })[0] ?? "")).toBe(true);
    expect(isOwn(encodePing("i-1", "n"))).toBe(false);
    expect(isOwn(encodeChanges("i-10", [leaseChange("released", 1n)])[0] ?? "")).toBe(false);
    expect(isOwn(encodeChanges('i-1"', [leaseChange("released", 1n)])[0] ?? "")).toBe(false);
  });
});
