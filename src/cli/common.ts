// What the client commands share: the common flags, the client built from
// them, and one way to report failures — a single readable line and an exit
// code, never a stack trace.

import { readFileSync } from "node:fs";
import os from "node:os";
import { parseArgs } from "node:util";
import {
  type ClientEvent,
  type ClientTls,
  createLeaseClient,
  type LeaseClient,
  LeaseholdError,
  UnavailableError,
} from "../client/index.js";
import { parseDuration } from "../lease/limits.js";
import { unknownOption, unknownOptionHint } from "./suggest.js";

/** Exit codes of the client commands (sysexits.h where one fits). */
export const ExitCode = {
  ok: 0,
  /** The server answered with an error. */
  failure: 1,
  /** Bad flags. */
  usage: 2,
  /** No configured server could be reached. */
  unavailable: 69,
  /** The session is held by another run. */
  held: 75,
} as const;

export const defaultServer = "http://127.0.0.1:7070";

/** A mistake in the command line: reported with the command's usage hint. */
export class UsageError extends Error {
  override readonly name = "UsageError";
}

/** Flags every client command accepts: which server, and how to talk to it. */
export const commonOptions = {
  server: { type: "string", multiple: true },
  protocol: { type: "string" },
  token: { type: "string" },
  ca: { type: "string" },
  cert: { type: "string" },
  key: { type: "string" },
  json: { type: "boolean" },
  help: { type: "boolean", short: "h" },
} as const;

// The flags only some commands take; each command lists the ones it has, so
// that its --help shows only flags that do something for it, and a flag it
// would ignore is refused.
export const accountOption = { account: { type: "string" } } as const;
export const keyOptions = { ...accountOption, session: { type: "string" } } as const;
export const ttlOption = { ttl: { type: "string" } } as const;
export const holderOption = { holder: { type: "string" } } as const;

/** Help lines of those flags, for the commands' own "Flags:" lists. */
export const flagHelp = {
  account: "  --account ID        account of the session (required)",
  session: "  --session ID        session id (required)",
  ttl: `  --ttl DURATION      lease TTL such as 10s, 1500ms or 1m (default 10s; a unit
                      is required); the server takes 1s to 1h unless its
                      --min-ttl/--max-ttl differ`,
  holder: `  --holder LABEL      label shown to others, such as "desktop" (default this
                      machine's host name)`,
} as const;

export const commonHelp = `Connection flags:
  --server URL        server base URL; repeat (or separate with commas) for
                      several instances (default ${defaultServer}, or LEASEHOLD_SERVER)
  --protocol P        connect (default) or grpc
  --token JWT         bearer token (default LEASEHOLD_TOKEN)
  --ca FILE           PEM CA bundle that an https:// server's certificate is
                      checked against instead of Node's defaults (LEASEHOLD_CA;
                      NODE_EXTRA_CA_CERTS=FILE adds one to the defaults instead)
  --cert FILE         PEM client certificate for a server that authenticates
                      clients by certificate (mutual TLS; LEASEHOLD_CLIENT_CERT)
  --key FILE          its PEM private key (LEASEHOLD_CLIENT_KEY)
  --json              print protobuf JSON instead of text
  -h, --help          show this help`;

type OptionSpec = Record<
  string,
  { type: "string" | "boolean"; multiple?: boolean; short?: string }
>;

/** The parsed values of the common flags plus a command's own `T`. */
export type FlagValues<T extends OptionSpec> = {
  [K in keyof (typeof commonOptions & T)]?: (typeof commonOptions & T)[K] extends {
    type: "boolean";
  }
    ? boolean
    : (typeof commonOptions & T)[K] extends { multiple: true }
      ? string[]
      : string;
};

/** Parses a command's argv with the common flags plus its own. */
export function parseCommandArgs<T extends OptionSpec>(
  argv: string[],
  extra: T,
): { values: FlagValues<T> } {
  try {
    const { values } = parseArgs({
      args: argv,
      options: { ...commonOptions, ...extra },
      strict: true,
      allowPositionals: false,
    });
    return { values: values as FlagValues<T> };
  } catch (error) {
    if ((error as { code?: string }).code?.startsWith("ERR_PARSE_ARGS")) {
      const flag = unknownOption(error);
      const hint =
        flag === undefined
          ? undefined
          : unknownOptionHint(flag, Object.keys({ ...commonOptions, ...extra }));
      throw new UsageError(
        hint === undefined ? (error as Error).message : `Unknown option '${flag}': ${hint}`,
      );
    }
    throw error;
  }
}

/** The common flags, resolved against the environment and defaults. */
export interface CommonFlags {
  servers: string[];
  protocol: "connect" | "grpc";
  account: string | undefined;
  session: string | undefined;
  ttlMs: number;
  holder: string;
  token: string | undefined;
  /** TLS files: the CA to trust, a client certificate and key. */
  tls: ClientTls | undefined;
  json: boolean;
}

/** Reads the common flags; bad values are UsageErrors naming the flag. */
export function commonFlags(
  values: Record<string, string | boolean | (string | boolean)[] | undefined>,
  env: NodeJS.ProcessEnv = process.env,
): CommonFlags {
  const serverFlags = (values.server as string[] | undefined) ?? [];
  const servers = (serverFlags.length > 0 ? serverFlags : [env.LEASEHOLD_SERVER || defaultServer])
    .flatMap((s) => s.split(","))
    .map((s) => s.trim())
    .filter((s) => s !== "");
  for (const s of servers) {
    let url: URL;
    try {
      url = new URL(s);
    } catch {
      throw new UsageError(
        `--server must be a URL such as ${defaultServer}, got ${JSON.stringify(s)}`,
      );
    }
    if (url.protocol !== "http:" && url.protocol !== "https:") {
      throw new UsageError(`--server must be an http:// or https:// URL, got ${JSON.stringify(s)}`);
    }
  }
  const protocol = (values.protocol as string | undefined) ?? "connect";
  if (protocol !== "connect" && protocol !== "grpc") {
    throw new UsageError(`--protocol must be connect or grpc, got ${JSON.stringify(protocol)}`);
  }
  return {
    servers,
    protocol,
    account: values.account as string | undefined,
    session: values.session as string | undefined,
    ttlMs: durationFlag("ttl", values.ttl as string | undefined, 10_000),
    holder: (values.holder as string | undefined) ?? os.hostname(),
    token: (values.token as string | undefined) ?? (env.LEASEHOLD_TOKEN || undefined),
    tls: tlsFlags(values, env),
    json: values.json === true,
  };
}

/** --ca, --cert and --key (or their environment variables), each file read now so that a wrong path is a usage error. */
function tlsFlags(
  values: Record<string, string | boolean | (string | boolean)[] | undefined>,
  env: NodeJS.ProcessEnv,
): ClientTls | undefined {
  const pick = (flag: string, variable: string, marker: string): string | undefined => {
    const file = (values[flag] as string | undefined) ?? (env[variable] || undefined);
    if (file === undefined) return undefined;
    let pem: Buffer;
    try {
      pem = readFileSync(file);
    } catch (error) {
      throw new UsageError(
        `--${flag} (${variable}) must be a readable PEM file, got ${JSON.stringify(file)}: ${(error as Error).message}`,
      );
    }
    if (!pem.includes(marker)) {
      throw new UsageError(
        `--${flag} (${variable}) must hold PEM (${marker}), got ${JSON.stringify(file)}`,
      );
    }
    return file;
  };
  const tls: ClientTls = {
    caFile: pick("ca", "LEASEHOLD_CA", "-----BEGIN CERTIFICATE-----"),
    certFile: pick("cert", "LEASEHOLD_CLIENT_CERT", "-----BEGIN CERTIFICATE-----"),
    keyFile: pick("key", "LEASEHOLD_CLIENT_KEY", "PRIVATE KEY-----"),
  };
  if ((tls.certFile === undefined) !== (tls.keyFile === undefined)) {
    throw new UsageError("--cert and --key go together: a client certificate needs its key");
  }
  return Object.values(tls).some((v) => v !== undefined) ? tls : undefined;
}

/** Milliseconds of a duration flag, or `fallback` when it is absent. */
export function durationFlag(name: string, text: string | undefined, fallback: number): number {
  if (text === undefined) return fallback;
  // A number without a unit is refused, not read as seconds: many tools
  // read it as milliseconds, and for a lease a factor of 1000 either way is
  // a TTL that expires under its holder or outlives its crash.
  if (/^\s*\d+(\.\d+)?\s*$/.test(text)) {
    throw new UsageError(
      `--${name} needs a unit: ${text.trim()}s for seconds, ${text.trim()}ms for milliseconds (also m, h), got ${JSON.stringify(text)}`,
    );
  }
  const ms = parseDuration(text);
  if (ms === undefined) {
    throw new UsageError(
      `--${name} must be a duration such as 10s, 1500ms, 5m or 1h, got ${JSON.stringify(text)}`,
    );
  }
  return ms;
}

/** A required string flag. */
export function required(name: string, value: string | undefined): string {
  if (value === undefined || value === "") throw new UsageError(`--${name} is required`);
  return value;
}

/** The session key from --account and --session (both required). */
export function sessionKey(flags: CommonFlags): { accountId: string; sessionId: string } {
  return {
    accountId: required("account", flags.account),
    sessionId: required("session", flags.session),
  };
}

/** A lease client for the flags' servers. Close it when done. */
export function clientFor(flags: CommonFlags, onEvent?: (event: ClientEvent) => void): LeaseClient {
  return createLeaseClient({
    baseUrls: flags.servers,
    protocol: flags.protocol,
    token: flags.token,
    tls: flags.tls,
    onEvent,
  });
}

const connectionCodes: Record<string, string> = {
  ECONNREFUSED: "connection refused",
  ECONNRESET: "connection reset",
  ENOTFOUND: "host not found",
  EAI_AGAIN: "host name lookup failed",
  EHOSTUNREACH: "host unreachable",
  ENETUNREACH: "network unreachable",
  ETIMEDOUT: "connection timed out",
};

// Node's codes for a server certificate the client does not trust.
const certificateCodes = new Set([
  "DEPTH_ZERO_SELF_SIGNED_CERT",
  "SELF_SIGNED_CERT_IN_CHAIN",
  "UNABLE_TO_VERIFY_LEAF_SIGNATURE",
  "UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
  "UNABLE_TO_GET_ISSUER_CERT",
]);

/** The reason a server's TLS certificate was not trusted, when that is what `error` says. */
function untrustedCertificate(error: unknown): string | undefined {
  for (let e: unknown = error; e instanceof Error; e = e.cause) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && certificateCodes.has(code)) return e.message;
  }
  const message = error instanceof Error ? error.message : "";
  return /self[- ]signed certificate|unable to verify the first certificate|unable to get (local )?issuer certificate/.exec(
    message,
  )?.[0];
}

/** Why a server could not be reached, when that is what `error` says. */
function connectionProblem(error: unknown): string | undefined {
  for (let e: unknown = error; e instanceof Error; e = e.cause) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && connectionCodes[code]) return connectionCodes[code];
  }
  return undefined;
}

/**
 * Runs a command body and turns its failures into one line on stderr and an
 * exit code: usage mistakes (2), an unreachable server (69), any other
 * error the server sent (1).
 */
export async function runCommand(
  name: string,
  help: string,
  argv: string[],
  body: () => Promise<number>,
): Promise<number> {
  const separator = argv.indexOf("--");
  const own = separator === -1 ? argv : argv.slice(0, separator);
  if (own.includes("--help") || own.includes("-h")) {
    process.stdout.write(help);
    return ExitCode.ok;
  }
  try {
    return await body();
  } catch (error) {
    const prefix = `leasehold ${name}:`;
    if (error instanceof UsageError) {
      process.stderr.write(
        `${prefix} ${error.message}\nRun "leasehold ${name} --help" for usage.\n`,
      );
      return ExitCode.usage;
    }
    const untrusted = untrustedCertificate(error);
    if (untrusted !== undefined) {
      process.stderr.write(
        `${prefix} the TLS certificate of ${argvServers(argv)} is not trusted (${untrusted}): ` +
          "give the certificate of the CA that signed it with --ca FILE (LEASEHOLD_CA), " +
          "or set NODE_EXTRA_CA_CERTS=FILE\n",
      );
      return ExitCode.unavailable;
    }
    const unreachable = connectionProblem(error);
    if (unreachable !== undefined) {
      const servers = argvServers(argv);
      process.stderr.write(
        `${prefix} cannot reach the server at ${servers} (${unreachable}): is it running there? ` +
          "A server started on another address (--listen, LEASEHOLD_LISTEN) is reached with --server URL (LEASEHOLD_SERVER)\n",
      );
      return ExitCode.unavailable;
    }
    if (error instanceof UnavailableError) {
      process.stderr.write(`${prefix} the server is unavailable: ${error.message}\n`);
      return ExitCode.unavailable;
    }
    if (error instanceof LeaseholdError) {
      process.stderr.write(`${prefix} ${error.message}\n`);
      return ExitCode.failure;
    }
    throw error;
  }
}

/** What the body of a one-call client command gets. */
export interface ClientCommandContext<T extends OptionSpec> {
  values: FlagValues<T>;
  flags: CommonFlags;
  /** Closed when the body settles. */
  client: LeaseClient;
}

/**
 * A client command that parses its flags (the common ones plus `options`),
 * builds a client for the flags' servers, runs `body` and closes the client,
 * reporting failures as runCommand does.
 */
export function clientCommand<T extends OptionSpec>(
  name: string,
  help: string,
  options: T,
  body: (context: ClientCommandContext<T>) => Promise<number>,
): (argv: string[]) => Promise<number> {
  return (argv) =>
    runCommand(name, help, argv, async () => {
      const { values } = parseCommandArgs(argv, options);
      const flags = commonFlags(values);
      const client = clientFor(flags);
      try {
        return await body({ values, flags, client });
      } finally {
        client.close();
      }
    });
}

function argvServers(argv: string[]): string {
  try {
    const { values } = parseArgs({
      args: argv,
      options: { server: commonOptions.server },
      strict: false,
      allowPositionals: true,
    });
    const list = (values.server as string[] | undefined) ?? [];
    return (list.length > 0 ? list : [process.env.LEASEHOLD_SERVER || defaultServer]).join(", ");
  } catch {
    return defaultServer;
  }
}
