// The checker must be able to fail: hand-made histories, one clean and one
// per broken rule, each of which it has to flag.

import { describe, expect, it } from "vitest";
import { checkHistory, type HistoryRecord, type Invariant, type LeaseEvent } from "./checker.js";

const key = "acct/s1";
const ttlUs = 1_000_000;
const t0 = 1_700_000_000_000_000;

function grant(runId: string, token: number, at: number, client = 0): HistoryRecord {
  return {
    type: "grant",
    client,
    key,
    runId,
    token,
    acquiredAt: at,
    expiresAt: at + ttlUs,
    ttlUs,
    via: "acquire",
  };
}
function renewed(runId: string, token: number, at: number, deadlineKnown = true): HistoryRecord {
  return {
    type: "renewed",
    client: 0,
    key,
    runId,
    token,
    expiresAt: at + ttlUs,
    ttlUs,
    via: "renew",
    deadlineKnown,
  };
}
function acquiredEvent(id: number, runId: string, token: number, at: number): LeaseEvent {
  return { id, type: "acquired", key, runId, token, atUs: at };
}
function releasedEvent(id: number, runId: string, token: number, at: number): LeaseEvent {
  return { id, type: "released", key, runId, token, atUs: at };
}

// A: granted at t0, renewed at t0+0.5s, released at t0+1.2s; B granted at t0+1.2s.
const cleanRecords: HistoryRecord[] = [
  grant("A", 10, t0),
  renewed("A", 10, t0 + 500_000),
  { type: "write", client: 0, key, runId: "A", token: 10, accepted: true, startMs: 1, endMs: 2 },
  { type: "release", client: 0, key, runId: "A", released: true },
  grant("B", 11, t0 + 1_200_000, 1),
  { type: "write", client: 1, key, runId: "B", token: 11, accepted: true, startMs: 3, endMs: 4 },
  { type: "write", client: 0, key, runId: "A", token: 10, accepted: false, startMs: 5, endMs: 6 },
];
const cleanEvents: LeaseEvent[] = [
  acquiredEvent(1, "A", 10, t0),
  releasedEvent(2, "A", 10, t0 + 1_200_000),
  acquiredEvent(3, "B", 11, t0 + 1_200_000),
];

function invariants(records: HistoryRecord[], events: LeaseEvent[]): Invariant[] {
  return checkHistory(records, events).violations.map((v) => v.invariant);
}

describe("history checker", () => {
  it("accepts a history that keeps every invariant", () => {
    expect(checkHistory(cleanRecords, cleanEvents).violations).toEqual([]);
  });

  it("S1: flags a grant inside another run's held interval", () => {
    const records = [grant("A", 10, t0), grant("B", 11, t0 + 400_000, 1)];
    const events = [acquiredEvent(1, "A", 10, t0), acquiredEvent(2, "B", 11, t0 + 400_000)];
    expect(invariants(records, events)).toContain("S1");
  });

  it("S1: a grant exactly at the previous deadline is not an overlap", () => {
    const records = [grant("A", 10, t0), grant("B", 11, t0 + ttlUs, 1)];
    const events = [acquiredEvent(1, "A", 10, t0), acquiredEvent(2, "B", 11, t0 + ttlUs)];
    expect(invariants(records, events)).toEqual([]);
  });

  it("S6: flags a later grant with a smaller token", () => {
    const records = [grant("A", 11, t0), grant("B", 10, t0 + 2 * ttlUs, 1)];
    const events = [acquiredEvent(1, "A", 11, t0), acquiredEvent(2, "B", 10, t0 + 2 * ttlUs)];
    expect(invariants(records, events)).toContain("S6");
  });

  it("S4: flags a renewal after the run's known deadline", () => {
    const records = [grant("A", 10, t0), renewed("A", 10, t0 + ttlUs + 1)];
    expect(invariants(records, [acquiredEvent(1, "A", 10, t0)])).toEqual(["S4"]);
  });

  it("S4: flags a renewal after another run was granted the key", () => {
    // The deadline is unknown (an earlier answer was lost), but B's grant proves A had expired.
    const records = [
      grant("A", 10, t0),
      grant("B", 11, t0 + ttlUs, 1),
      renewed("A", 10, t0 + ttlUs + 5, false),
    ];
    const events = [acquiredEvent(1, "A", 10, t0), acquiredEvent(2, "B", 11, t0 + ttlUs)];
    expect(invariants(records, events)).toContain("S4");
  });

  it("S4: flags a renewal of a grant after that grant's release", () => {
    const records = [
      grant("A", 10, t0),
      { type: "release", client: 0, key, runId: "A" } as const,
      renewed("A", 10, t0 + 300_000),
    ];
    const events = [acquiredEvent(1, "A", 10, t0), releasedEvent(2, "A", 10, t0 + 100_000)];
    expect(invariants(records, events)).toEqual(["S4"]);
  });

  it("S4: a run granted anew after the server released its earlier grant may renew the new one", () => {
    // Token 10 was granted for a waiter whose call was gone and released
    // on its behalf; the client's retry with the same run_id got token 11.
    const records = [
      grant("A", 11, t0 + 10_000),
      renewed("A", 11, t0 + 300_000),
      { type: "release", client: 0, key, runId: "A" } as const,
    ];
    const events = [
      acquiredEvent(1, "A", 10, t0),
      releasedEvent(2, "A", 10, t0 + 2_000),
      acquiredEvent(3, "A", 11, t0 + 10_000),
    ];
    expect(invariants(records, events)).toEqual([]);
  });

  it("S5: flags a release recorded for a run that never released", () => {
    const records = [
      grant("A", 10, t0),
      { type: "release", client: 1, key, runId: "B", released: true } as const,
    ];
    const events = [acquiredEvent(1, "A", 10, t0), releasedEvent(2, "A", 10, t0 + 10)];
    expect(invariants(records, events)).toContain("S5");
  });

  it("S5: flags a renew that failed as released for a run that never released", () => {
    const records: HistoryRecord[] = [
      grant("A", 10, t0),
      {
        type: "renew-failed",
        client: 0,
        key,
        runId: "A",
        code: "FailedPrecondition",
        cause: "released",
      },
    ];
    expect(invariants(records, [acquiredEvent(1, "A", 10, t0)])).toEqual(["S5"]);
  });

  it("S7: flags an accepted write with a token below an earlier accepted one", () => {
    const records: HistoryRecord[] = [
      {
        type: "write",
        client: 1,
        key,
        runId: "B",
        token: 11,
        accepted: true,
        startMs: 1,
        endMs: 2,
      },
      {
        type: "write",
        client: 0,
        key,
        runId: "A",
        token: 10,
        accepted: true,
        startMs: 3,
        endMs: 4,
      },
    ];
    expect(invariants(records, [])).toEqual(["S7"]);
  });

  it("S7: overlapping writes are not ordered, so either may land first", () => {
    const records: HistoryRecord[] = [
      {
        type: "write",
        client: 1,
        key,
        runId: "B",
        token: 11,
        accepted: true,
        startMs: 1,
        endMs: 5,
      },
      {
        type: "write",
        client: 0,
        key,
        runId: "A",
        token: 10,
        accepted: true,
        startMs: 3,
        endMs: 4,
      },
    ];
    expect(invariants(records, [])).toEqual([]);
  });

  it("L2: flags an abort after the deadline, beyond the clock query's latency", () => {
    const abort: HistoryRecord = {
      type: "abort",
      client: 0,
      key,
      runId: "A",
      reason: "deadline",
      deadlineUs: t0 + ttlUs,
      dbUs: t0 + ttlUs + 50_000,
      dbRttUs: 10_000,
      wallUs: t0 + ttlUs + 45_000,
    };
    const result = checkHistory([grant("A", 10, t0), abort], [acquiredEvent(1, "A", 10, t0)]);
    expect(result.violations.map((v) => v.invariant)).toEqual(["L2"]);
  });

  it("L2: an abort late only by the clock query's round trip is not a violation", () => {
    const abort: HistoryRecord = {
      type: "abort",
      client: 0,
      key,
      runId: "A",
      reason: "deadline",
      deadlineUs: t0 + ttlUs,
      dbUs: t0 + ttlUs + 5_000,
      dbRttUs: 10_000,
      wallUs: t0 + ttlUs,
    };
    const result = checkHistory([grant("A", 10, t0), abort], [acquiredEvent(1, "A", 10, t0)]);
    expect(result.violations).toEqual([]);
    expect(result.l2WithinLatency).toBe(1);
  });

  it("L2: a client paused across its deadline is excused, not passed silently", () => {
    const abort: HistoryRecord = {
      type: "abort",
      client: 0,
      key,
      runId: "A",
      reason: "deadline",
      deadlineUs: t0 + ttlUs,
      wallUs: t0 + 3 * ttlUs,
    };
    const pause: HistoryRecord = {
      type: "pause",
      client: 0,
      fromUs: t0 + 100,
      toUs: t0 + 3 * ttlUs,
    };
    const result = checkHistory(
      [grant("A", 10, t0), pause, abort],
      [acquiredEvent(1, "A", 10, t0)],
    );
    expect(result.violations).toEqual([]);
    expect(result.l2Excused).toBe(1);
  });

  // Run A's deadline is t0 + ttl and its safety margin 300 ms; client 0 was
  // paused from just after the grant until `pauseEndUs`, and its abort's
  // clock query read `dbUs` (relative to the deadline) after `dbRttUs`.
  function pausedAbort(pauseEndUs: number, dbUs: number, dbRttUs: number) {
    const deadlineUs = t0 + ttlUs;
    const pause: HistoryRecord = {
      type: "pause",
      client: 0,
      fromUs: t0 + 100,
      toUs: deadlineUs + pauseEndUs,
    };
    const abort: HistoryRecord = {
      type: "abort",
      client: 0,
      key,
      runId: "A",
      reason: "deadline",
      deadlineUs,
      dbUs: deadlineUs + dbUs,
      dbRttUs,
      wallUs: deadlineUs + dbUs - dbRttUs,
      marginUs: 300_000,
    };
    return checkHistory([grant("A", 10, t0), pause, abort], [acquiredEvent(1, "A", 10, t0)]);
  }

  it("L2: an abort right after a pause that ended just before the deadline is excused", () => {
    // The local deadline fell due during the pause; the abort fired first
    // thing after it, and the database deadline fell in between.
    const result = pausedAbort(-1_400, 2_900, 2_700);
    expect(result.violations).toEqual([]);
    expect(result.l2Excused).toBe(1);
  });

  it("L2: a pause that ended before the local deadline fell due does not excuse a late abort", () => {
    const result = pausedAbort(-310_000, 20_000, 2_000);
    expect(result.violations.map((v) => v.invariant)).toEqual(["L2"]);
  });

  it("L2: an abort long after a pause that covered the local deadline is not excused", () => {
    const result = pausedAbort(-100_000, 5_000, 1_000);
    expect(result.violations.map((v) => v.invariant)).toEqual(["L2"]);
  });

  it("L2: flags a lease reported expired before its confirmed deadline", () => {
    const abort: HistoryRecord = {
      type: "abort",
      client: 0,
      key,
      runId: "A",
      reason: "expired",
      deadlineUs: t0 + ttlUs,
      dbUs: t0 + 500_000,
      dbRttUs: 1_000,
      wallUs: t0 + 499_000,
    };
    const result = checkHistory([grant("A", 10, t0), abort], [acquiredEvent(1, "A", 10, t0)]);
    expect(result.violations.map((v) => v.invariant)).toEqual(["L2"]);
  });

  it("audit: flags a grant the database never recorded, and one recorded twice", () => {
    expect(invariants([grant("A", 10, t0)], [])).toEqual(["audit"]);
    const twice = [acquiredEvent(1, "A", 10, t0), acquiredEvent(2, "A", 10, t0)];
    expect(invariants([grant("A", 10, t0)], twice)).toContain("audit");
  });

  it("audit: a run_id granted again after its grant expired is a new grant, not a duplicate", () => {
    const again = [acquiredEvent(1, "A", 10, t0), acquiredEvent(2, "A", 12, t0 + 2 * ttlUs)];
    expect(invariants([grant("A", 12, t0 + 2 * ttlUs)], again)).toEqual([]);
  });
});
