// The Go client library (clients/go) proven against real servers: this file
// makes the databases (the lease servers', the guarded store's, and one for
// the Go fence interceptor, all migrated) and runs `go test -race ./...` in
// clients/go, whose tests start `leasehold serve` and `leasehold guarded
// serve` on them as they need (several instances, flags of their own, an
// instance stopped mid-hold). Their output is shown; a failed Go test fails
// this one.

import { spawn } from "node:child_process";
import { once } from "node:events";
import path from "node:path";
import { expect, it } from "vitest";
import { useTestDatabase } from "../support/fixture.js";
import { cliPath, repoRoot } from "../support/server-process.js";

const { db, anotherDatabase } = useTestDatabase();

it("the Go client's stories (go test -race ./... in clients/go) pass against real servers and PostgreSQL", async () => {
  const [store, fence] = await Promise.all([anotherDatabase(), anotherDatabase()]);
  const child = spawn("go", ["test", "-count=1", ...goTestFlags(), "./..."], {
    cwd: path.join(repoRoot, "clients/go"),
    env: {
      ...process.env,
      LEASEHOLD_TEST_LEASE_DATABASE_URL: db.url,
      LEASEHOLD_TEST_STORE_DATABASE_URL: store.url,
      LEASEHOLD_TEST_FENCE_DATABASE_URL: fence.url,
      LEASEHOLD_TEST_NODE: process.execPath,
      LEASEHOLD_TEST_CLI: cliPath,
    },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  const collect = (chunk: Buffer) => {
    output += chunk.toString();
  };
  child.stdout.on("data", collect);
  child.stderr.on("data", collect);
  const [code] = (await once(child, "exit")) as [number | null];
  process.stdout.write(`${output.trim()}\n`);
  expect(code, `go test failed:\n${output}`).toBe(0);
}, 900_000);

/**
 * `go test`'s flags: `-race`, or LEASEHOLD_GO_TEST_FLAGS instead (e.g.
 * "-race -v -run TestRace" to work on one test, or the benchmarks' flags in
 * clients/go/measure_test.go, which run without the race detector).
 */
function goTestFlags(): string[] {
  const flags = process.env.LEASEHOLD_GO_TEST_FLAGS ?? "-race";
  return flags.split(/\s+/).filter((f) => f !== "");
}
