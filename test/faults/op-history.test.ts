// The history recorder keeps Jepsen's rule: a process does one operation at
// a time, and an operation whose outcome is unknown retires its process.

import { describe, expect, it } from "vitest";
import { createRecorder, type OpEvent } from "./op-history.js";

function recorder(client = 1) {
  const events: OpEvent[] = [];
  const r = createRecorder({
    client,
    stride: 4,
    originNs: process.hrtime.bigint(),
    emit: (e) => events.push(e),
  });
  return { r, events };
}

describe("history recorder", () => {
  it("an `info` completion retires its process; `ok` and `fail` free it for the next operation", () => {
    const { r, events } = recorder();
    r.invoke("get", { key: "a/b" }).complete({ type: "ok" });
    r.invoke("get", { key: "a/b" }).complete({ type: "fail", error: { code: "Aborted" } });
    r.invoke("get", { key: "a/b" }).complete({ type: "info", error: { code: "Unavailable" } });
    r.invoke("get", { key: "a/b" }).complete({ type: "ok" });
    // Client 1 of 4: processes 1, 5, 9, …; 1 is retired by the info.
    expect(events.map((e) => [e.type, e.process])).toEqual([
      ["invoke", 1],
      ["ok", 1],
      ["invoke", 1],
      ["fail", 1],
      ["invoke", 1],
      ["info", 1],
      ["invoke", 5],
      ["ok", 5],
    ]);
  });

  it("concurrent operations never share a process, and times do not go back", () => {
    const { r, events } = recorder(2);
    const first = r.invoke("keepalive", { key: "a/b", runId: "A" });
    const second = r.invoke("write", { key: "a/b", runId: "A", token: 7 });
    expect(second.process).not.toBe(first.process);
    second.complete({ type: "ok" });
    first.complete({ type: "ok", token: 7 });
    expect(() => first.complete({ type: "ok" })).toThrow(/completed twice/);
    expect(new Set(events.map((e) => e.process % 4))).toEqual(new Set([2]));
    const times = events.map((e) => e.time);
    expect(times).toEqual([...times].sort((a, b) => a - b));
  });

  it("run() completes with the answer, or with the error's outcome and throws it on", async () => {
    const { r, events } = recorder(0);
    await r.run(
      "get",
      { key: "a/b" },
      async () => 3,
      (n) => ({ type: "ok", token: n }),
      () => ({ type: "info" }),
    );
    await expect(
      r.run(
        "get",
        { key: "a/b" },
        async () => {
          throw new Error("lost");
        },
        () => ({ type: "ok" }),
        () => ({ type: "info", error: { code: "Unavailable" } }),
      ),
    ).rejects.toThrow("lost");
    expect(events.map((e) => [e.type, e.token, e.error?.code])).toEqual([
      ["invoke", undefined, undefined],
      ["ok", 3, undefined],
      ["invoke", undefined, undefined],
      ["info", undefined, "Unavailable"],
    ]);
  });
});
