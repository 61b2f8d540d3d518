// The keeper and election rules (checker-keepers.ts) must be able to fail:
// a clean hand-made history passes, and each planted violation is flagged
// by its rule, through checkOperations as the suites check it.

import { describe, expect, it } from "vitest";
import { checkOperations, type LeaseEvent } from "./checker.js";
import type { HistoryEvent, OpEvent, OpValue } from "./op-history.js";

const s = 1_000_000;
const t0 = 1_700_000_000 * s;

/** Builds a history: each op is an invoke and a completion at the given host (= database) times. */
function builder() {
  const history: HistoryEvent[] = [];
  let process = 0;
  const op = (
    f: string,
    at: [number, number],
    fields: { key: string; runId?: string; token?: number; client?: number },
    type: OpEvent["type"],
    value?: OpValue,
    invokeValue?: OpValue,
  ) => {
    process += 1;
    const base = { f, process, client: fields.client ?? 0, key: fields.key, runId: fields.runId };
    history.push({
      ...base,
      type: "invoke",
      time: at[0] * 1000,
      wallUs: at[0],
      token: fields.token,
      value: invokeValue,
    });
    history.push({
      ...base,
      type,
      time: at[1] * 1000,
      wallUs: at[1],
      token: fields.token,
      value,
    });
  };
  return { history, op };
}

const key = "acct/s1";
const keeper = "k-1";
const ttl = 2 * s;

/**
 * A keeper with a 1 s lock-delay: opened at t0, one heartbeat at t0+0.5 s
 * (deadline t0+2.5 s), run r1 granted on it (token 10), a write at t0+1 s;
 * then it expires (lease_events: r1 expired at t0+2.6 s) and r2 is granted
 * at `nextGrantAt`. Election e: term 20 from t0 to its resign at t0+1 s,
 * term 21 granted at `secondTermAt`.
 */
function scenario(
  options: { nextGrantAt?: number; secondTermAt?: number; secondTerm?: number } = {},
) {
  const { history, op } = builder();
  const nextGrantAt = options.nextGrantAt ?? t0 + 3.6 * s;
  const secondTermAt = options.secondTermAt ?? t0 + 1.1 * s;
  const kk = `keeper:${keeper}`;
  op("keeper-open", [t0, t0 + 1000], { key: kk }, "ok", {
    keeperId: keeper,
    expiresAtUs: t0 + ttl,
    lockDelayMs: 1000,
  });
  op("keeper-attach", [t0, t0 + 900], { key: kk }, "ok", {
    keeperId: keeper,
    expiresAtUs: t0 + ttl,
    ttlUs: ttl,
    lockDelayMs: 1000,
  });
  op("keeper-heartbeat", [t0 + 0.5 * s, t0 + 0.5 * s + 500], { key: kk }, "ok", {
    keeperId: keeper,
    expiresAtUs: t0 + 0.5 * s + ttl,
    ttlUs: ttl,
    lockDelayMs: 1000,
  });
  op(
    "keeper-acquire",
    [t0 + 0.6 * s, t0 + 0.6 * s + 500],
    { key, runId: "r1", token: 10 },
    "ok",
    { keeperId: keeper, acquiredAtUs: t0 + 0.6 * s, expiresAtUs: t0 + 2.5 * s },
    { keeperId: keeper },
  );
  op("write", [t0 + s, t0 + s + 500], { key, runId: "r1", token: 10 }, "ok");
  const e = "acct/e";
  op("campaign", [t0, t0 + 1000], { key: e, runId: "c1", token: 20, client: 1 }, "ok", {
    acquiredAtUs: t0,
    expiresAtUs: t0 + ttl,
  });
  op("resign", [t0 + s, t0 + s + 1000], { key: e, runId: "c1", token: 20, client: 1 }, "ok");
  op(
    "campaign",
    [t0 + 0.2 * s, secondTermAt + 1000],
    { key: e, runId: "c2", token: options.secondTerm ?? 21, client: 2 },
    "ok",
    { acquiredAtUs: secondTermAt, expiresAtUs: secondTermAt + ttl },
  );
  const events: LeaseEvent[] = [
    { id: 1, type: "acquired", key, runId: "r1", token: 10, atUs: t0 + 0.6 * s },
    { id: 2, type: "acquired", key: e, runId: "c1", token: 20, atUs: t0 },
    { id: 3, type: "released", key: e, runId: "c1", token: 20, atUs: t0 + s + 500 },
    {
      id: 4,
      type: "acquired",
      key: e,
      runId: "c2",
      token: options.secondTerm ?? 21,
      atUs: secondTermAt,
    },
    { id: 5, type: "expired", key, runId: "r1", token: 10, atUs: t0 + 2.6 * s },
    { id: 6, type: "acquired", key, runId: "r2", token: 30, atUs: nextGrantAt },
  ];
  return { history, op, events };
}

const flagged = (history: HistoryEvent[], events: LeaseEvent[], invariant: string) =>
  checkOperations(history, events).violations.filter((v) => v.invariant === invariant);

describe("history checker: keepers and elections", () => {
  it("accepts a history that keeps K1, K2 and E1, and counts what it checked", () => {
    const { history, events } = scenario();
    const result = checkOperations(history, events);
    expect(result.violations.filter((v) => ["K1", "K2", "E1"].includes(v.invariant))).toEqual([]);
    expect(result.keepers).toMatchObject({
      keepers: 1,
      heartbeatsChecked: 2,
      keeperWritesChecked: 1,
      lockDelayChecked: 1,
      leaderships: 2,
      elections: 1,
    });
  });

  it("K1: flags a keeper renewed after its leases expired", () => {
    const { history, op, events } = scenario();
    op("keeper-heartbeat", [t0 + 2.7 * s, t0 + 2.7 * s + 500], { key: `keeper:${keeper}` }, "ok", {
      keeperId: keeper,
      expiresAtUs: t0 + 2.7 * s + ttl,
      ttlUs: ttl,
    });
    expect(flagged(history, events, "K1").map((v) => v.message)).toEqual([
      expect.stringContaining("was renewed at"),
    ]);
  });

  it("K1: flags a heartbeat sent after the keeper's close was answered", () => {
    const { history, op, events } = scenario();
    op("keeper-close", [t0 + 1.2 * s, t0 + 1.3 * s], { key: `keeper:${keeper}` }, "ok", undefined, {
      keeperId: keeper,
    });
    // A close answers with no value: the checker reads the keeper from the invocation too.
    expect(flagged(history, events, "K1")).toEqual([]);
    op("keeper-close", [t0 + 1.2 * s, t0 + 1.3 * s], { key: `keeper:${keeper}` }, "ok", {
      keeperId: keeper,
    });
    op("keeper-heartbeat", [t0 + 1.4 * s, t0 + 1.4 * s + 500], { key: `keeper:${keeper}` }, "ok", {
      keeperId: keeper,
      expiresAtUs: t0 + 1.4 * s + ttl,
      ttlUs: ttl,
    });
    expect(flagged(history, events, "K1").map((v) => v.message)).toEqual([
      expect.stringContaining("after its close or revoke was answered"),
    ]);
  });

  it("K1: flags a lease granted on a keeper after its leases expired", () => {
    const { history, op, events } = scenario();
    op(
      "keeper-acquire",
      [t0 + 2.8 * s, t0 + 2.8 * s + 500],
      { key: "acct/s2", runId: "r3", token: 31 },
      "ok",
      {
        keeperId: keeper,
        acquiredAtUs: t0 + 2.8 * s,
      },
    );
    expect(flagged(history, events, "K1").map((v) => v.message)).toEqual([
      expect.stringContaining("was granted on keeper"),
    ]);
  });

  it("K1: flags a keeper run's write sent after the keeper's deadline, unless its client was paused across it", () => {
    const { history, op, events } = scenario();
    op("write", [t0 + 2.55 * s, t0 + 2.56 * s], { key, runId: "r1", token: 10 }, "ok");
    expect(flagged(history, events, "K1").map((v) => v.message)).toEqual([
      expect.stringContaining("after the keeper's deadline"),
    ]);
    history.push({
      type: "info",
      process: "nemesis",
      f: "pause",
      client: 0,
      fromUs: t0 + 1.2 * s,
      toUs: t0 + 2.54 * s,
    });
    const result = checkOperations(history, events);
    expect(result.violations.filter((v) => v.invariant === "K1")).toEqual([]);
    expect(result.keepers.keeperWritesExcused).toBe(1);
  });

  it("K2: flags a grant of an expired keeper lease's key before the lock-delay passed", () => {
    // Deadline t0+2.5 s, delay 1 s: a grant at t0+3.4 s is too early.
    const early = scenario({ nextGrantAt: t0 + 3.4 * s });
    expect(flagged(early.history, early.events, "K2").map((v) => v.message)).toEqual([
      expect.stringContaining("before the lock-delay of keeper"),
    ]);
    // Released, not expired: no lock-delay applies.
    const released = scenario({ nextGrantAt: t0 + 3.4 * s });
    const events = released.events.map((e) =>
      e.type === "expired" ? { ...e, type: "released", atUs: t0 + 2 * s } : e,
    );
    expect(flagged(released.history, events, "K2")).toEqual([]);
  });

  it("E1: flags a term granted while the previous leader still led, and a term not above the previous", () => {
    // c1 resigned at t0+1 s; c2 granted at t0+0.9 s overlaps it.
    const overlap = scenario({ secondTermAt: t0 + 0.9 * s });
    expect(flagged(overlap.history, overlap.events, "E1").map((v) => v.message)).toEqual([
      expect.stringContaining("while term 20"),
    ]);
    const lower = scenario({ secondTerm: 19 });
    expect(flagged(lower.history, lower.events, "E1").map((v) => v.message)).toEqual([
      expect.stringContaining("term 19 (run c2) began after term 20"),
    ]);
  });

  it("E1: a leader's lost signal ends its interval, before its confirmed deadline", () => {
    const { history, events } = scenario({ secondTermAt: t0 + 0.9 * s });
    // Without the resign, c1 led until its deadline (t0+2 s) unless its signal aborted first.
    const withoutResign = history.filter((e) => e.f !== "resign");
    expect(flagged(withoutResign, events, "E1")).toHaveLength(1);
    withoutResign.push({
      type: "info",
      process: "signal",
      f: "lost",
      client: 1,
      key: "acct/e",
      runId: "c1",
      time: 0,
      wallUs: t0 + 0.8 * s,
      reason: "expired",
      deadlineUs: t0 + ttl,
    });
    expect(flagged(withoutResign, events, "E1")).toEqual([]);
  });

  it("S5: a keeper run's release on the stream, and its keeper's close, count as the run asking", () => {
    // The election's resign is its Release in a real history (recorded by the interceptor): only r1 counts here.
    const ofR1 = (h: HistoryEvent[], e: LeaseEvent[]) =>
      flagged(h, e, "S5").filter((v) => v.message.includes("r1"));
    const releasedEvents = (events: LeaseEvent[]): LeaseEvent[] => [
      ...events.filter((e) => e.runId !== "r1" || e.type === "acquired"),
      { id: 7, type: "released", key, runId: "r1", token: 10, atUs: t0 + 1.5 * s },
    ];
    const asked = scenario();
    expect(ofR1(asked.history, releasedEvents(asked.events))).toHaveLength(1);
    const closed = scenario();
    closed.op(
      "keeper-close-request",
      [t0 + 1.4 * s, t0 + 1.5 * s],
      { key: `keeper:${keeper}` },
      "ok",
      undefined,
      { keeperId: keeper },
    );
    expect(ofR1(closed.history, releasedEvents(closed.events))).toEqual([]);
    const released = scenario();
    released.op("keeper-release", [t0 + 1.4 * s, t0 + 1.5 * s], { key, runId: "r1" }, "ok", {
      released: true,
    });
    expect(ofR1(released.history, releasedEvents(released.events))).toEqual([]);
  });

  it("E1: a term held on a keeper lasts to the keeper's confirmed deadline", () => {
    const { history, op, events } = scenario();
    const e2 = "acct/e2";
    op("campaign", [t0, t0 + 1000], { key: e2, runId: "c3", token: 40, client: 3 }, "ok", {
      acquiredAtUs: t0,
      expiresAtUs: t0 + s,
    });
    op(
      "keeper-acquire",
      [t0, t0 + 500],
      { key: e2, runId: "c3", token: 40, client: 3 },
      "ok",
      { keeperId: keeper, acquiredAtUs: t0, expiresAtUs: t0 + s },
      { keeperId: keeper },
    );
    // The keeper's heartbeat confirmed t0+2.5 s: a term granted at t0+2 s overlaps c3's.
    op(
      "campaign",
      [t0 + 0.5 * s, t0 + 2 * s],
      { key: e2, runId: "c4", token: 41, client: 2 },
      "ok",
      {
        acquiredAtUs: t0 + 2 * s,
        expiresAtUs: t0 + 4 * s,
      },
    );
    expect(flagged(history, events, "E1").map((v) => v.message)).toEqual([
      expect.stringContaining("term 41 (run c4) began at"),
    ]);
  });
});
