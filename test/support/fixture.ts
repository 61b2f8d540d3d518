// The one "database + server + clients" fixture of the test files. Called at
// the top of a file (or of a describe block), it registers beforeAll and
// afterAll hooks there: setup clones a fresh database (db.ts), starts a
// lease server in this process on it (server.ts) and makes clients;
// teardown closes what the file opened, newest first — clients, then every
// server (each drains its connections within its shutdown grace), then the
// database pools.
//
// What it returns can be destructured at once: `db`, `server`, `client`, …
// are handles that stand for the real objects, which exist only once
// beforeAll has run. Reading a property of a handle earlier throws, naming
// the handle, instead of failing later on `undefined`.

import { afterAll, beforeAll } from "vitest";
import {
  createLeaseClient,
  type LeaseClientOptions,
  type LeaseClient as LibraryClient,
} from "../../src/client/index.js";
import type { GuardedLimits } from "../../src/guarded/guarded-service.js";
import type { Logger } from "../../src/log/logger.js";
import type { ServerConfig } from "../../src/server/config/server-config.js";
import type { LeaseServer, LeaseServerExtensions, RunningServer } from "../../src/server/server.js";
import { createTestDatabase, type TestDatabase } from "./db.js";
import {
  connectClient,
  grpcClient,
  type LeaseClient,
  type ServerProcess,
  spawnGuardedServer,
  spawnServer,
  startTestGuardedServer,
  startTestServer,
} from "./server.js";
import { createTestKeys, type TestKeys } from "./tokens.js";

/** A stand-in for an object that is made in beforeAll; see the top of this file. */
function late<T extends object>(name: string, make?: () => T): { handle: T; set(value: T): void } {
  let target: T | undefined;
  const real = (): T => {
    target ??= make?.();
    if (target === undefined) {
      throw new Error(`${name} is made in beforeAll: use it inside a test or a hook`);
    }
    return target;
  };
  const handle = new Proxy({} as T, {
    // Not bound: a method called on the handle gets the handle as `this`,
    // which reads through to the object; and a function-valued property
    // (postgres.js's `sql`, with `sql.begin`) must keep its own properties.
    get: (_, property) => Reflect.get(real(), property),
    has: (_, property) => Reflect.has(real(), property),
    ownKeys: () => Reflect.ownKeys(real()),
    getOwnPropertyDescriptor: (_, property) => Reflect.getOwnPropertyDescriptor(real(), property),
  });
  return {
    handle,
    set: (value) => {
      target = value;
    },
  };
}

export interface TestDatabaseFixture {
  /** The file's own database, cloned from the migrated template. */
  readonly db: TestDatabase;
  /** Runs `cleanup` at teardown, before the database closes (newest first). */
  defer(cleanup: () => unknown): void;
  /** Another fresh database (an independent resource's), closed at teardown. */
  anotherDatabase(): Promise<TestDatabase>;
  /** One more lease server in this process on the file's database, closed at teardown. */
  startServer(
    args?: string[],
    overrides?: Partial<ServerConfig>,
    logger?: Logger,
    extensions?: LeaseServerExtensions,
  ): Promise<LeaseServer>;
  /** `leasehold serve` as its own process on the file's database, stopped at teardown. */
  spawnServer(args?: string[], env?: NodeJS.ProcessEnv): Promise<ServerProcess>;
  /** A guarded store in this process on the file's database, closed at teardown. */
  startGuardedServer(args?: string[], limits?: GuardedLimits): Promise<RunningServer>;
  /** `leasehold guarded serve` as its own process, stopped at teardown. */
  spawnGuardedServer(
    args?: string[],
    env?: NodeJS.ProcessEnv,
    databaseUrl?: string,
  ): Promise<ServerProcess>;
  /** The client library (src/client), closed at teardown. */
  libraryClient(options: LeaseClientOptions): LibraryClient;
}

/** A fresh database per file, with helpers whose servers and clients teardown closes. */
export function useTestDatabase(): TestDatabaseFixture {
  const db = late<TestDatabase>("db");
  let cleanups: (() => unknown)[] = [];
  let database: TestDatabase | undefined;
  const defer = (cleanup: () => unknown) => {
    cleanups.push(cleanup);
  };

  beforeAll(async () => {
    database = await createTestDatabase();
    db.set(database);
  });
  afterAll(async () => {
    const pending = cleanups.reverse();
    cleanups = [];
    // Every cleanup runs even when one fails; the first failure is reported.
    const failures: unknown[] = [];
    for (const cleanup of pending) {
      try {
        await cleanup();
      } catch (error) {
        failures.push(error);
      }
    }
    await database?.close();
    if (failures.length > 0) throw failures[0];
  });

  return {
    db: db.handle,
    defer,
    async anotherDatabase() {
      const other = await createTestDatabase();
      defer(() => other.close());
      return other;
    },
    async startServer(args = [], overrides = {}, logger = undefined, extensions = {}) {
      const server = await startTestServer(db.handle.url, args, overrides, logger, extensions);
      defer(() => server.close());
      return server;
    },
    async spawnServer(args = [], env = {}) {
      const server = await spawnServer(db.handle.url, args, env);
      defer(() => server.stop());
      return server;
    },
    async startGuardedServer(args = [], limits) {
      const server = await startTestGuardedServer(db.handle.url, args, limits);
      defer(() => server.close());
      return server;
    },
    async spawnGuardedServer(args = [], env = {}, databaseUrl = db.handle.url) {
      const server = await spawnGuardedServer(databaseUrl, args, env);
      defer(() => server.stop());
      return server;
    },
    libraryClient(options) {
      const client = createLeaseClient(options);
      defer(() => client.close());
      return client;
    },
  };
}

export interface TestServerOptions {
  /** Flags after the test defaults (testServerArgs) and the database URL. */
  args?: string[];
  /** Fields of the parsed configuration to replace, e.g. limits. */
  overrides?: Partial<ServerConfig>;
  /** Require bearer tokens signed with fresh test keys (their flags come first). */
  keys?: boolean;
  /** The server's logger; default silent. */
  logger?: Logger;
}

export interface TestServerFixture extends TestDatabaseFixture {
  /** The lease server in this process. */
  readonly server: LeaseServer;
  /** The Connect client over gRPC (h2c). */
  readonly client: LeaseClient;
  /** The Connect client over the Connect protocol on HTTP/1.1 (what curl and browsers speak). */
  readonly connect: LeaseClient;
  /** The project's client library on the server, made when first used. */
  readonly library: LibraryClient;
  /** Another client library instance; `baseUrl` defaults to the server's. */
  libraryClient(options?: LeaseClientOptions): LibraryClient;
  /** The keys the server requires (with `keys: true`). */
  readonly keys: TestKeys;
}

/** A fresh database, a lease server in this process on it, and clients of that server. */
export function useTestServer(options: TestServerOptions = {}): TestServerFixture {
  const base = useTestDatabase();
  const server = late<LeaseServer>("server");
  const client = late<LeaseClient>("client");
  const connect = late<LeaseClient>("connect");
  const libraryClient = (options: LeaseClientOptions = {}) =>
    base.libraryClient({ baseUrl: server.handle.url, ...options });
  const library = late<LibraryClient>("library", () => libraryClient());
  const keys = late<TestKeys>("keys (pass keys: true)");

  beforeAll(async () => {
    const testKeys = options.keys ? await createTestKeys() : undefined;
    if (testKeys) keys.set(testKeys);
    const args = [...(testKeys?.args ?? []), ...(options.args ?? [])];
    const running = await base.startServer(args, options.overrides, options.logger);
    server.set(running);
    client.set(grpcClient(running.url));
    connect.set(connectClient(running.url));
  });

  return {
    ...base,
    server: server.handle,
    client: client.handle,
    connect: connect.handle,
    library: library.handle,
    libraryClient,
    keys: keys.handle,
  };
}
