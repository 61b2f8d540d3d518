// Makes the Python client's venv (clients/python/.venv, from its lock; kept
// when the lock has not changed: the Python worker and the pytest suites run
// in it) and builds the Go worker (on the Go client module, clients/go)
// before the polyglot tests, so that they always run against stubs made from
// proto/ as it is now. The toolchains themselves are installed or checked by
// examples/install-toolchains.sh (`pretest:polyglot`).

import { spawn } from "node:child_process";
import { once } from "node:events";
import { repoRoot } from "../support/server-process.js";

const scripts = ["clients/python/scripts/setup.sh", "examples/go/build.sh"];

export async function setup(): Promise<void> {
  for (const script of scripts) {
    const started = performance.now();
    const child = spawn("bash", [script], { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] });
    let output = "";
    child.stdout.on("data", (chunk: Buffer) => {
      output += chunk.toString();
    });
    child.stderr.on("data", (chunk: Buffer) => {
      output += chunk.toString();
    });
    const [code] = (await once(child, "exit")) as [number | null];
    if (code !== 0) {
      throw new Error(`${script} failed with exit status ${code}:\n${output}`);
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    process.stdout.write(`${output.trim()} (${seconds} s)\n`);
  }
}
