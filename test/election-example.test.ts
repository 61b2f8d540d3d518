// examples/typescript/election.ts as real processes: two replicas, one leads;
// when it is interrupted the other takes over with a higher term.

import { type ChildProcess, spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { describe, expect, it } from "vitest";
import { useTestServer } from "./support/fixture.js";
import { repoRoot } from "./support/server.js";
import { within } from "./support/wait.js";

const { server, defer } = useTestServer();

function replica(name: string, election: string) {
  const child: ChildProcess = spawn(
    process.execPath,
    [
      ...["--import", "tsx", "examples/typescript/election.ts"],
      ...["--server", server.url, "--election", election, "--name", name],
    ],
    { cwd: repoRoot, stdio: ["ignore", "pipe", "inherit"] },
  );
  defer(() => child.kill("SIGKILL"));
  const lines: string[] = [];
  const waiting: { match: RegExp; resolve: (line: string) => void }[] = [];
  createInterface({ input: child.stdout as NodeJS.ReadableStream }).on("line", (line) => {
    lines.push(line);
    for (const w of [...waiting]) {
      if (w.match.test(line)) {
        waiting.splice(waiting.indexOf(w), 1);
        w.resolve(line);
      }
    }
  });
  const line = (match: RegExp) => {
    const found = lines.find((l) => match.test(l));
    if (found !== undefined) return Promise.resolve(found);
    return within(new Promise<string>((resolve) => waiting.push({ match, resolve })), {
      what: `${name} to print ${match}`,
    });
  };
  const exited = new Promise<number | null>((resolve) => child.once("exit", resolve));
  return { child, line, lines, exited };
}

describe("examples/typescript/election.ts", () => {
  it("E1: one of two replicas leads; interrupted, it stops leading and the other leads with a higher term", async () => {
    const election = `example-${process.pid}-${Date.now()}`;
    const a = replica("a", election);
    const firstTerm = BigInt((await a.line(/^a: leading, term \d+$/)).split(" ").at(-1) ?? "0");
    const b = replica("b", election);
    await b.line(/^b: the leader is a, term \d+$/);
    a.child.kill("SIGINT");
    await a.line(new RegExp(`^a: stopped leading term ${firstTerm} \\(`));
    expect(await a.exited).toBe(0);
    const next = BigInt((await b.line(/^b: leading, term \d+$/)).split(" ").at(-1) ?? "0");
    expect(next).toBeGreaterThan(firstTerm);
    b.child.kill("SIGINT");
    expect(await b.exited).toBe(0);
    expect(b.lines).toContain(`b: stopped leading term ${next} (cancelled)`);
  });
});
