// Lease and guarded store servers for tests: in this process
// (startTestServer, startTestGuardedServer) or as separate OS processes
// (spawnServer, spawnGuardedServer), always on a real socket, port 0.

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { fileURLToPath } from "node:url";
import { type Client, createClient } from "@connectrpc/connect";
import { createConnectTransport, createGrpcTransport } from "@connectrpc/connect-node";
import { GuardedStoreService } from "../../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { LeaseService } from "../../src/gen/leasehold/v1/lease_pb.js";
import { parseGuardedConfig } from "../../src/guarded/config.js";
import type { GuardedLimits } from "../../src/guarded/guarded-service.js";
import { startGuardedServer } from "../../src/guarded/server.js";
import { parseServerConfig, type ServerConfig } from "../../src/server/config.js";
import { createLogger } from "../../src/server/logger.js";
import { type LeaseServer, type RunningServer, startServer } from "../../src/server/server.js";

export const repoRoot = fileURLToPath(new URL("../../", import.meta.url));
export const cliPath = fileURLToPath(new URL("../../bin/leasehold.js", import.meta.url));

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
): Promise<LeaseServer> {
  const config = parseServerConfig([...testServerArgs, "--database-url", databaseUrl, ...args], {});
  return startServer({ ...config, ...overrides }, createLogger({ level: "silent" }));
}

export type LeaseClient = Client<typeof LeaseService>;

export function grpcClient(baseUrl: string): LeaseClient {
  return createClient(LeaseService, createGrpcTransport({ baseUrl }));
}

export function connectClient(baseUrl: string): LeaseClient {
  return createClient(LeaseService, createConnectTransport({ baseUrl, httpVersion: "1.1" }));
}

export interface ServerProcess {
  url: string;
  child: ChildProcess;
  /** SIGTERM and wait for exit. */
  stop(): Promise<void>;
  /** SIGKILL and wait for exit. */
  kill(): Promise<void>;
}

/** Runs `leasehold serve` as its own process and resolves once it listens. */
export async function spawnServer(
  databaseUrl: string,
  args: string[] = [],
  env: NodeJS.ProcessEnv = {},
): Promise<ServerProcess> {
  return spawnLeasehold(["serve", ...testServerArgs, "--database-url", databaseUrl, ...args], env);
}

/** Guarded store servers for tests listen on port 0 and drain quickly. */
export const testGuardedArgs = ["--listen", "127.0.0.1:0", "--shutdown-grace", "1s"];

/** Runs `leasehold guarded serve` as its own process and resolves once it listens. */
export async function spawnGuardedServer(
  databaseUrl: string,
  args: string[] = [],
  env: NodeJS.ProcessEnv = {},
): Promise<ServerProcess> {
  return spawnLeasehold(
    ["guarded", "serve", ...testGuardedArgs, "--database-url", databaseUrl, ...args],
    env,
  );
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

// Runs the leasehold command and resolves with the URL it reports serving on.
async function spawnLeasehold(argv: string[], env: NodeJS.ProcessEnv): Promise<ServerProcess> {
  const child = spawn(process.execPath, [cliPath, ...argv], {
    cwd: repoRoot,
    env: { ...process.env, LEASEHOLD_LOG_LEVEL: "warn", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stderr = "";
  const url = await new Promise<string>((resolve, reject) => {
    const onData = (chunk: Buffer) => {
      stderr += chunk.toString();
      const m = /serving on (http:\/\/\S+)/.exec(stderr);
      if (m?.[1]) {
        child.stderr?.off("data", onData);
        resolve(m[1]);
      }
    };
    child.stderr?.on("data", onData);
    child.once("exit", (code) => reject(new Error(`server exited with ${code}: ${stderr}`)));
  });
  child.stdout?.resume();
  child.stderr?.resume();
  const exited = once(child, "exit");
  return {
    url,
    child,
    stop: async () => {
      if (child.exitCode === null) child.kill("SIGTERM");
      await exited;
    },
    kill: async () => {
      if (child.exitCode === null) child.kill("SIGKILL");
      await exited;
    },
  };
}
