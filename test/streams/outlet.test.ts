// The Watch hub's fan-out pacing (streams/outlet.ts createSliceScheduler):
// one change makes every watcher of its scope ready in the same turn, and
// writing to thousands of them at once would stall the event loop.

import { describe, expect, it } from "vitest";
import { createSliceScheduler } from "../../src/server/streams/outlet.js";
import { waitFor } from "../support/wait.js";

describe("slice scheduler", () => {
  it("runs the first slice once the scheduling code is done and each next one after a turn of the event loop; work scheduled twice runs once", async () => {
    const schedule = createSliceScheduler(256);
    let turn = 0;
    const ranAt: number[] = [];
    const works = Array.from({ length: 600 }, () => () => {
      ranAt.push(turn);
    });
    const nextTurn = () => {
      turn++;
      if (ranAt.length < works.length) setImmediate(nextTurn);
    };
    setImmediate(nextTurn);
    for (const work of works) schedule(work);
    schedule(works[0] as () => void);
    expect(ranAt).toEqual([]);
    await waitFor(() => ranAt.length === works.length, { what: "every work to run" });
    const perTurn = [...new Set(ranAt)].map((t) => ranAt.filter((r) => r === t).length);
    expect(perTurn).toEqual([256, 256, 88]);
    expect(ranAt[0]).toBe(0);
    // Nothing more runs: work 0 was scheduled twice before it ran.
    await new Promise((resolve) => setImmediate(resolve));
    expect(ranAt).toHaveLength(works.length);
  });
});
