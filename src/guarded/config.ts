// Configuration of the guarded store server: the lease server's hosting
// settings (database, listener, pool, timeouts) and its token settings
// (how callers are authenticated), plus the fence mode and where the lease
// server is: every write that raises a session's fence is confirmed there.

import { readFileSync } from "node:fs";
import type { ClientTls } from "../client/transport.js";
import {
  type HostConfig,
  type HostDefaults,
  hostSettings,
  parseHostConfig,
} from "../config/host-config.js";
import {
  isLoopback,
  parseTokenConfig,
  type TokenConfig,
  tokenSettings,
} from "../config/ops-config.js";
import { ConfigError, readSettings, type Setting } from "../config/settings.js";

export type FenceMode = "monotonic" | "live";

export interface GuardedConfig extends HostConfig {
  fenceMode: FenceMode;
  /**
   * How callers' bearer tokens are verified: the lease server's settings.
   * Keys unset: development mode, loopback only.
   */
  auth: TokenConfig;
  /**
   * The lease server's base URL: a write that would raise a session's fence
   * is confirmed with its CheckFence (every write in live mode).
   */
  leaseUrl: string;
  /** Deadline of each CheckFence call. */
  leaseTimeoutMs: number;
  /**
   * The bearer token this resource presents to the lease server (a JWT with
   * the lease server's fence scope): the text itself, or a file re-read as
   * it changes. Undefined: the lease server runs without keys.
   */
  leaseToken: { text: string } | { file: string } | undefined;
  /**
   * TLS files for an https:// lease server: the CA its certificate is
   * checked against, and this store's client certificate and key for a
   * lease server that authenticates callers by certificate (mutual TLS).
   * Read again for new connections when they change.
   */
  leaseTls: ClientTls | undefined;
}

// Another port and data folder than the lease server's, so both run side
// by side with their defaults.
export const guardedDefaults: HostDefaults = {
  listen: "127.0.0.1:7071",
  dataDir: ".leasehold/guarded-pgdata",
};

export const guardedSettings = {
  ...hostSettings(guardedDefaults),
  ...tokenSettings,
  "fence-mode": {
    env: "LEASEHOLD_FENCE_MODE",
    help: "monotonic (default: token >= highest seen) or live (every write asks CheckFence)",
  },
  "lease-url": {
    env: "LEASEHOLD_LEASE_URL",
    help: "lease server URL (required): CheckFence confirms a write that raises the fence",
  },
  "lease-timeout": {
    env: "LEASEHOLD_LEASE_TIMEOUT",
    help: "deadline of each CheckFence call (default 2s)",
  },
  "lease-token": {
    env: "LEASEHOLD_LEASE_TOKEN",
    help: "this store's own bearer token (a JWT with the fence scope) for the lease server (environment only)",
    envOnly: true,
  },
  "lease-token-file": {
    env: "LEASEHOLD_LEASE_TOKEN_FILE",
    help: "file holding that token; re-read when it changes",
  },
  "lease-ca": {
    env: "LEASEHOLD_LEASE_CA",
    help: "PEM CA bundle that an https:// lease server's certificate is checked against",
  },
  "lease-cert": {
    env: "LEASEHOLD_LEASE_CERT",
    help: "this store's PEM client certificate for a lease server that requires one (mutual TLS)",
  },
  "lease-key": {
    env: "LEASEHOLD_LEASE_KEY",
    help: "PEM private key of --lease-cert",
  },
} as const satisfies Record<string, Setting>;

export function parseGuardedConfig(
  argv: string[],
  env: NodeJS.ProcessEnv = process.env,
): GuardedConfig {
  const read = readSettings(guardedSettings, argv, env);
  const host = parseHostConfig(read, guardedDefaults);
  const mode = read.get("fence-mode") ?? "monotonic";
  if (mode !== "monotonic" && mode !== "live") {
    throw new ConfigError(
      `--fence-mode (LEASEHOLD_FENCE_MODE) must be monotonic or live, got ${JSON.stringify(mode)}`,
    );
  }
  const leaseUrl = read.get("lease-url");
  if (leaseUrl !== undefined && !/^https?:\/\/[^/\s]+\/?$/.test(leaseUrl)) {
    throw new ConfigError(
      `--lease-url (LEASEHOLD_LEASE_URL) must be an http(s) base URL such as http://127.0.0.1:7070, got ${JSON.stringify(leaseUrl)}`,
    );
  }
  if (leaseUrl === undefined) {
    throw new ConfigError(
      "--lease-url (LEASEHOLD_LEASE_URL) is required: a write that raises a session's fence must be confirmed by the lease server",
    );
  }
  const auth = parseTokenConfig(read);
  const leaseToken = parseLeaseToken(read.get("lease-token"), read.get("lease-token-file"));
  const clients = host.tls?.clients;
  if (auth.keys === undefined && clients === undefined && !isLoopback(host.listenHost)) {
    throw new ConfigError(
      `refusing to listen on ${host.listenHost} without authentication keys: anyone could read and write every account's documents. ` +
        "Set LEASEHOLD_JWT_SECRET or --jwt-secret-file (HS256) or --jwks-file (RS256/ES256), as for the lease server, " +
        "or client certificates (--tls-client-ca with --identity-map), " +
        "or listen on a loopback address such as 127.0.0.1 for development",
    );
  }
  const leaseTls = parseLeaseTls(read, leaseUrl);
  if (auth.keys !== undefined && leaseToken === undefined && leaseTls?.certFile === undefined) {
    throw new ConfigError(
      "with authentication keys the store needs its own token for the lease server's CheckFence: " +
        "set LEASEHOLD_LEASE_TOKEN or --lease-token-file (LEASEHOLD_LEASE_TOKEN_FILE) to a JWT with the lease server's fence scope, " +
        "or --lease-cert and --lease-key to a client certificate the lease server's identity map names",
    );
  }
  return {
    ...host,
    fenceMode: mode,
    auth,
    leaseUrl,
    leaseTimeoutMs: read.duration("lease-timeout", 2_000),
    leaseToken,
    leaseTls,
  };
}

/** --lease-ca, --lease-cert and --lease-key: each file readable, the last two together, https only. */
function parseLeaseTls(
  read: { get(name: "lease-ca" | "lease-cert" | "lease-key"): string | undefined },
  leaseUrl: string,
): ClientTls | undefined {
  const tls: ClientTls = {
    caFile: read.get("lease-ca"),
    certFile: read.get("lease-cert"),
    keyFile: read.get("lease-key"),
  };
  if (Object.values(tls).every((file) => file === undefined)) return undefined;
  if ((tls.certFile === undefined) !== (tls.keyFile === undefined)) {
    throw new ConfigError(
      "--lease-cert (LEASEHOLD_LEASE_CERT) and --lease-key (LEASEHOLD_LEASE_KEY) go together: a client certificate needs its key",
    );
  }
  if (!leaseUrl.startsWith("https://")) {
    throw new ConfigError(
      "--lease-ca, --lease-cert and --lease-key need an https:// --lease-url (LEASEHOLD_LEASE_URL)",
    );
  }
  for (const [flag, file] of [
    ["lease-ca", tls.caFile],
    ["lease-cert", tls.certFile],
    ["lease-key", tls.keyFile],
  ] as const) {
    if (file === undefined) continue;
    try {
      readFileSync(file);
    } catch (error) {
      throw new ConfigError(`--${flag}: cannot read ${file}: ${(error as Error).message}`);
    }
  }
  return tls;
}

function parseLeaseToken(
  text: string | undefined,
  file: string | undefined,
): GuardedConfig["leaseToken"] {
  if (text !== undefined && file !== undefined) {
    throw new ConfigError(
      "set only one of LEASEHOLD_LEASE_TOKEN and --lease-token-file (LEASEHOLD_LEASE_TOKEN_FILE)",
    );
  }
  if (text !== undefined) {
    if (text.trim() === "") throw new ConfigError("LEASEHOLD_LEASE_TOKEN must not be empty");
    return { text: text.trim() };
  }
  if (file === undefined) return undefined;
  // Read once now, so that a missing or empty file stops the start.
  readLeaseTokenFile(file);
  return { file };
}

/** The token in `file`, trimmed; a ConfigError naming the setting when unreadable or empty. */
export function readLeaseTokenFile(file: string): string {
  let token: string;
  try {
    token = readFileSync(file, "utf8").trim();
  } catch (error) {
    throw new ConfigError(
      `--lease-token-file (LEASEHOLD_LEASE_TOKEN_FILE): cannot read ${file}: ${(error as Error).message}`,
    );
  }
  if (token === "") {
    throw new ConfigError(`--lease-token-file (LEASEHOLD_LEASE_TOKEN_FILE): ${file} is empty`);
  }
  return token;
}
