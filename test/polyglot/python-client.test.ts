// The Python client library (clients/python) proven by its own pytest
// suites against real servers: this file gives them fresh databases on the
// run's PostgreSQL (embedded, from the global setup) and runs pytest in
// clients/python's venv (made by clients/python/scripts/setup.sh in the
// build setup). The suites start `leasehold serve` and `leasehold guarded
// serve` themselves (their fixtures), so a story can stop an instance or
// put a TCP proxy in front of it. pytest's output is shown when it fails.

import { spawn } from "node:child_process";
import { once } from "node:events";
import path from "node:path";
import { expect, it } from "vitest";
import { useTestDatabase } from "../support/fixture.js";
import { repoRoot } from "../support/server-process.js";

const { db, anotherDatabase } = useTestDatabase();
const python = path.join(repoRoot, "clients/python/.venv/bin/python");

it("the Python client's pytest suites pass (blocking and asyncio clients, fencing interceptor)", async () => {
  const [storeDb, fenceDb] = await Promise.all([anotherDatabase(), anotherDatabase()]);
  const child = spawn(python, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], {
    cwd: path.join(repoRoot, "clients/python"),
    env: {
      ...process.env,
      LEASEHOLD_TEST_DATABASE_URL: db.url,
      LEASEHOLD_TEST_STORE_DATABASE_URL: storeDb.url,
      LEASEHOLD_TEST_FENCE_DATABASE_URL: fenceDb.url,
      LEASEHOLD_TEST_NODE: process.execPath,
    },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  child.stdout.on("data", (chunk: Buffer) => {
    output += chunk.toString();
  });
  child.stderr.on("data", (chunk: Buffer) => {
    output += chunk.toString();
  });
  const [code] = (await once(child, "exit")) as [number | null];
  const summary = output.trim().split("\n").at(-1) ?? "";
  process.stdout.write(`pytest clients/python/tests: ${summary}\n`);
  if (code !== 0) expect.fail(`pytest failed (exit ${code}):\n${output}`);
}, 900_000);
