// The HA stack of deploy/ha on loopback: three etcd 3.4 members, three
// Patroni 3.0.2 members running PostgreSQL 15 (deploy/ha/patroni.yml, with
// the per-member addresses and folders given through Patroni's environment
// overrides), HAProxy 2.6 (deploy/ha/haproxy.cfg, its addresses rewritten to
// the members' loopback ports), three `leasehold serve` instances and a
// guarded store whose DATABASE_URL is HAProxy. Every fault of the HA suite
// is a method here.
//
// PostgreSQL refuses to run as root, so Patroni (and through it every
// PostgreSQL process) runs as the `postgres` user, in folders this module
// creates for it under one temporary folder and hands to that user; nothing
// else on the host changes owner or mode.

import { type ChildProcess, execFile, spawn } from "node:child_process";
import { once } from "node:events";
import { createWriteStream } from "node:fs";
import { chmod, chown, cp, mkdir, mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { promisify } from "node:util";
import postgres from "postgres";
import { freePort } from "../../src/postgres/embedded-postgres.js";
import { allMigrationSets, migrate } from "../../src/postgres/migrate.js";
import {
  repoRoot,
  type ServerProcess,
  spawnGuardedServer,
  spawnServer,
} from "../support/server.js";
import { waitFor } from "../support/wait.js";

const run = promisify(execFile);
const deployDir = path.join(repoRoot, "deploy", "ha");
export const superuserPassword = "ha-superuser";
const leaseholdPassword = "ha-leasehold";
const databaseName = "leasehold";

/** What Patroni's REST API says of one member (GET /patroni). */
export interface MemberStatus {
  state: string;
  role: string;
  timeline?: number;
}

export interface Member {
  readonly name: string;
  readonly pgPort: number;
  readonly apiPort: number;
  readonly dataDir: string;
  readonly configFile: string;
  patroni: ChildProcess;
}

export interface EtcdMember {
  readonly name: string;
  readonly clientPort: number;
  readonly peerPort: number;
  process: ChildProcess;
}

export interface LeaseInstance {
  readonly index: number;
  readonly url: string;
  process: ServerProcess;
}

export interface HaStack {
  readonly dir: string;
  readonly members: Member[];
  readonly etcd: EtcdMember[];
  /** The lease servers' database URL: HAProxy's port. */
  readonly databaseUrl: string;
  readonly instances: LeaseInstance[];
  readonly guardedUrl: string;
  /** A member's database, directly (not through HAProxy), as the superuser. */
  directUrl(member: Member, database?: string): string;
  status(member: Member): Promise<MemberStatus | undefined>;
  /** The member Patroni's REST API calls primary (GET /primary answers 200), if exactly one does. */
  primary(): Promise<Member | undefined>;
  member(name: string): Member;
  /** The postmaster's pid, from its postmaster.pid. */
  postmasterPid(member: Member): Promise<number>;
  /** Every process of a member: Patroni, the postmaster and its children. */
  processesOf(member: Member): Promise<number[]>;
  /** Starts a member's Patroni again (after a SIGKILL), as systemd would. */
  restartPatroni(member: Member): Promise<void>;
  patronictl(args: string[]): Promise<string>;
  /** The etcd member that is the raft leader, by etcdctl endpoint status of each member. */
  etcdLeader(): Promise<EtcdMember | undefined>;
  etcdHealthy(member: EtcdMember): Promise<boolean>;
  killEtcd(member: EtcdMember): Promise<void>;
  startEtcd(member: EtcdMember): Promise<void>;
  /** HAProxy stopped (every connection through it cut) and started again on its port. */
  restartHaproxy(): Promise<number>;
  close(): Promise<void>;
}

function descendants(pid: number, table: Map<number, number[]>): number[] {
  const out: number[] = [];
  for (const child of table.get(pid) ?? []) out.push(child, ...descendants(child, table));
  return out;
}

/** Parent → children of every process, from /proc. */
async function processTable(): Promise<Map<number, number[]>> {
  const { stdout } = await run("ps", ["-e", "-o", "pid=,ppid="]);
  const table = new Map<number, number[]>();
  for (const line of stdout.trim().split("\n")) {
    const [pid, ppid] = line.trim().split(/\s+/).map(Number);
    if (pid === undefined || ppid === undefined) continue;
    table.set(ppid, [...(table.get(ppid) ?? []), pid]);
  }
  return table;
}

async function userIds(name: string): Promise<{ uid: number; gid: number }> {
  const [uid, gid] = await Promise.all([
    run("id", ["-u", name]).then((r) => Number(r.stdout.trim())),
    run("id", ["-g", name]).then((r) => Number(r.stdout.trim())),
  ]);
  return { uid, gid };
}

const exited = (child: ChildProcess) =>
  child.exitCode !== null || child.signalCode !== null
    ? Promise.resolve()
    : once(child, "exit").then(() => undefined);

export async function startHaStack(options: { log?: (line: string) => void } = {}) {
  const log = options.log ?? (() => {});
  const postgresUser = await userIds("postgres");
  // Under /tmp, which every user may traverse; the folder itself is ours,
  // made traversable (not readable) so the postgres user reaches its own
  // folders inside it.
  const dir = await mkdtemp("/tmp/leasehold-ha-");
  await chmod(dir, 0o711);
  const logs = path.join(dir, "logs");
  await mkdir(logs);
  const logFile = (name: string) => createWriteStream(path.join(logs, `${name}.log`));

  // etcd: three members on loopback.
  const etcd: EtcdMember[] = [];
  for (let i = 1; i <= 3; i++) {
    etcd.push({
      name: `etcd${i}`,
      clientPort: await freePort(),
      peerPort: await freePort(),
      process: undefined as unknown as ChildProcess,
    });
  }
  const initialCluster = etcd.map((m) => `${m.name}=http://127.0.0.1:${m.peerPort}`).join(",");
  const etcdEndpoints = etcd.map((m) => `127.0.0.1:${m.clientPort}`);
  const etcdSettings = await readFile(path.join(deployDir, "etcd.conf"), "utf8");
  const etcdTimings = {
    heartbeat: /ETCD_HEARTBEAT_INTERVAL="(\d+)"/.exec(etcdSettings)?.[1] ?? "100",
    election: /ETCD_ELECTION_TIMEOUT="(\d+)"/.exec(etcdSettings)?.[1] ?? "1000",
  };
  const startEtcd = async (member: EtcdMember, state: "new" | "existing") => {
    const dataDir = path.join(dir, member.name);
    await mkdir(dataDir, { recursive: true });
    member.process = spawn(
      "etcd",
      [
        `--name=${member.name}`,
        `--data-dir=${dataDir}`,
        `--listen-peer-urls=http://127.0.0.1:${member.peerPort}`,
        `--initial-advertise-peer-urls=http://127.0.0.1:${member.peerPort}`,
        `--listen-client-urls=http://127.0.0.1:${member.clientPort}`,
        `--advertise-client-urls=http://127.0.0.1:${member.clientPort}`,
        `--initial-cluster=${initialCluster}`,
        `--initial-cluster-state=${state}`,
        "--initial-cluster-token=leasehold-ha-test",
        `--heartbeat-interval=${etcdTimings.heartbeat}`,
        `--election-timeout=${etcdTimings.election}`,
      ],
      { stdio: ["ignore", "ignore", "pipe"] },
    );
    member.process.stderr?.pipe(logFile(member.name));
  };
  const etcdctl = (endpoints: string[], args: string[]) =>
    run("etcdctl", [`--endpoints=${endpoints.join(",")}`, "--command-timeout=2s", ...args], {
      env: { ...process.env, ETCDCTL_API: "3" },
    });
  const etcdHealthy = async (member: EtcdMember) =>
    etcdctl([`127.0.0.1:${member.clientPort}`], ["endpoint", "health"]).then(
      () => true,
      () => false,
    );
  for (const m of etcd) await startEtcd(m, "new");
  for (const m of etcd) {
    await waitFor(() => etcdHealthy(m), { what: `${m.name} to be healthy`, timeoutMs: 60_000 });
  }
  log("etcd: three members healthy");

  // Patroni 3.0.2 as Debian ships it, with deploy/ha's fix of its etcd3
  // leader key (patroni-3.0.2-etcd3-leader-key.patch; without it a primary
  // frozen past the ttl takes the leader key back from the member promoted
  // meanwhile): a patched copy of the package in this run's folder, first on
  // Patroni's PYTHONPATH. Nothing of the installed package changes.
  const patroniLib = path.join(dir, "patroni-lib");
  await mkdir(patroniLib);
  await cp("/usr/lib/python3/dist-packages/patroni", path.join(patroniLib, "patroni"), {
    recursive: true,
    filter: (source) => !source.includes("__pycache__"),
  });
  await run("patch", [
    "-p1",
    "-d",
    patroniLib,
    "-i",
    path.join(deployDir, "patroni-3.0.2-etcd3-leader-key.patch"),
  ]);

  // Patroni: three members, each in a folder of its own owned by postgres.
  const template = await readFile(path.join(deployDir, "patroni.yml"), "utf8");
  const members: Member[] = [];
  for (let i = 1; i <= 3; i++) {
    const home = path.join(dir, `pg${i}`);
    await mkdir(home);
    await chown(home, postgresUser.uid, postgresUser.gid);
    const configFile = path.join(home, "patroni.yml");
    // The one line that names a host folder: sockets go into the member's own.
    await writeFile(
      configFile,
      template.replace(
        "unix_socket_directories: /var/run/postgresql",
        `unix_socket_directories: ${home}`,
      ),
    );
    await chown(configFile, postgresUser.uid, postgresUser.gid);
    members.push({
      name: `pg${i}`,
      pgPort: await freePort(),
      apiPort: await freePort(),
      dataDir: path.join(home, "data"),
      configFile,
      patroni: undefined as unknown as ChildProcess,
    });
  }
  const memberEnv = (m: Member): NodeJS.ProcessEnv => ({
    PATH: process.env.PATH,
    PYTHONPATH: patroniLib,
    // The copy is root's; no bytecode is written next to it.
    PYTHONDONTWRITEBYTECODE: "1",
    HOME: path.dirname(m.dataDir),
    LANG: "C.UTF-8",
    PATRONI_NAME: m.name,
    PATRONI_RESTAPI_LISTEN: `127.0.0.1:${m.apiPort}`,
    PATRONI_RESTAPI_CONNECT_ADDRESS: `127.0.0.1:${m.apiPort}`,
    PATRONI_POSTGRESQL_LISTEN: `127.0.0.1:${m.pgPort}`,
    PATRONI_POSTGRESQL_CONNECT_ADDRESS: `127.0.0.1:${m.pgPort}`,
    PATRONI_POSTGRESQL_DATA_DIR: m.dataDir,
    PATRONI_POSTGRESQL_PGPASS: path.join(path.dirname(m.dataDir), "pgpass"),
    PATRONI_ETCD3_HOSTS: etcdEndpoints.join(","),
    PATRONI_SUPERUSER_PASSWORD: superuserPassword,
  });
  const startPatroni = (m: Member) => {
    m.patroni = spawn("patroni", [m.configFile], {
      uid: postgresUser.uid,
      gid: postgresUser.gid,
      cwd: path.dirname(m.dataDir),
      env: memberEnv(m),
      stdio: ["ignore", "pipe", "pipe"],
    });
    const out = logFile(m.name);
    m.patroni.stdout?.pipe(out, { end: false });
    m.patroni.stderr?.pipe(out, { end: false });
  };
  // The first member bootstraps the cluster; the others copy it.
  startPatroni(members[0] as Member);

  const status = async (m: Member): Promise<MemberStatus | undefined> => {
    try {
      const response = await fetch(`http://127.0.0.1:${m.apiPort}/patroni`, {
        signal: AbortSignal.timeout(1_000),
      });
      return (await response.json()) as MemberStatus;
    } catch {
      return undefined;
    }
  };
  const answersPrimary = async (m: Member) => {
    try {
      const response = await fetch(`http://127.0.0.1:${m.apiPort}/primary`, {
        signal: AbortSignal.timeout(1_000),
      });
      await response.arrayBuffer();
      return response.status === 200;
    } catch {
      return false;
    }
  };
  const primary = async () => {
    const answers = await Promise.all(members.map(answersPrimary));
    const found = members.filter((_, i) => answers[i]);
    return found.length === 1 ? found[0] : undefined;
  };
  await waitFor(async () => (await primary()) === members[0], {
    what: "pg1 to bootstrap the cluster as its primary",
    timeoutMs: 120_000,
    intervalMs: 250,
  });
  for (const m of members.slice(1)) startPatroni(m);
  for (const m of members.slice(1)) {
    await waitFor(async () => (await status(m))?.state === "running", {
      what: `${m.name} to run as a replica`,
      timeoutMs: 180_000,
      intervalMs: 250,
    });
  }
  log("patroni: three members running");

  // HAProxy: deploy/ha/haproxy.cfg with loopback addresses and ports.
  const haproxyPort = await freePort();
  let haproxyConfig = (await readFile(path.join(deployDir, "haproxy.cfg"), "utf8")).replace(
    "bind *:5000",
    `bind 127.0.0.1:${haproxyPort}`,
  );
  for (const [i, m] of members.entries()) {
    haproxyConfig = haproxyConfig.replace(
      new RegExp(`10\\.0\\.0\\.${i + 1}:5432(.*) port 8008`),
      `127.0.0.1:${m.pgPort}$1 port ${m.apiPort}`,
    );
  }
  const haproxyFile = path.join(dir, "haproxy.cfg");
  await writeFile(haproxyFile, haproxyConfig);
  let haproxy: ChildProcess = undefined as unknown as ChildProcess;
  const startHaproxy = () => {
    // -db: in the foreground, so this process owns it.
    haproxy = spawn("haproxy", ["-db", "-f", haproxyFile], { stdio: ["ignore", "pipe", "pipe"] });
    const out = logFile("haproxy");
    haproxy.stdout?.pipe(out, { end: false });
    haproxy.stderr?.pipe(out, { end: false });
  };
  startHaproxy();
  const superuserUrl = (port: number, database = "postgres") =>
    `postgres://postgres:${superuserPassword}@127.0.0.1:${port}/${database}`;
  const throughHaproxy = superuserUrl(haproxyPort);
  await waitFor(
    async () => {
      const sql = postgres(throughHaproxy, {
        max: 1,
        connect_timeout: 2,
        fetch_types: false,
        onnotice: () => {},
      });
      try {
        const [row] = await sql<{ standby: boolean }[]>`SELECT pg_is_in_recovery() AS standby`;
        return row?.standby === false;
      } catch {
        return false;
      } finally {
        await sql.end({ timeout: 0 });
      }
    },
    { what: "HAProxy to reach the primary", timeoutMs: 30_000, intervalMs: 250 },
  );
  // The service's role and database, through HAProxy (so, on the primary).
  const admin = postgres(throughHaproxy, { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE ROLE leasehold LOGIN PASSWORD '${leaseholdPassword}'`);
  await admin.unsafe(`CREATE DATABASE ${databaseName} OWNER leasehold`);
  await admin.end();
  const databaseUrl = `postgres://leasehold:${leaseholdPassword}@127.0.0.1:${haproxyPort}/${databaseName}`;
  await migrate(databaseUrl, allMigrationSets);
  log("haproxy: the database is migrated through it");

  const instances: LeaseInstance[] = [];
  for (let index = 0; index < 3; index++) {
    const process = await spawnServer(databaseUrl);
    instances.push({ index, url: process.url, process });
  }
  // The guarded store confirms every fence-raising write with a lease server
  // (docs/fencing.md); the first instance, as the fault suite's cluster does.
  const guarded = await spawnGuardedServer(databaseUrl, ["--lease-url", instances[0]?.url ?? ""]);

  const member = (name: string) => {
    const found = members.find((m) => m.name === name);
    if (!found) throw new RangeError(`no member ${name}`);
    return found;
  };
  const postmasterPid = async (m: Member) => {
    const text = await readFile(path.join(m.dataDir, "postmaster.pid"), "utf8");
    return Number(text.split("\n")[0]);
  };

  const stack: HaStack = {
    dir,
    members,
    etcd,
    databaseUrl,
    instances,
    guardedUrl: guarded.url,
    directUrl: (m, database = databaseName) => superuserUrl(m.pgPort, database),
    status,
    primary,
    member,
    postmasterPid,
    processesOf: async (m) => {
      const table = await processTable();
      const pids: number[] = [];
      if (m.patroni.pid !== undefined && m.patroni.exitCode === null) {
        pids.push(m.patroni.pid, ...descendants(m.patroni.pid, table));
      }
      // Patroni starts the postmaster detached from itself, so that
      // PostgreSQL outlives it: its backends are the postmaster's children.
      const postmaster = await postmasterPid(m).catch(() => undefined);
      if (postmaster !== undefined && !pids.includes(postmaster)) {
        pids.push(postmaster, ...descendants(postmaster, table));
      }
      return [...new Set(pids)];
    },
    restartPatroni: async (m) => {
      await exited(m.patroni);
      startPatroni(m);
    },
    patronictl: async (args) => {
      const { stdout } = await run(
        "patronictl",
        ["-c", (members[0] as Member).configFile, ...args],
        {
          env: { ...memberEnv(members[0] as Member), PATH: process.env.PATH },
        },
      );
      return stdout;
    },
    etcdLeader: async () => {
      // Each member on its own: etcdctl fails the whole call when one
      // endpoint (a killed member) does not answer.
      const answers = await Promise.all(
        etcd.map((m) =>
          etcdctl([`127.0.0.1:${m.clientPort}`], ["endpoint", "status", "--write-out=json"]).then(
            ({ stdout }) =>
              (
                JSON.parse(stdout) as {
                  Status: { header: { member_id: number }; leader: number };
                }[]
              )[0],
            () => undefined,
          ),
        ),
      );
      // etcdctl prints the 64-bit ids as JSON numbers: compared as parsed,
      // which is the same rounding on both sides.
      const leading = answers.findIndex(
        (a) => a !== undefined && a.Status.header.member_id === a.Status.leader,
      );
      return leading >= 0 ? etcd[leading] : undefined;
    },
    etcdHealthy,
    killEtcd: async (m) => {
      m.process.kill("SIGKILL");
      await exited(m.process);
    },
    startEtcd: (m) => startEtcd(m, "existing"),
    restartHaproxy: async () => {
      haproxy.kill("SIGTERM");
      await exited(haproxy);
      startHaproxy();
      await sleep(0);
      return haproxy.pid ?? 0;
    },
    close: async () => {
      await Promise.all(instances.map((i) => i.process.kill()));
      await guarded.kill();
      haproxy.kill("SIGKILL");
      await exited(haproxy);
      for (const m of members) {
        // A frozen member must run to die.
        for (const pid of await stack.processesOf(m)) {
          try {
            process.kill(pid, "SIGCONT");
          } catch {}
        }
        m.patroni.kill("SIGKILL");
        await exited(m.patroni);
        const postmaster = await postmasterPid(m).catch(() => undefined);
        if (postmaster !== undefined) {
          try {
            // Immediate shutdown: the postmaster takes its backends with it.
            process.kill(postmaster, "SIGQUIT");
            await waitFor(
              () => {
                try {
                  process.kill(postmaster, 0);
                  return false;
                } catch {
                  return true;
                }
              },
              { what: `${m.name}'s postmaster to exit`, timeoutMs: 30_000 },
            );
          } catch {}
        }
      }
      for (const m of etcd) {
        m.process.kill("SIGKILL");
        await exited(m.process);
      }
      // The logs of every process outlive the run, for reading a failure.
      const kept = path.join(repoRoot, "test-results", "ha-logs");
      await rm(kept, { recursive: true, force: true });
      await mkdir(path.dirname(kept), { recursive: true });
      await cp(logs, kept, { recursive: true });
      if (process.env.LEASEHOLD_HA_KEEP !== "1") await rm(dir, { recursive: true, force: true });
    },
  };
  return stack;
}
