// A live server's /metrics, linted by Prometheus's own promtool: names
// follow the conventions (counters end in _total and nothing else does,
// units in names, snake_case, no repeated words such as process_process_).

import { execFile } from "node:child_process";
import { describe, expect, it } from "vitest";
import { useTestServer } from "../support/fixture.js";
import { freshKey } from "../support/leases.js";

const { server, library } = useTestServer();

function promtool(input: string): Promise<{ code: number; output: string }> {
  return new Promise((resolve, reject) => {
    const child = execFile("promtool", ["check", "metrics"], (error, stdout, stderr) => {
      if (error && typeof error.code !== "number") {
        reject(error);
        return;
      }
      resolve({ code: typeof error?.code === "number" ? error.code : 0, output: stdout + stderr });
    });
    child.stdin?.end(input);
  });
}

describe("/metrics and Prometheus's conventions", () => {
  it("promtool check metrics finds nothing to say about a server that has done some work", async () => {
    // Every labelled series appears once it has counted something.
    await library.runExclusive(freshKey("promtool"), async () => {}, { ttlMs: 5_000 });
    const res = await fetch(`${server.url}/metrics`);
    expect(res.status).toBe(200);
    const text = await res.text();
    expect(text).toContain("leasehold_lease_grants_total");
    const { code, output } = await promtool(text);
    expect(output).toBe("");
    expect(code).toBe(0);
    // The names a dashboard might have used before: docs/operations.md lists them.
    expect(text).not.toMatch(/^leasehold_process_(process|nodejs)_/m);
    expect(text).toMatch(/^leasehold_process_cpu_seconds_total /m);
  });
});
