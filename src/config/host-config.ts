// The hosting settings every Leasehold server shares (the lease server and
// the guarded store): database, listener, pool, timeouts and TLS.

import { readFileSync } from "node:fs";
import { ConfigError, type Setting, type SettingsReader } from "./settings.js";

/** Database timeouts of DESIGN §3, set on every connection. */
export const defaultTimeouts = {
  statementTimeoutMs: 5_000,
  lockTimeoutMs: 1_000,
  idleInTransactionTimeoutMs: 10_000,
} as const;

/**
 * Bounds on connections that carry no calls (docs/security.md, "Hostile input
 * at volume"). The idle bound is far above a load balancer's usual 60 s, so
 * the balancer, not the server, closes its idle connections first.
 */
export const defaultConnectionTimeouts = {
  handshakeMs: 10_000,
  idleMs: 300_000,
} as const;

/**
 * Bounds on what one connection's calls may hold before they are let in
 * (docs/security.md, "Bodies before authentication"): HTTP/2 streams at once,
 * and how long a request body may stall while a message is due.
 */
export const defaultRequestBounds = {
  maxStreamsPerConnection: 100,
  readTimeoutMs: 10_000,
} as const;

/**
 * A DATABASE_URL that points at something that is not PostgreSQL (a port
 * that accepts and stays silent, another protocol's server) gets no answer
 * PostgreSQL's driver understands; a few seconds tells it from a slow network.
 */
export const defaultDatabaseConnectTimeoutMs = 5_000;

/** What every Leasehold server process needs: a database and a port. */
export interface HostConfig {
  /** Unset: start embedded PostgreSQL under dataDir. */
  databaseUrl: string | undefined;
  dataDir: string;
  /** dataDir is the default, not named by --data-dir: as root it may move (embedded-postgres.ts). */
  dataDirIsDefault?: boolean;
  /** The embedded PostgreSQL's port; 0 picks a free one. */
  embeddedPort?: number;
  /** Bound on the first connection to DATABASE_URL, whatever answers there. */
  databaseConnectTimeoutMs?: number;
  listenHost: string;
  listenPort: number;
  poolSize: number;
  statementTimeoutMs: number;
  lockTimeoutMs: number;
  idleInTransactionTimeoutMs: number;
  shutdownGraceMs: number;
  /**
   * A connection that has not finished its opening (TLS handshake, HTTP/2
   * preface and SETTINGS, or its first HTTP/1.1 request) within this long is
   * closed: a peer that connects and says nothing must not hold a socket.
   */
  handshakeTimeoutMs: number;
  /** An HTTP/2 connection without open streams, or an idle HTTP/1.1 keep-alive connection, is closed after this long. */
  idleTimeoutMs: number;
  /** HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: concurrent calls per connection. */
  maxStreamsPerConnection: number;
  /**
   * A request body that sends nothing for this long while a message is due
   * (inside a message; for a call that takes one message, before its end)
   * ends its call with DEADLINE_EXCEEDED and its stream is reset.
   */
  readTimeoutMs: number;
  /** Certificate and key: serve TLS only (h2 and HTTP/1.1 by ALPN). */
  tls: TlsConfig | undefined;
  /**
   * JSON request fields the API does not have: refused with INVALID_ARGUMENT
   * (a typo is not silently ignored), or accepted and ignored while clients
   * newer than the server roll out. Binary protobuf always skips them.
   */
  jsonUnknownFields: "refuse" | "accept";
}

/** The TLS files, read at start; src/host/tls-credentials.ts reads them again as they change. */
export interface TlsConfig {
  certFile: string;
  keyFile: string;
  /** Client certificates (mutual TLS): asked for, verified and mapped to accounts. */
  clients: ClientCertificateConfig | undefined;
}

/** require: every call needs a client certificate; optional: a bearer token may stand in. */
export type ClientAuthMode = "require" | "optional";

export interface ClientCertificateConfig {
  /** PEM bundle of the CAs whose client certificates are accepted. */
  caFile: string;
  mode: ClientAuthMode;
  /** Which account each certificate acts for (src/auth/identity-map.ts reads it). */
  identityMapFile: string;
}

export interface HostDefaults {
  listen: string;
  dataDir: string;
}

/** TLS is a hosting setting: every Leasehold server can serve it. */
export const tlsSettings = {
  "tls-cert": { env: "LEASEHOLD_TLS_CERT", help: "PEM certificate chain file; enables TLS" },
  "tls-key": { env: "LEASEHOLD_TLS_KEY", help: "PEM private key file of --tls-cert" },
  "tls-client-ca": {
    env: "LEASEHOLD_TLS_CLIENT_CA",
    help: "PEM CA bundle: ask for client certificates and verify them against it (mutual TLS; needs --identity-map)",
  },
  "tls-client-auth": {
    env: "LEASEHOLD_TLS_CLIENT_AUTH",
    help: "require (default: every call needs a client certificate) or optional (a bearer token may stand in)",
  },
  "identity-map": {
    env: "LEASEHOLD_IDENTITY_MAP",
    help: "YAML or JSON file mapping client certificates (SPIFFE ID, subject CN, DNS name) to accounts and scopes",
  },
} as const;

type TlsSettingName = keyof typeof tlsSettings;

/** The hosting flags, with the defaults of one kind of server in their help. */
export function hostSettings(defaults: HostDefaults) {
  return {
    "database-url": {
      env: "DATABASE_URL",
      help: "PostgreSQL URL; unset starts embedded PostgreSQL",
    },
    "data-dir": {
      env: "LEASEHOLD_DATA_DIR",
      help: `embedded PostgreSQL data folder (default ${defaults.dataDir})`,
    },
    "embedded-port": {
      env: "LEASEHOLD_EMBEDDED_PORT",
      help: "embedded PostgreSQL's port on 127.0.0.1 (default: a free port, picked at each start)",
    },
    "database-connect-timeout": {
      env: "LEASEHOLD_DATABASE_CONNECT_TIMEOUT",
      help: "the first connection to --database-url must get PostgreSQL's answer within this, whatever listens there (default 5s)",
    },
    listen: { env: "LEASEHOLD_LISTEN", help: `host:port to serve on (default ${defaults.listen})` },
    "pool-size": { env: "LEASEHOLD_POOL_SIZE", help: "database connections (default 20)" },
    "statement-timeout": { env: "LEASEHOLD_STATEMENT_TIMEOUT", help: "per statement (default 5s)" },
    "lock-timeout": {
      env: "LEASEHOLD_LOCK_TIMEOUT",
      help: "row lock wait before UNAVAILABLE (default 1s)",
    },
    "shutdown-grace": {
      env: "LEASEHOLD_SHUTDOWN_GRACE",
      help: "time to drain on SIGTERM (default 10s)",
    },
    "handshake-timeout": {
      env: "LEASEHOLD_HANDSHAKE_TIMEOUT",
      help: "a connection must finish TLS, the HTTP/2 preface or its first HTTP/1.1 request within this (default 10s)",
    },
    "idle-timeout": {
      env: "LEASEHOLD_IDLE_TIMEOUT",
      help: "an HTTP/2 connection without open streams, or an idle HTTP/1.1 one, is closed after this (default 5m)",
    },
    "max-streams-per-connection": {
      env: "LEASEHOLD_MAX_STREAMS_PER_CONNECTION",
      help: `concurrent HTTP/2 streams per connection (default ${defaultRequestBounds.maxStreamsPerConnection})`,
    },
    "read-timeout": {
      env: "LEASEHOLD_READ_TIMEOUT",
      help: "a request body that sends nothing this long while a message is due ends its call with DEADLINE_EXCEEDED (default 10s)",
    },
    "json-unknown-fields": {
      env: "LEASEHOLD_JSON_UNKNOWN_FIELDS",
      help: "refuse (default: INVALID_ARGUMENT naming them) or accept (ignore, e.g. during a rolling upgrade) JSON request fields the API does not have",
    },
    ...tlsSettings,
  } as const satisfies Record<string, Setting>;
}

type HostSettingName = keyof ReturnType<typeof hostSettings>;

/** The hosting part of a configuration, from a reader over `hostSettings`. */
export function parseHostConfig(
  read: SettingsReader<HostSettingName>,
  defaults: HostDefaults,
): HostConfig {
  const [listenHost, listenPort] = parseListen(read.get("listen") ?? defaults.listen);
  const poolText = read.get("pool-size") ?? "20";
  const poolSize = Number(poolText);
  if (!Number.isInteger(poolSize) || poolSize < 1 || poolSize > 1000) {
    throw new ConfigError(`--pool-size must be an integer from 1 to 1000, got ${poolText}`);
  }
  const embeddedPortText = read.get("embedded-port") ?? "0";
  const embeddedPort = Number(embeddedPortText);
  if (!/^\d+$/.test(embeddedPortText) || embeddedPort > 65535) {
    throw new ConfigError(
      `--embedded-port (LEASEHOLD_EMBEDDED_PORT) must be a port from 1 to 65535 (0: a free one), got ${JSON.stringify(embeddedPortText)}`,
    );
  }
  const databaseConnectTimeoutMs = read.duration(
    "database-connect-timeout",
    defaultDatabaseConnectTimeoutMs,
  );
  if (databaseConnectTimeoutMs < 100) {
    throw new ConfigError(
      "--database-connect-timeout (LEASEHOLD_DATABASE_CONNECT_TIMEOUT) must be at least 100ms",
    );
  }
  const handshakeTimeoutMs = read.duration(
    "handshake-timeout",
    defaultConnectionTimeouts.handshakeMs,
  );
  if (handshakeTimeoutMs < 100) {
    throw new ConfigError(
      "--handshake-timeout (LEASEHOLD_HANDSHAKE_TIMEOUT) must be at least 100ms",
    );
  }
  const idleTimeoutMs = read.duration("idle-timeout", defaultConnectionTimeouts.idleMs);
  if (idleTimeoutMs < 100) {
    throw new ConfigError("--idle-timeout (LEASEHOLD_IDLE_TIMEOUT) must be at least 100ms");
  }
  const readTimeoutMs = read.duration("read-timeout", defaultRequestBounds.readTimeoutMs);
  if (readTimeoutMs < 100) {
    throw new ConfigError("--read-timeout (LEASEHOLD_READ_TIMEOUT) must be at least 100ms");
  }
  const streamsText = read.get("max-streams-per-connection");
  const maxStreamsPerConnection =
    streamsText === undefined ? defaultRequestBounds.maxStreamsPerConnection : Number(streamsText);
  if (
    !/^\d+$/.test(streamsText?.trim() ?? "1") ||
    !Number.isSafeInteger(maxStreamsPerConnection) ||
    maxStreamsPerConnection < 1 ||
    maxStreamsPerConnection > 100_000
  ) {
    throw new ConfigError(
      `--max-streams-per-connection (LEASEHOLD_MAX_STREAMS_PER_CONNECTION) must be an integer from 1 to 100000, got ${JSON.stringify(streamsText)}`,
    );
  }
  return {
    databaseUrl: parseDatabaseUrl(read.get("database-url")),
    dataDir: read.get("data-dir") ?? defaults.dataDir,
    dataDirIsDefault: read.get("data-dir") === undefined,
    embeddedPort,
    databaseConnectTimeoutMs,
    listenHost,
    listenPort,
    poolSize,
    statementTimeoutMs: read.duration("statement-timeout", defaultTimeouts.statementTimeoutMs),
    lockTimeoutMs: read.duration("lock-timeout", defaultTimeouts.lockTimeoutMs),
    idleInTransactionTimeoutMs: defaultTimeouts.idleInTransactionTimeoutMs,
    shutdownGraceMs: read.duration("shutdown-grace", 10_000),
    handshakeTimeoutMs,
    idleTimeoutMs,
    maxStreamsPerConnection,
    readTimeoutMs,
    tls: parseTls(read),
    jsonUnknownFields: parseJsonUnknownFields(read.get("json-unknown-fields")),
  };
}

/** A URL for messages and logs: its password replaced by ***. */
export function hidePassword(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = "***";
    return u.toString();
  } catch {
    // Not a URL: hide whatever sits between "user:" and "@".
    return url.replace(/:[^:@/]*@/, ":***@");
  }
}

/**
 * DATABASE_URL must be a postgres:// or postgresql:// URL: any other scheme
 * would be taken by the driver as PostgreSQL at its default port anyway.
 */
export function parseDatabaseUrl(text: string | undefined): string | undefined {
  if (text === undefined) return undefined;
  const name = "--database-url (DATABASE_URL)";
  const shown = hidePassword(text);
  let url: URL;
  // "localhost:5432" parses as a URL of scheme "localhost:".
  if (!text.includes("://")) {
    throw new ConfigError(
      `${name} must be a URL such as postgres://user:password@host:5432/database, got ${JSON.stringify(shown)} (no postgres:// in front)`,
    );
  }
  try {
    url = new URL(text);
  } catch {
    throw new ConfigError(
      `${name} must be a URL such as postgres://user:password@host:5432/database, got ${JSON.stringify(shown)}`,
    );
  }
  if (url.protocol !== "postgres:" && url.protocol !== "postgresql:") {
    throw new ConfigError(
      `${name} must start with postgres:// or postgresql://, got ${url.protocol}// in ${shown}`,
    );
  }
  if (url.hostname === "" && !url.searchParams.has("host")) {
    throw new ConfigError(`${name} names no host: ${shown}`);
  }
  return text;
}

function parseJsonUnknownFields(text: string | undefined): "refuse" | "accept" {
  const value = text ?? "refuse";
  if (value !== "refuse" && value !== "accept") {
    throw new ConfigError(
      `--json-unknown-fields (LEASEHOLD_JSON_UNKNOWN_FIELDS) must be refuse or accept, got ${JSON.stringify(value)}`,
    );
  }
  return value;
}

export function parseListen(text: string): [string, number] {
  const m = /^(?:\[([^\]]+)\]|([^:]*)):(\d{1,5})$/.exec(text);
  const port = Number(m?.[3]);
  if (!m || port > 65535) {
    throw new ConfigError(
      `--listen (LEASEHOLD_LISTEN) must be host:port such as 127.0.0.1:7070, got ${JSON.stringify(text)}`,
    );
  }
  return [m[1] ?? (m[2] || "127.0.0.1"), port];
}

export function parseTls(read: {
  get(name: TlsSettingName): string | undefined;
}): TlsConfig | undefined {
  const certFile = read.get("tls-cert");
  const keyFile = read.get("tls-key");
  if (certFile === undefined && keyFile === undefined) {
    if (read.get("tls-client-ca") !== undefined || read.get("identity-map") !== undefined) {
      throw new ConfigError(
        "client certificates need TLS: set --tls-cert (LEASEHOLD_TLS_CERT) and --tls-key (LEASEHOLD_TLS_KEY) too",
      );
    }
    return undefined;
  }
  if (certFile === undefined || keyFile === undefined) {
    throw new ConfigError(
      "TLS needs both --tls-cert (LEASEHOLD_TLS_CERT) and --tls-key (LEASEHOLD_TLS_KEY)",
    );
  }
  const clients = parseClientCertificates(read);
  // Read once here, so that a missing or unreadable file stops the start
  // with a message naming the setting.
  for (const [name, file] of [
    ["tls-cert", certFile],
    ["tls-key", keyFile],
    ["tls-client-ca", clients?.caFile],
    ["identity-map", clients?.identityMapFile],
  ] as const) {
    if (file !== undefined) readSettingFile(name, file);
  }
  return { certFile, keyFile, clients };
}

function parseClientCertificates(read: {
  get(name: TlsSettingName): string | undefined;
}): ClientCertificateConfig | undefined {
  const caFile = read.get("tls-client-ca");
  const mapFile = read.get("identity-map");
  const modeText = read.get("tls-client-auth");
  if (caFile === undefined) {
    if (mapFile !== undefined || modeText !== undefined) {
      throw new ConfigError(
        "--identity-map and --tls-client-auth need --tls-client-ca (LEASEHOLD_TLS_CLIENT_CA): the CA bundle client certificates are verified against",
      );
    }
    return undefined;
  }
  if (mapFile === undefined) {
    throw new ConfigError(
      "--tls-client-ca needs --identity-map (LEASEHOLD_IDENTITY_MAP): which account each client certificate acts for",
    );
  }
  const mode = modeText ?? "require";
  if (mode !== "require" && mode !== "optional") {
    throw new ConfigError(
      `--tls-client-auth (LEASEHOLD_TLS_CLIENT_AUTH) must be require or optional, got ${JSON.stringify(mode)}`,
    );
  }
  return { caFile, mode, identityMapFile: mapFile };
}

export function readSettingFile(name: TlsSettingName, file: string): string {
  try {
    return readFileSync(file, "utf8");
  } catch (error) {
    throw new ConfigError(
      `--${name} (${tlsSettings[name].env}): cannot read ${file}: ${(error as Error).message}`,
    );
  }
}
