// The README's 30-second tour, run as written against a fresh server: every
// `$ npx leasehold …` line of its console block runs (as node
// bin/leasehold.js) and prints what the block shows below it, ids, times and
// durations aside; `$ echo $?` lines are the exit status. So the tour cannot
// drift from what a user sees (it once showed token=2 where a user sees 3:
// the refused acquire uses up a token, S6). Also what the README says about
// running `npx leasehold` inside the clone and after `npm link`.

import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { promisify } from "node:util";
import { describe, expect, it } from "vitest";
import { runCli, startCli } from "./support/cli.js";
import { useTestServer } from "./support/fixture.js";
import { repoRoot } from "./support/server.js";
import { waitFor } from "./support/wait.js";

const { server, defer } = useTestServer();
const exec = promisify(execFile);

interface Step {
  command: string;
  argv: string[];
  /** The lines the README shows below the command. */
  expected: string[];
  /** The status of a following `$ echo $?`; 0 when none follows. */
  exit: number;
  /** A command the README has run in another terminal while this one runs (watch). */
  meanwhile: string[] | undefined;
}

/** Words of a command line, as a POSIX shell splits them (single quotes only, which the tour uses). */
function words(line: string): string[] {
  return (line.match(/'[^']*'|[^\s']+/g) ?? []).map((w) =>
    w.startsWith("'") ? w.slice(1, -1) : w,
  );
}

/** The command after `npx leasehold`, without a trailing `# comment`. */
function leaseholdArgs(line: string): string[] {
  return words(line.replace(/\s+#\s.*$/, "")).slice(2);
}

function tourSteps(readme: string): Step[] {
  const section = readme.slice(readme.indexOf("## A 30-second tour"));
  const block = /```console\n([\s\S]*?)```/.exec(section)?.[1];
  if (block === undefined) throw new Error("README: no console block in the tour");
  const steps: Step[] = [];
  let current: Step | undefined;
  let meanwhile: string[] | undefined;
  let exitNext = false;
  for (const line of block.split("\n")) {
    if (exitNext) {
      if (current) current.exit = Number(line);
      exitNext = false;
    } else if (line === "$ echo $?") {
      exitNext = true;
    } else if (line.startsWith("$ npx leasehold ")) {
      current = {
        command: line,
        argv: leaseholdArgs(line.slice(2)),
        expected: [],
        exit: 0,
        meanwhile,
      };
      meanwhile = undefined;
      steps.push(current);
    } else if (line.startsWith("# npx leasehold ")) {
      meanwhile = leaseholdArgs(line.slice(2));
    } else if (line.startsWith("$ ")) {
      throw new Error(`README tour: a command this test cannot run: ${line}`);
    } else if (line.startsWith("#") || line === "") {
      current = undefined;
    } else if (current) {
      current.expected.push(line);
    }
  }
  return steps;
}

/** A line with what differs from run to run replaced: ids, times, durations, the host name. */
function normalise(line: string): string {
  return line
    .replaceAll(JSON.stringify(os.hostname()), '"my-host"')
    .replace(/\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z/g, "<time>")
    .replace(/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/g, "<run>")
    .replace(/\b\d+\.\ds\b/g, "<duration>")
    .replace(/\s+/g, " ")
    .trim();
}

const outputLines = (text: string) => text.split("\n").filter((l) => l !== "");

describe("the README's tour", () => {
  const steps = tourSteps(readFileSync(path.join(repoRoot, "README.md"), "utf8"));

  it("has the commands the tour is about", () => {
    expect(steps.map((s) => s.argv[0])).toEqual([
      "acquire",
      "acquire",
      "list",
      "run",
      "watch",
      "history",
    ]);
  });

  it("S6: each command prints what the README shows, on a fresh server", async () => {
    const env = { LEASEHOLD_SERVER: server.url };
    for (const step of steps) {
      let printed: string[];
      let code: number | null;
      if (step.meanwhile) {
        const running = startCli(step.argv, env);
        await running.line(/SNAPSHOT/);
        const other = await runCli(step.meanwhile, env);
        expect(other.code, other.stderr).toBe(0);
        await waitFor(() => running.lines.length >= step.expected.length, {
          what: `${step.command} to print ${step.expected.length} lines`,
        });
        running.child.kill("SIGINT");
        const result = await running.exited;
        printed = outputLines(result.stdout);
        code = result.code;
      } else {
        const result = await runCli(step.argv, env);
        printed = outputLines(result.stdout);
        code = result.code;
      }
      expect(printed.map(normalise), step.command).toEqual(step.expected.map(normalise));
      expect(code, step.command).toBe(step.exit);
    }
  });
});

describe("where `npx leasehold` works (README)", () => {
  it("inside the clone, npx leasehold runs this checkout's command", async () => {
    const { stdout } = await exec("npx", ["--no-install", "leasehold", "--help"], {
      cwd: repoRoot,
    });
    expect(stdout).toMatch(/^Usage: leasehold <command>/);
  });

  it("after npm link, `leasehold` works from any folder", async () => {
    // A prefix of its own, so the test leaves the machine's global folder alone.
    const prefix = await mkdtemp(path.join(os.tmpdir(), "leasehold-link-"));
    defer(() => rm(prefix, { recursive: true, force: true }));
    const npmEnv = { ...process.env, npm_config_prefix: prefix };
    await exec("npm", ["link", "--ignore-scripts", "--no-audit", "--no-fund"], {
      cwd: repoRoot,
      env: npmEnv,
    });
    const { stdout } = await exec(
      path.join(prefix, "bin", "leasehold"),
      ["get", "--account", "acme", "--session", "s1"],
      { cwd: os.tmpdir(), env: { ...process.env, LEASEHOLD_SERVER: server.url } },
    );
    expect(stdout).toMatch(/^acme\/s1 is (held by|free)/);
  });
});
