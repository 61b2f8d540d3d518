// The system under fault: a PostgreSQL pair of its own (a primary and a
// synchronous streaming standby, test/faults/replication.ts), three lease
// server processes, a guarded store process, and a TCP proxy in front of
// each lease server. Every process reaches the database through one more
// TCP proxy, the database endpoint: it forwards to the primary, and at a
// failover it is moved to the promoted standby, as a cluster manager moves
// a DNS name or a load balancer's backend (docs/failover.md). Every fault
// the suite injects is a method here.

import { rm } from "node:fs/promises";
import postgres from "postgres";
import { freePort, makeDataParent } from "../../src/postgres/embedded-postgres.js";
import { allMigrationSets, migrate } from "../../src/postgres/migrate.js";
import { type ServerProcess, spawnGuardedServer, spawnServer } from "../support/server.js";
import { startTcpProxy, type TcpProxy } from "../support/tcp-proxy.js";
import {
  type FailoverTimes,
  type ReplicatedDatabase,
  startPrimaryEndpoint,
  startReplicatedDatabase,
} from "./replication.js";

export interface LeaseInstance {
  readonly index: number;
  readonly port: number;
  /** The server itself, without the proxy. */
  readonly directUrl: string;
  readonly proxy: TcpProxy;
  process: ServerProcess;
}

export interface Cluster {
  /** The database endpoint's URL: it follows the primary across failovers. */
  readonly databaseUrl: string;
  readonly database: ReplicatedDatabase;
  readonly instances: LeaseInstance[];
  readonly guardedUrl: string;
  /** SIGKILL of one lease server (no graceful shutdown, streams cut). */
  killInstance(index: number): Promise<void>;
  /** Starts a killed lease server again on its port. */
  restartInstance(index: number): Promise<void>;
  /** Stops the primary (fast shutdown: every connection is cut); the standby waits. */
  stopDatabase(): Promise<void>;
  /** Starts the primary again on the same port and data. */
  startDatabase(): Promise<void>;
  /**
   * kill -9 of the primary, promotion of the synchronous standby, and the
   * database endpoint moved to it; resolves once the new primary accepts
   * writes. It runs without a standby until rebuildStandby().
   */
  failoverDatabase(): Promise<FailoverTimes>;
  /** A new synchronous standby, copied from the new primary onto the dead one's port. */
  rebuildStandby(): Promise<void>;
  close(): Promise<void>;
}

const databaseName = "leasehold_faults";

function instance0Url(instances: LeaseInstance[]): string {
  const first = instances[0];
  if (!first) throw new RangeError("a cluster needs a lease server");
  return first.directUrl;
}

export async function startCluster(instanceCount = 3): Promise<Cluster> {
  const dir = await makeDataParent("leasehold-faults-");
  const database = await startReplicatedDatabase({ synchronous: true, dir });
  const endpoint = await startPrimaryEndpoint(database);
  const admin = postgres(database.directUrlFor("postgres"), { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE DATABASE ${databaseName}`);
  await admin.end();
  const databaseUrl = endpoint.urlFor(databaseName);
  await migrate(databaseUrl, allMigrationSets);

  const startInstance = (port: number) =>
    spawnServer(databaseUrl, ["--listen", `127.0.0.1:${port}`]);
  const instances: LeaseInstance[] = [];
  for (let index = 0; index < instanceCount; index++) {
    const port = await freePort();
    const process = await startInstance(port);
    const directUrl = `http://127.0.0.1:${port}`;
    instances.push({ index, port, directUrl, proxy: await startTcpProxy(directUrl), process });
  }
  // The store confirms a write that raises a fence with one lease server,
  // reached directly: only its kill -9 (not the proxies' faults) makes such
  // writes UNAVAILABLE for a moment; writes at a run's own token go on.
  const guarded = await spawnGuardedServer(databaseUrl, ["--lease-url", instance0Url(instances)]);

  const instance = (index: number) => {
    const found = instances[index];
    if (!found) throw new RangeError(`no lease server ${index}`);
    return found;
  };

  return {
    databaseUrl,
    database,
    instances,
    guardedUrl: guarded.url,
    killInstance: (index) => instance(index).process.kill(),
    restartInstance: async (index) => {
      const target = instance(index);
      target.process = await startInstance(target.port);
    },
    stopDatabase: () => database.stopPrimary(),
    startDatabase: () => database.startPrimary(),
    failoverDatabase: async () => {
      const times = await database.failover();
      endpoint.follow();
      return times;
    },
    rebuildStandby: () => database.rebuildStandby(),
    close: async () => {
      await Promise.all(instances.map((i) => i.proxy.close()));
      await Promise.all(instances.map((i) => i.process.stop()));
      await guarded.stop();
      await endpoint.close();
      await database.close();
      await rm(dir, { recursive: true, force: true });
    },
  };
}
