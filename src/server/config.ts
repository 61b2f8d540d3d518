// Server configuration: flags override environment variables, which
// override defaults. Every bad value is reported with its name and rule.

import { parseArgs } from "node:util";
import { defaultTimeouts } from "./db.js";
import { defaultLimits, type Limits, parseDuration } from "./limits.js";

export interface ServerConfig {
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
  limits: Limits;
}

export class ConfigError extends Error {
  override readonly name = "ConfigError";
}

/** Flags and the environment variable each one falls back to. */
export const serverSettings = {
  "database-url": { env: "DATABASE_URL", help: "PostgreSQL URL; unset starts embedded PostgreSQL" },
  "data-dir": {
    env: "LEASEHOLD_DATA_DIR",
    help: "embedded PostgreSQL data folder (default .leasehold/pgdata)",
  },
  listen: { env: "LEASEHOLD_LISTEN", help: "host:port to serve on (default 127.0.0.1:7070)" },
  "pool-size": { env: "LEASEHOLD_POOL_SIZE", help: "database connections (default 20)" },
  "min-ttl": { env: "LEASEHOLD_MIN_TTL", help: "shortest lease TTL (default 1s)" },
  "max-ttl": { env: "LEASEHOLD_MAX_TTL", help: "longest lease TTL (default 1h)" },
  "max-wait": { env: "LEASEHOLD_MAX_WAIT", help: "longest Acquire wait (default 5m)" },
  "statement-timeout": { env: "LEASEHOLD_STATEMENT_TIMEOUT", help: "per statement (default 5s)" },
  "lock-timeout": {
    env: "LEASEHOLD_LOCK_TIMEOUT",
    help: "row lock wait before UNAVAILABLE (default 1s)",
  },
  "shutdown-grace": {
    env: "LEASEHOLD_SHUTDOWN_GRACE",
    help: "time to drain on SIGTERM (default 10s)",
  },
} as const;

type SettingName = keyof typeof serverSettings;

export function parseServerConfig(
  argv: string[],
  env: NodeJS.ProcessEnv = process.env,
): ServerConfig {
  const options = Object.fromEntries(
    Object.keys(serverSettings).map((k) => [k, { type: "string" as const }]),
  );
  const { values } = parseArgs({ args: argv, options, strict: true, allowPositionals: false });
  const get = (name: SettingName): string | undefined => {
    const flag = values[name];
    if (typeof flag === "string") return flag;
    const fromEnv = env[serverSettings[name].env];
    return fromEnv === "" ? undefined : fromEnv;
  };
  const duration = (name: SettingName, fallback: number): number => {
    const text = get(name);
    if (text === undefined) return fallback;
    const ms = parseDuration(text);
    if (ms === undefined) {
      throw new ConfigError(
        `--${name} (${serverSettings[name].env}) must be a duration such as 250ms, 10s, 5m or 1h, got ${JSON.stringify(text)}`,
      );
    }
    return ms;
  };
  const [listenHost, listenPort] = parseListen(get("listen") ?? "127.0.0.1:7070");
  const poolText = get("pool-size") ?? "20";
  const poolSize = Number(poolText);
  if (!Number.isInteger(poolSize) || poolSize < 1 || poolSize > 1000) {
    throw new ConfigError(`--pool-size must be an integer from 1 to 1000, got ${poolText}`);
  }
  const limits: Limits = {
    ...defaultLimits,
    minTtlMs: duration("min-ttl", defaultLimits.minTtlMs),
    maxTtlMs: duration("max-ttl", defaultLimits.maxTtlMs),
    maxWaitMs: duration("max-wait", defaultLimits.maxWaitMs),
  };
  if (limits.minTtlMs < 1 || limits.minTtlMs > limits.maxTtlMs) {
    throw new ConfigError("--min-ttl must be at least 1ms and not above --max-ttl");
  }
  return {
    databaseUrl: get("database-url"),
    dataDir: get("data-dir") ?? ".leasehold/pgdata",
    listenHost,
    listenPort,
    poolSize,
    statementTimeoutMs: duration("statement-timeout", defaultTimeouts.statementTimeoutMs),
    lockTimeoutMs: duration("lock-timeout", defaultTimeouts.lockTimeoutMs),
    idleInTransactionTimeoutMs: defaultTimeouts.idleInTransactionTimeoutMs,
    shutdownGraceMs: duration("shutdown-grace", 10_000),
    limits,
  };
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
