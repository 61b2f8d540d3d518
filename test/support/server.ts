// Lease and guarded store servers for tests: in this process
// (startTestServer, startTestGuardedServer) or as separate OS processes
// (spawnServer, spawnGuardedServer), always on a real socket, port 0.

import { type Client, createClient } from "@connectrpc/connect";
import { createConnectTransport, createGrpcTransport } from "@connectrpc/connect-node";
import { GuardedStoreService } from "../../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { LeaseService } from "../../src/gen/leasehold/v1/lease_pb.js";
import { parseGuardedConfig } from "../../src/guarded/config.js";
import type { GuardedLimits } from "../../src/guarded/guarded-service.js";
import { startGuardedServer } from "../../src/guarded/server.js";
import { createLogger, type Logger } from "../../src/log/logger.js";
import { parseServerConfig, type ServerConfig } from "../../src/server/config/server-config.js";
import {
  type LeaseServer,
  type LeaseServerExtensions,
  type RunningServer,
  startServer,
} from "../../src/server/server.js";
import { type ServerProcess, spawnLeasehold } from "./server-process.js";

export { cliPath, repoRoot, type ServerProcess } from "./server-process.js";

/** Test servers accept short TTLs so expiry tests take a fraction of a second. */
export const testServerArgs = [
  "--listen",
  "127.0.0.1:0",
  "--min-ttl",
  "50ms",
  "--shutdown-grace",
  "1s",
];

export async function startTestServer(
  databaseUrl: string,
  args: string[] = [],
  overrides: Partial<ServerConfig> = {},
  logger: Logger = createLogger({ level: "silent" }),
  extensions: LeaseServerExtensions = {},
): Promise<LeaseServer> {
  const config = parseServerConfig([...testServerArgs, "--database-url", databaseUrl, ...args], {});
  return startServer({ ...config, ...overrides }, logger, extensions);
}

export type LeaseClient = Client<typeof LeaseService>;

export function grpcClient(baseUrl: string): LeaseClient {
  return createClient(LeaseService, createGrpcTransport({ baseUrl }));
}

export function connectClient(baseUrl: string): LeaseClient {
  return createClient(LeaseService, createConnectTransport({ baseUrl, httpVersion: "1.1" }));
}

/** Runs `leasehold serve` as its own process and resolves once it listens. */
export async function spawnServer(
  databaseUrl: string,
  args: string[] = [],
  env: NodeJS.ProcessEnv = {},
): Promise<ServerProcess> {
  return spawnLeasehold({
    argv: ["serve", ...testServerArgs, "--database-url", databaseUrl, ...args],
    env,
  });
}

/** Guarded store servers for tests listen on port 0 and drain quickly. */
export const testGuardedArgs = ["--listen", "127.0.0.1:0", "--shutdown-grace", "1s"];

/** Runs `leasehold guarded serve` as its own process and resolves once it listens. */
export async function spawnGuardedServer(
  databaseUrl: string,
  args: string[] = [],
  env: NodeJS.ProcessEnv = {},
): Promise<ServerProcess> {
  return spawnLeasehold({
    argv: ["guarded", "serve", ...testGuardedArgs, "--database-url", databaseUrl, ...args],
    env,
  });
}

/** The guarded store server in this process. */
export async function startTestGuardedServer(
  databaseUrl: string,
  args: string[] = [],
  limits?: GuardedLimits,
): Promise<RunningServer> {
  const config = parseGuardedConfig(
    [...testGuardedArgs, "--database-url", databaseUrl, ...args],
    {},
  );
  return startGuardedServer(config, createLogger({ level: "silent" }), limits);
}

export type GuardedClient = Client<typeof GuardedStoreService>;

export function guardedGrpcClient(baseUrl: string): GuardedClient {
  return createClient(GuardedStoreService, createGrpcTransport({ baseUrl }));
}

export function guardedConnectClient(baseUrl: string): GuardedClient {
  return createClient(GuardedStoreService, createConnectTransport({ baseUrl, httpVersion: "1.1" }));
}
