// A test run leaves nothing behind in the temporary folder (some of what
// tests write there is secret: signing keys). Every test process of a run
// gets one folder of its own as TMPDIR (os.tmpdir() reads it), so what
// other runs on the machine write does not count; at the end of the run,
// any `leasehold-*` entry still in it fails the run with its name, and the
// folder is removed.
//
// Both projects of `npm test` list this global setup; the first sets the
// folder up and the last teardown checks it.

import { chmod, mkdtemp, readdir, rm } from "node:fs/promises";
import os from "node:os";
import path from "node:path";

const variable = "LEASEHOLD_TEST_RUN_TMPDIR";
// How many projects' setups hold the folder. Each project loads this module
// on its own, so the count lives in the main process's environment.
const usersVariable = "LEASEHOLD_TEST_RUN_TMPDIR_USERS";

function users(change: number): number {
  const count = Number(process.env[usersVariable] ?? "0") + change;
  process.env[usersVariable] = String(count);
  return count;
}

export async function setup(): Promise<void> {
  users(1);
  if (process.env[variable] !== undefined) return;
  const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-run-"));
  // As root, the embedded PostgreSQL runs as `postgres`, who must pass
  // through it to the data folders the tests make in it.
  await chmod(dir, 0o711);
  process.env[variable] = dir;
  process.env.TMPDIR = dir;
}

export async function teardown(): Promise<void> {
  const dir = process.env[variable];
  if (users(-1) > 0 || dir === undefined) return;
  const left = (await readdir(dir)).filter((name) => name.startsWith("leasehold-"));
  await rm(dir, { recursive: true, force: true });
  if (left.length > 0) {
    // Vitest reports an error thrown here but keeps its exit status: the
    // status is set too, so that the run fails.
    process.exitCode = 1;
    throw new Error(
      `the test run left these in the temporary folder (each test removes what it makes): ${left.join(", ")}`,
    );
  }
}
