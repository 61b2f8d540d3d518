// The client library as a user gets it: `npm pack ./packages/client`, the
// tarball installed into an empty project that has nothing else, and a plain
// ES module there that imports "@leasehold/client" and runs runExclusive
// against a real server. Proves the package is complete (its compiled
// generated code and protocol module included), that it pulls in only what
// the client needs, and that its work stops when the lease is lost (L2).

import { type ChildProcess, execFile, spawn } from "node:child_process";
import { mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { repoRoot } from "./support/server-process.js";

const run = promisify(execFile);

const script = `
import { createLeaseClient } from "@leasehold/client";
const [url, accountId, sessionId, mode] = process.argv.slice(2);
const say = (event) => process.stdout.write(JSON.stringify(event) + "\\n");
const client = createLeaseClient({ baseUrls: [url] });
try {
  const result = await client.runExclusive(
    { accountId, sessionId },
    async ({ signal, fencingToken, lease }) => {
      say({ event: "holding", fencingToken: String(fencingToken), runId: lease.runId });
      if (mode === "finish") return "done";
      await new Promise((resolve) => signal.addEventListener("abort", resolve, { once: true }));
      say({ event: "aborted", lossReason: signal.reason?.lossReason ?? String(signal.reason) });
      return "stopped";
    },
    { ttlMs: 3000, holder: "packaged" },
  );
  say({ event: "result", result });
} catch (error) {
  say({ event: "error", name: error.name, message: error.message });
} finally {
  client.close();
}
`;

const { server, client } = useTestServer();
let project: string;
let dir: string | undefined;

beforeAll(async () => {
  dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-client-package-"));
  const { stdout } = await run("npm", ["pack", "./packages/client", "--pack-destination", dir], {
    cwd: repoRoot,
  });
  const tarball = path.join(dir, stdout.trim().split("\n").at(-1) ?? "");
  project = path.join(dir, "project");
  await run("mkdir", ["-p", project]);
  await writeFile(
    path.join(project, "package.json"),
    JSON.stringify({ name: "uses-leasehold-client", private: true, type: "module" }),
  );
  await run("npm", ["install", tarball, "--prefer-offline", "--no-audit", "--no-fund"], {
    cwd: project,
  });
  await writeFile(path.join(project, "worker.mjs"), script);
}, 120_000);
afterAll(async () => {
  if (dir !== undefined) await rm(dir, { recursive: true, force: true });
});

/** Starts the packaged worker; yields its JSON lines as they come. */
function startWorker(key: { accountId: string; sessionId: string }, mode: "finish" | "hold") {
  const child: ChildProcess = spawn(
    process.execPath,
    ["worker.mjs", server.url, key.accountId, key.sessionId, mode],
    { cwd: project, stdio: ["ignore", "pipe", "inherit"] },
  );
  const lines = createInterface({ input: child.stdout as NodeJS.ReadableStream });
  const iterator = lines[Symbol.asyncIterator]();
  return {
    async next(): Promise<Record<string, string>> {
      const { value, done } = await iterator.next();
      if (done) throw new Error("the worker ended without another line");
      return JSON.parse(value) as Record<string, string>;
    },
    exited: new Promise<number | null>((resolve) => child.once("exit", resolve)),
  };
}

describe("the packaged client (@leasehold/client)", () => {
  it("installs with only the client's dependencies", async () => {
    const installed = await readdir(path.join(project, "node_modules"));
    const scoped = async (scope: string) =>
      (await readdir(path.join(project, "node_modules", scope))).map((n) => `${scope}/${n}`);
    const packages = [
      ...installed.filter((n) => !n.startsWith("@") && !n.startsWith(".")),
      ...(await Promise.all(installed.filter((n) => n.startsWith("@")).map(scoped))).flat(),
    ].sort();
    expect(packages).toEqual([
      "@bufbuild/protobuf",
      "@connectrpc/connect",
      "@connectrpc/connect-node",
      "@leasehold/client",
    ]);
    const manifest = JSON.parse(
      await readFile(path.join(project, "node_modules/@leasehold/client/package.json"), "utf8"),
    ) as { dependencies: Record<string, string> };
    expect(Object.keys(manifest.dependencies).sort()).toEqual([
      "@bufbuild/protobuf",
      "@connectrpc/connect",
      "@connectrpc/connect-node",
    ]);
  });

  it("S6: runExclusive holds the lease while its work runs and releases it after", async () => {
    const key = freshKey("pkg");
    const worker = startWorker(key, "finish");
    const holding = await worker.next();
    expect(holding.event).toBe("holding");
    expect(BigInt(holding.fencingToken ?? "0")).toBeGreaterThan(0n);
    expect(await worker.next()).toEqual({ event: "result", result: "done" });
    expect(await worker.exited).toBe(0);
    expect((await client.get({ key })).held).toBe(false);
    const history = await client.history({ key, pageSize: 10 });
    expect(history.events.map((e) => [e.type, e.runId])).toEqual([
      [EventType.RELEASED, holding.runId],
      [EventType.ACQUIRED, holding.runId],
    ]);
  });

  it("L2: the work's signal aborts when the lease is revoked", async () => {
    const key = freshKey("pkg");
    const worker = startWorker(key, "hold");
    const holding = await worker.next();
    expect(holding.event).toBe("holding");
    const revoked = await client.revoke({ key, reason: "package test" });
    expect(revoked.revoked).toBe(true);
    expect(await worker.next()).toEqual({ event: "aborted", lossReason: "revoked" });
    expect(await worker.next()).toEqual({ event: "result", result: "stopped" });
    expect(await worker.exited).toBe(0);
  });
});
