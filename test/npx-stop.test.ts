// The long-running commands the docs start with npx stop, with everything
// they started, on a SIGTERM to npx. npx (npm exec) does not pass the signal
// on: before, `npx leasehold guarded serve` kept serving with its PostgreSQL,
// and `npx leasehold watch` kept watching, both orphaned.

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync } from "node:fs";
import { readdir, readFile, rm } from "node:fs/promises";
import net from "node:net";
import path from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { freePort, lockFileOf, makeDataParent } from "../src/postgres/embedded-postgres.js";
import { useTestServer } from "./support/fixture.js";
import { repoRoot } from "./support/server-process.js";
import { waitFor } from "./support/wait.js";

const { server } = useTestServer();
const dirs: string[] = [];
const leftovers: number[] = [];
afterAll(async () => {
  for (const pid of leftovers) if (alive(pid)) process.kill(pid, "SIGKILL");
  for (const dir of dirs) await rm(dir, { recursive: true, force: true });
});

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

async function portFree(port: number): Promise<boolean> {
  const server = net.createServer();
  const ok = await new Promise<boolean>((resolve) => {
    server.once("error", () => resolve(false));
    server.listen(port, "127.0.0.1", () => resolve(true));
  });
  if (ok) await new Promise((resolve) => server.close(resolve));
  return ok;
}

/** The pid of the process whose command line contains `marker` (the CLI under npx and its shell). */
async function pidWith(marker: string): Promise<number | undefined> {
  for (const entry of await readdir("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    const command = await readFile(`/proc/${entry}/cmdline`, "utf8").catch(() => "");
    const argv = command.split("\0");
    // The node process itself, not npm's nor the shell's.
    if (argv[0]?.endsWith("node") && argv.includes(marker)) return Number(entry);
  }
  return undefined;
}

function npx(
  args: string[],
  env: NodeJS.ProcessEnv,
): { child: ChildProcess; output: () => string } {
  const child = spawn("npx", ["leasehold", ...args], {
    cwd: repoRoot,
    env: { ...process.env, LEASEHOLD_LOG_LEVEL: "warn", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  child.stdout?.on("data", (chunk: Buffer) => {
    output += chunk.toString();
  });
  child.stderr?.on("data", (chunk: Buffer) => {
    output += chunk.toString();
  });
  return { child, output: () => output };
}

describe("SIGTERM to npx stops the command it started, with everything that command started", () => {
  it("`npx leasehold guarded serve`: the store, its PostgreSQL and its port are gone", async () => {
    const parent = await makeDataParent("leasehold-npx-");
    dirs.push(parent);
    const data = path.join(parent, "pgdata");
    const port = await freePort();
    const { child, output } = npx(
      [
        "guarded",
        "serve",
        "--listen",
        `127.0.0.1:${port}`,
        "--data-dir",
        data,
        "--lease-url",
        "http://127.0.0.1:9",
      ],
      { DATABASE_URL: "" },
    );
    await waitFor(() => output().includes("serving on"), {
      what: "the guarded store to serve",
      timeoutMs: 60_000,
    });
    const storePid = Number((await readFile(lockFileOf(data), "utf8")).trim());
    const postgresPid = Number(
      (await readFile(path.join(data, "postmaster.pid"), "utf8")).split("\n")[0],
    );
    leftovers.push(storePid, postgresPid);
    expect(storePid).not.toBe(child.pid);

    child.kill("SIGTERM");
    await once(child, "exit");
    await waitFor(() => !alive(storePid) && !alive(postgresPid), {
      what: `the store (pid ${storePid}) and its PostgreSQL (pid ${postgresPid}) to exit`,
    });
    expect(await portFree(port)).toBe(true);
    expect(existsSync(lockFileOf(data))).toBe(false);
    expect(existsSync(path.join(data, "postmaster.pid"))).toBe(false);
  });

  it("`npx leasehold watch`: the watch is gone", async () => {
    // An account name no other process has: it finds this watch among all.
    const marker = `npx-watch-${process.pid}-${Date.now()}`;
    const { child, output } = npx(["watch", "--account", marker, "--server", server.url], {});
    await waitFor(() => output().includes("SNAPSHOT"), { what: "the watch's snapshot" });
    const watchPid = await waitFor(() => pidWith(marker), { what: "the watch's process" });
    leftovers.push(watchPid);
    child.kill("SIGTERM");
    await once(child, "exit");
    await waitFor(() => !alive(watchPid), { what: `the watch (pid ${watchPid}) to exit` });
  });
});
