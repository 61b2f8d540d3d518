// The system under fault: a PostgreSQL of its own (embedded, so the suite
// can stop and restart it on the same port), three lease server processes,
// a guarded store process, and a TCP proxy in front of each lease server.
// Every fault the suite injects is a method here.

import { mkdtemp, rm } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import postgres from "postgres";
import {
  type EmbeddedDatabase,
  freePort,
  startEmbeddedPostgres,
} from "../../src/server/db/embedded-postgres.js";
import { allMigrationSets, migrate } from "../../src/server/db/migrate.js";
import { type ServerProcess, spawnGuardedServer, spawnServer } from "../support/server.js";
import { startTcpProxy, type TcpProxy } from "../support/tcp-proxy.js";

export interface LeaseInstance {
  readonly index: number;
  readonly port: number;
  /** The server itself, without the proxy. */
  readonly directUrl: string;
  readonly proxy: TcpProxy;
  process: ServerProcess;
}

export interface Cluster {
  readonly databaseUrl: string;
  readonly instances: LeaseInstance[];
  readonly guardedUrl: string;
  /** SIGKILL of one lease server (no graceful shutdown, streams cut). */
  killInstance(index: number): Promise<void>;
  /** Starts a killed lease server again on its port. */
  restartInstance(index: number): Promise<void>;
  /** Stops PostgreSQL (fast shutdown: every connection is cut). */
  stopDatabase(): Promise<void>;
  /** Starts PostgreSQL again on the same port and data. */
  startDatabase(): Promise<void>;
  close(): Promise<void>;
}

const database = "leasehold_faults";

export async function startCluster(instanceCount = 3): Promise<Cluster> {
  const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-faults-"));
  const dataDir = path.join(dir, "pgdata");
  const pgPort = await freePort();
  let pg: EmbeddedDatabase | undefined = await startEmbeddedPostgres({ dataDir, port: pgPort });
  const admin = postgres(pg.url, { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE DATABASE ${database}`);
  await admin.end();
  const databaseUrl = pg.urlFor(database);
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
  const guarded = await spawnGuardedServer(databaseUrl);

  const instance = (index: number) => {
    const found = instances[index];
    if (!found) throw new RangeError(`no lease server ${index}`);
    return found;
  };

  return {
    databaseUrl,
    instances,
    guardedUrl: guarded.url,
    killInstance: (index) => instance(index).process.kill(),
    restartInstance: async (index) => {
      const target = instance(index);
      target.process = await startInstance(target.port);
    },
    stopDatabase: async () => {
      await pg?.stop();
      pg = undefined;
    },
    startDatabase: async () => {
      pg = await startEmbeddedPostgres({ dataDir, port: pgPort });
    },
    close: async () => {
      await Promise.all(instances.map((i) => i.proxy.close()));
      await Promise.all(instances.map((i) => i.process.stop()));
      await guarded.stop();
      await pg?.stop();
      await rm(dir, { recursive: true, force: true });
    },
  };
}
