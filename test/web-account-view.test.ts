// The page's model of an account (web/src/account-view.ts): how Watch events
// and answers combine when they arrive late or out of order. Pure logic, so
// it is checked without a server.

import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";
import {
  EventSchema,
  EventType,
  type Lease,
  LeaseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { AccountView } from "../web/src/account-view.js";

const key = { accountId: "acme", sessionId: "s1" };

function lease(runId: string, token: bigint, remainingSeconds = 10): Lease {
  return create(LeaseSchema, {
    key,
    runId,
    fencingToken: token,
    holder: `holder-${runId}`,
    remaining: { seconds: BigInt(remainingSeconds) },
  });
}

function event(
  type: EventType,
  l: Lease,
  extra: { requesterHolder?: string; reason?: string; id?: bigint; atSeconds?: number } = {},
) {
  const { atSeconds, ...rest } = extra;
  return create(EventSchema, {
    type,
    key,
    runId: l.runId,
    fencingToken: l.fencingToken,
    holder: l.holder,
    lease: type === EventType.ACQUIRED || type === EventType.RENEWED ? l : undefined,
    at: atSeconds === undefined ? undefined : { seconds: BigInt(atSeconds) },
    ...rest,
  });
}

describe("the page's account view", () => {
  it("S6: a grant with a smaller fencing token arriving late does not replace the newer one", () => {
    const view = new AccountView();
    view.apply(event(EventType.ACQUIRED, lease("b", 2n)), 0);
    view.upsert(lease("a", 1n), 0);
    view.apply(event(EventType.RENEWED, lease("a", 1n)), 0);
    expect(view.sessions.get("s1")?.lease.runId).toBe("b");
  });

  it("S1: the end of an older run leaves the newer run shown as the one holder", () => {
    const view = new AccountView();
    const a = lease("a", 1n);
    const b = lease("b", 2n);
    view.apply(event(EventType.ACQUIRED, b), 0);
    view.apply(event(EventType.EXPIRED, a), 0);
    expect(view.sessions.get("s1")?.lease.runId).toBe("b");
    view.apply(event(EventType.RELEASED, b), 0);
    expect(view.sessions.has("s1")).toBe(false);
    expect(view.transitions.map((t) => [EventType[t.type], t.runId])).toEqual([
      ["RELEASED", "b"],
      ["EXPIRED", "a"],
      ["ACQUIRED", "b"],
    ]);
  });

  it("counts down on the local clock from `remaining`, and no longer shows a lease past it", () => {
    const view = new AccountView();
    view.upsert(lease("a", 1n, 12), 1000);
    expect(view.holder("s1", 1000 + 11_999)?.lease.runId).toBe("a");
    expect(view.holder("s1", 1000 + 12_000)).toBeUndefined();
    // A renewal moves the local deadline from the moment it arrived.
    view.apply(event(EventType.RENEWED, lease("a", 1n, 12)), 10_000);
    expect(view.holder("s1", 21_999)?.lease.runId).toBe("a");
    expect(view.transitions).toEqual([]);
  });

  it("a session's audit trail fills the recent changes, newest first, without repeating what Watch showed", () => {
    const view = new AccountView();
    const a = lease("a", 1n);
    const b = lease("b", 2n);
    // Live, after the page opened: b's grant (audit id 3).
    view.apply(event(EventType.ACQUIRED, b, { id: 3n, atSeconds: 30 }), 0);
    // History answers later, newest first: b's grant again, a's release and grant.
    const version = view.transitionsVersion;
    view.addHistory([
      event(EventType.ACQUIRED, b, { id: 3n, atSeconds: 30 }),
      event(EventType.RENEWED, a, { id: 0n, atSeconds: 15 }),
      event(EventType.RELEASED, a, { id: 2n, atSeconds: 20 }),
      event(EventType.ACQUIRED, a, { id: 1n, atSeconds: 10 }),
    ]);
    expect(view.transitions.map((t) => [EventType[t.type], t.runId, t.id])).toEqual([
      ["ACQUIRED", "b", 3n],
      ["RELEASED", "a", 2n],
      ["ACQUIRED", "a", 1n],
    ]);
    // The newest entry is unchanged, yet the list changed: the page must redraw it.
    expect(view.transitionsVersion).toBeGreaterThan(version);
    // A live event already loaded from History is not shown twice either.
    view.apply(event(EventType.RELEASED, a, { id: 2n, atSeconds: 20 }), 0);
    expect(view.transitions).toHaveLength(3);
  });

  it("an EXPIRED seen live (no audit id yet) is not listed again when History brings its row", () => {
    const view = new AccountView();
    const a = lease("a", 1n);
    view.apply(event(EventType.EXPIRED, a, { id: 0n, atSeconds: 40 }), 0);
    view.addHistory([
      event(EventType.EXPIRED, a, { id: 9n, atSeconds: 40 }),
      event(EventType.ACQUIRED, a, { id: 8n, atSeconds: 10 }),
    ]);
    expect(view.transitions.map((t) => EventType[t.type])).toEqual(["EXPIRED", "ACQUIRED"]);
  });

  it("L1: a grant that ran out with nothing recorded after it (History's last event ACQUIRED) is shown as ended", () => {
    const view = new AccountView();
    const a = lease("a", 1n);
    const b = lease("b", 2n);
    // The page opens after b's lease expired and nobody touched s1 since:
    // List finds nothing held, History ends with b's ACQUIRED (EXPIRED is
    // written only at the next grant).
    view.replace([], 0);
    view.addHistory([
      event(EventType.ACQUIRED, b, { id: 3n, atSeconds: 30 }),
      event(EventType.RELEASED, a, { id: 2n, atSeconds: 20 }),
      event(EventType.ACQUIRED, a, { id: 1n, atSeconds: 10 }),
    ]);
    const [bGrant, aRelease, aGrant] = view.transitions;
    if (!bGrant || !aRelease || !aGrant) throw new Error("three transitions expected");
    expect(view.ranOutUnrecorded(bGrant)).toBe(true);
    // a's grant has its end listed; a release is no grant.
    expect(view.ranOutUnrecorded(aGrant)).toBe(false);
    expect(view.ranOutUnrecorded(aRelease)).toBe(false);

    // Held after all (a List that comes later): not ended; the page redraws.
    const version = view.transitionsVersion;
    view.replace([b], 0);
    expect(view.transitionsVersion).toBeGreaterThan(version);
    expect(view.ranOutUnrecorded(bGrant)).toBe(false);

    // Its expiry seen live: the EXPIRED is listed, the grant needs no mark.
    view.apply(event(EventType.EXPIRED, b, { id: 0n, atSeconds: 40 }), 0);
    expect(view.ranOutUnrecorded(bGrant)).toBe(false);
  });

  it("keeps the newest 50 changes when History adds older ones", () => {
    const view = new AccountView();
    for (let i = 1; i <= 50; i++) {
      view.apply(
        event(EventType.ACQUIRED, lease(`r${i}`, BigInt(i)), {
          id: BigInt(100 + i),
          atSeconds: 100 + i,
        }),
        0,
      );
    }
    view.addHistory([event(EventType.RELEASED, lease("old", 1n), { id: 7n, atSeconds: 7 })]);
    expect(view.transitions).toHaveLength(50);
    expect(view.transitions.some((t) => t.runId === "old")).toBe(false);
    expect(view.transitions[0]?.runId).toBe("r50");
  });

  it("keeps a handoff request for the run it names until that run ends", () => {
    const view = new AccountView();
    const a = lease("a", 1n);
    view.apply(event(EventType.ACQUIRED, a), 0);
    view.apply(
      event(EventType.HANDOFF_REQUESTED, a, { requesterHolder: "browser", reason: "continue" }),
      0,
    );
    expect(view.handoffs.get("a")).toMatchObject({
      requesterHolder: "browser",
      reason: "continue",
    });
    view.replace([a], 0);
    expect(view.handoffs.has("a")).toBe(true);
    view.replace([], 0);
    expect(view.handoffs.has("a")).toBe(false);
    view.apply(event(EventType.HANDOFF_REQUESTED, a, { requesterHolder: "browser" }), 0);
    view.apply(event(EventType.EXPIRED, a), 0);
    expect(view.handoffs.has("a")).toBe(false);
  });
});
