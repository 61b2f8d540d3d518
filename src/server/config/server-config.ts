// Server configuration: flags override environment variables, which
// override defaults. Every bad value is reported with its name and rule.
// The lease server and the guarded store share the hosting settings
// (database, listener, pool, timeouts); each adds its own.

import { parseArgs } from "node:util";
import { defaultTimeouts } from "../db/pool.js";
import { defaultLimits, type Limits, parseDuration } from "../lease/limits.js";
import {
  checkExposure,
  type OpsConfig,
  opsSettings,
  parseOpsConfig,
  parseTls,
  type TlsConfig,
  tlsSettings,
} from "./ops-config.js";
import { defaultWebDir } from "../http/static.js";
import { parseStreamTuning, type StreamTuning, streamSettings } from "./stream-config.js";

/** What every Leasehold server process needs: a database and a port. */
export interface HostConfig {
  /** Unset: start embedded PostgreSQL under dataDir. */
  databaseUrl: string | undefined;
  dataDir: string;
  listenHost: string;
  listenPort: number;
  poolSize: number;
  statementTimeoutMs: number;
  lockTimeoutMs: number;
  idleInTransactionTimeoutMs: number;
  shutdownGraceMs: number;
  /** Certificate and key: serve TLS only (h2 and HTTP/1.1 by ALPN). */
  tls: TlsConfig | undefined;
}

export interface ServerConfig extends HostConfig {
  limits: Limits;
  ops: OpsConfig;
  streams: StreamTuning;
  /** Folder of the built web page served at `/`. */
  webDir: string;
}

export class ConfigError extends Error {
  override readonly name = "ConfigError";
}

/** A flag and the environment variable it falls back to. */
export interface Setting {
  env: string;
  help: string;
  /** A secret: read from the environment only, since a flag shows in `ps`. */
  envOnly?: boolean;
}

export interface HostDefaults {
  listen: string;
  dataDir: string;
}

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
    ...tlsSettings,
  } as const satisfies Record<string, Setting>;
}

type HostSettingName = keyof ReturnType<typeof hostSettings>;

export const leaseServerDefaults: HostDefaults = {
  listen: "127.0.0.1:7070",
  dataDir: ".leasehold/pgdata",
};

/** Flags of `leasehold serve` and the environment variable each one falls back to. */
export const serverSettings = {
  ...hostSettings(leaseServerDefaults),
  "min-ttl": { env: "LEASEHOLD_MIN_TTL", help: "shortest lease TTL (default 1s)" },
  "max-ttl": { env: "LEASEHOLD_MAX_TTL", help: "longest lease TTL (default 1h)" },
  "max-wait": { env: "LEASEHOLD_MAX_WAIT", help: "longest Acquire wait (default 5m)" },
  ...streamSettings,
  ...opsSettings,
  "web-dir": {
    env: "LEASEHOLD_WEB_DIR",
    help: "built web page served at / (default web/dist of this package)",
  },
} as const satisfies Record<string, Setting>;

/** Reads one settings table: flags first, then the environment. */
export interface SettingsReader<N extends string> {
  get(name: N): string | undefined;
  /** Milliseconds of a duration setting, or `fallback` when unset. */
  duration(name: N, fallback: number): number;
}

export function readSettings<S extends Record<string, Setting>>(
  settings: S,
  argv: string[],
  env: NodeJS.ProcessEnv,
): SettingsReader<keyof S & string> {
  const options = Object.fromEntries(
    Object.entries(settings)
      .filter(([, s]) => !s.envOnly)
      .map(([k]) => [k, { type: "string" as const }]),
  );
  const { values } = parseArgs({ args: argv, options, strict: true, allowPositionals: false });
  // Names are keys of `settings` by their type, so the entry exists.
  const envName = (name: keyof S & string) => (settings[name] as Setting).env;
  const get = (name: keyof S & string): string | undefined => {
    const flag = values[name];
    if (typeof flag === "string") return flag;
    const fromEnv = env[envName(name)];
    return fromEnv === "" ? undefined : fromEnv;
  };
  return {
    get,
    duration: (name, fallback) => {
      const text = get(name);
      if (text === undefined) return fallback;
      const ms = parseDuration(text);
      if (ms === undefined) {
        throw new ConfigError(
          `--${name} (${envName(name)}) must be a duration such as 250ms, 10s, 5m or 1h, got ${JSON.stringify(text)}`,
        );
      }
      return ms;
    },
  };
}

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
  return {
    databaseUrl: read.get("database-url"),
    dataDir: read.get("data-dir") ?? defaults.dataDir,
    listenHost,
    listenPort,
    poolSize,
    statementTimeoutMs: read.duration("statement-timeout", defaultTimeouts.statementTimeoutMs),
    lockTimeoutMs: read.duration("lock-timeout", defaultTimeouts.lockTimeoutMs),
    idleInTransactionTimeoutMs: defaultTimeouts.idleInTransactionTimeoutMs,
    shutdownGraceMs: read.duration("shutdown-grace", 10_000),
    tls: parseTls(read),
  };
}

export function parseServerConfig(
  argv: string[],
  env: NodeJS.ProcessEnv = process.env,
): ServerConfig {
  const read = readSettings(serverSettings, argv, env);
  const host = parseHostConfig(read, leaseServerDefaults);
  const limits: Limits = {
    ...defaultLimits,
    minTtlMs: read.duration("min-ttl", defaultLimits.minTtlMs),
    maxTtlMs: read.duration("max-ttl", defaultLimits.maxTtlMs),
    maxWaitMs: read.duration("max-wait", defaultLimits.maxWaitMs),
  };
  if (limits.minTtlMs < 1 || limits.minTtlMs > limits.maxTtlMs) {
    throw new ConfigError("--min-ttl must be at least 1ms and not above --max-ttl");
  }
  const ops = parseOpsConfig(read, host.statementTimeoutMs);
  checkExposure(host.listenHost, ops.ops.auth);
  return {
    ...host,
    limits: { ...limits, ...ops.limits },
    ops: ops.ops,
    streams: parseStreamTuning(read),
    webDir: read.get("web-dir") ?? defaultWebDir,
  };
}

/** The flag table as help text: flag, environment variable, description. */
export function settingsHelp(settings: Record<string, Setting>): string {
  return Object.entries(settings)
    .map(
      ([flag, s]) => `  ${(s.envOnly ? "" : `--${flag}`).padEnd(28)} ${s.env.padEnd(37)} ${s.help}`,
    )
    .join("\n");
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
