// What `leasehold serve` and `leasehold guarded serve` check before they
// start a database, and how they say why a start failed: in words that name
// the folder, the port or the database URL and what to do.

import net from "node:net";
import { hidePassword } from "../config/host-config.js";
import { DatabaseConnectTimeoutError } from "../postgres/connect-probe.js";
import {
  DataDirInUseError,
  dataDirHolder,
  EmbeddedStartError,
  resolveDataDir,
} from "../postgres/embedded-postgres.js";

/** A start that cannot go on, with a message for the user (no stack). */
export class StartError extends Error {
  override name = "StartError";
}

interface StartConfig {
  databaseUrl: string | undefined;
  dataDir: string;
  dataDirIsDefault?: boolean;
  listenHost: string;
  listenPort: number;
}

/**
 * Finds what would stop the server after its database started and migrated:
 * another Leasehold on the data folder, or the port in use. (The data folder
 * lock is taken for real when the embedded database starts; this only
 * answers early.)
 */
export async function preflight(config: StartConfig): Promise<void> {
  if (config.databaseUrl === undefined) {
    const dataDir = await resolveDataDir(config.dataDir, config.dataDirIsDefault === true);
    const holder = await dataDirHolder(dataDir);
    if (holder !== undefined) throw new StartError(new DataDirInUseError(dataDir, holder).message);
  }
  if (config.listenPort !== 0) await requirePortFree(config.listenHost, config.listenPort);
}

async function requirePortFree(host: string, port: number): Promise<void> {
  const server = net.createServer();
  const failure = await new Promise<NodeJS.ErrnoException | undefined>((resolve) => {
    server.once("error", resolve);
    server.listen({ host, port, exclusive: true }, () => resolve(undefined));
  });
  if (failure === undefined) {
    await new Promise((resolve) => server.close(resolve));
    return;
  }
  const address = `${host.includes(":") ? `[${host}]` : host}:${port}`;
  if (failure.code === "EADDRINUSE") {
    throw new StartError(
      `${address} is already in use (another Leasehold, or another program): ` +
        "stop it, or serve on another port with --listen (LEASEHOLD_LISTEN)",
    );
  }
  throw new StartError(`cannot serve on ${address}: ${failure.message}`);
}

// Network errors of the driver and SQLSTATEs a wrong URL gives, in words.
const databaseProblems: Record<string, string> = {
  ECONNREFUSED: "connection refused: is PostgreSQL running there, on that port?",
  ENOTFOUND: "the host name is not known",
  EAI_AGAIN: "the host name could not be resolved",
  ETIMEDOUT: "the connection timed out",
  CONNECT_TIMEOUT: "the connection timed out",
  EHOSTUNREACH: "the host is unreachable",
  ECONNRESET: "the connection was reset",
  "28P01": "the password was refused",
  "28000": "the server refused this user",
  "3D000": "that database does not exist",
};

/** The message for a failed start, or undefined for an error that is a bug (shown as is). */
export function describeStartError(error: unknown, config: StartConfig): string | undefined {
  if (
    error instanceof StartError ||
    error instanceof DataDirInUseError ||
    error instanceof EmbeddedStartError
  ) {
    return error.message;
  }
  if (config.databaseUrl === undefined) return undefined;
  const where = `cannot use the database at ${hidePassword(config.databaseUrl)} (--database-url, DATABASE_URL)`;
  if (error instanceof DatabaseConnectTimeoutError) {
    return (
      `${where}: no PostgreSQL answer within ${formatMs(error.timeoutMs)} (--database-connect-timeout, ` +
      "LEASEHOLD_DATABASE_CONNECT_TIMEOUT): is PostgreSQL at that host and port? " +
      "(a port that accepts and stays silent, or another protocol's server, looks like this)"
    );
  }
  const code = (error as { code?: unknown }).code;
  const problem = typeof code === "string" ? databaseProblems[code] : undefined;
  if (problem === undefined && !(typeof code === "string" && /^(08|28|3D)/.test(code))) {
    return undefined;
  }
  return `${where}: ${problem ?? (error as Error).message}`;
}

function formatMs(ms: number): string {
  return ms % 1000 === 0 ? `${ms / 1000}s` : `${ms}ms`;
}
