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
  extra: { requesterHolder?: string; reason?: string } = {},
) {
  return create(EventSchema, {
    type,
    key,
    runId: l.runId,
    fencingToken: l.fencingToken,
    holder: l.holder,
    lease: type === EventType.ACQUIRED || type === EventType.RENEWED ? l : undefined,
    ...extra,
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
