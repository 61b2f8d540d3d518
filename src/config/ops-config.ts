// Settings of the operational surface: authentication keys, TLS, the limits
// beyond TTLs, health probing and retention. `parseServerConfig` merges them
// with the hosting settings of config.ts; every bad value is a ConfigError
// naming the flag, its environment variable and the rule.

import { readFileSync } from "node:fs";
import net from "node:net";
import { createLocalJWKSet, type JSONWebKeySet } from "jose";
import { defaultLimits, type Limits } from "../lease/limits.js";
import type { TlsConfig } from "./host-config.js";
import { ConfigError, integerSetting } from "./settings.js";

/** Where verification keys come from; undefined keys mean development mode. */
export type VerificationKeys =
  | { kind: "hs256"; secret: Uint8Array }
  | { kind: "jwks"; file: string; jwks: JSONWebKeySet };

export type SessionAuthorizerKind = "own-account" | "acl-table";

/** How bearer tokens are verified: what every Leasehold server that authenticates shares. */
export interface TokenConfig {
  /** Unset: development mode, allowed only on loopback addresses. */
  keys: VerificationKeys | undefined;
  issuer: string | undefined;
  /** Accepted `aud` values; empty accepts any. */
  audience: string[];
  /** The claim naming the caller's account. */
  accountClaim: string;
  /** Accept tokens without an `exp` claim (default refused). */
  allowTokensWithoutExp?: boolean;
}

export interface AuthConfig extends TokenConfig {
  /** The scope (in the space-separated `scope` claim) that Revoke needs. */
  adminScope: string;
  /**
   * The scope of a guarded resource's own token: CheckFence on the sessions
   * of any account (and nothing more), for live-mode fencing.
   */
  fenceScope: string;
  sessionAuthorizer: SessionAuthorizerKind;
}

export interface RetentionConfig {
  /** lease_events rows older than this are deleted. */
  eventRetentionMs: number;
  /** Tombstones whose expiry is older than this are deleted (S6: see docs/operations.md). */
  tombstoneHorizonMs: number;
  /** How often each instance runs the trimming. */
  intervalMs: number;
}

export interface OpsConfig {
  auth: AuthConfig;
  /** Share of successful calls written to the request log, 0 to 1; failures are always logged. */
  accessLogSample: number;
  /** How often the database is probed for gRPC health. */
  healthIntervalMs: number;
  retention: RetentionConfig;
}

/**
 * Flags of the operational settings and the environment variable each falls
 * back to. `envOnly` settings hold secrets: a flag would show them to anyone
 * who can list processes.
 */
export const tokenSettings = {
  "jwt-secret": {
    env: "LEASEHOLD_JWT_SECRET",
    help: "HS256 shared secret, at least 32 bytes (environment only)",
    envOnly: true,
  },
  "jwt-secret-file": { env: "LEASEHOLD_JWT_SECRET_FILE", help: "file holding the HS256 secret" },
  "jwks-file": { env: "LEASEHOLD_JWKS_FILE", help: "JWKS file of RS256/ES256 public keys" },
  "jwt-issuer": { env: "LEASEHOLD_JWT_ISSUER", help: "required `iss` of tokens (default any)" },
  "jwt-audience": {
    env: "LEASEHOLD_JWT_AUDIENCE",
    help: "accepted `aud` values, comma-separated (default any)",
  },
  "account-claim": {
    env: "LEASEHOLD_ACCOUNT_CLAIM",
    help: "token claim naming the account (default sub)",
  },
  "allow-tokens-without-exp": {
    env: "LEASEHOLD_ALLOW_TOKENS_WITHOUT_EXP",
    help: "on|off: accept tokens that have no exp claim (default off: refused)",
  },
} as const;

export type TokenSettingName = keyof typeof tokenSettings;

export const opsSettings = {
  ...tokenSettings,
  "admin-scope": {
    env: "LEASEHOLD_ADMIN_SCOPE",
    help: "scope that Revoke needs (default leasehold:admin)",
  },
  "fence-scope": {
    env: "LEASEHOLD_FENCE_SCOPE",
    help: "scope that lets a guarded resource call CheckFence for any account (default leasehold:fence)",
  },
  "session-authorizer": {
    env: "LEASEHOLD_SESSION_AUTHORIZER",
    help: "own-account (default) or acl-table (the session_acl table)",
  },
  "max-message-bytes": {
    env: "LEASEHOLD_MAX_MESSAGE_BYTES",
    help: "largest request message (default 65536)",
  },
  "max-leases-per-stream": {
    env: "LEASEHOLD_MAX_LEASES_PER_STREAM",
    help: "leases one KeepAlive stream may carry (default 1000)",
  },
  "max-watchers-per-account": {
    env: "LEASEHOLD_MAX_WATCHERS_PER_ACCOUNT",
    help: "open Watch streams per account per instance (default 100)",
  },
  "max-leases-per-account": {
    env: "LEASEHOLD_MAX_LEASES_PER_ACCOUNT",
    help: "valid leases per account, 0 for no quota (default 10000)",
  },
  "access-log-sample": {
    env: "LEASEHOLD_ACCESS_LOG_SAMPLE",
    help: "share of successful calls logged, 0 to 1; failures always are (default 0)",
  },
  "health-interval": {
    env: "LEASEHOLD_HEALTH_INTERVAL",
    help: "database probe period for gRPC health (default 2s)",
  },
  "event-retention": {
    env: "LEASEHOLD_EVENT_RETENTION",
    help: "age at which History events are deleted (default 30d)",
  },
  "tombstone-horizon": {
    env: "LEASEHOLD_TOMBSTONE_HORIZON",
    help: "age at which ended leases are deleted (default 1d)",
  },
  "maintenance-interval": {
    env: "LEASEHOLD_MAINTENANCE_INTERVAL",
    help: "period of retention trimming (default 10m)",
  },
} as const;

export type OpsSettingName = keyof typeof opsSettings;

export interface OpsSettingsReader {
  get(name: OpsSettingName): string | undefined;
  duration(name: OpsSettingName, fallback: number): number;
}

/** The operational part of the configuration, and the limits it sets. */
export function parseOpsConfig(
  read: OpsSettingsReader,
  statementTimeoutMs: number,
): { ops: OpsConfig; limits: Partial<Limits> } {
  const integer = (name: OpsSettingName, fallback: number, min: number, max: number) =>
    integerSetting(name, opsSettings[name], read.get(name), fallback, min, max);
  const limits: Partial<Limits> = {
    maxMessageBytes: integer("max-message-bytes", defaultLimits.maxMessageBytes, 1024, 64 << 20),
    maxLeasesPerStream: integer(
      "max-leases-per-stream",
      defaultLimits.maxLeasesPerStream,
      1,
      1_000_000,
    ),
    maxWatchersPerAccount: integer(
      "max-watchers-per-account",
      defaultLimits.maxWatchersPerAccount,
      1,
      1_000_000,
    ),
    maxLeasesPerAccount: integer(
      "max-leases-per-account",
      defaultLimits.maxLeasesPerAccount,
      0,
      1_000_000_000,
    ),
  };
  const retention: RetentionConfig = {
    eventRetentionMs: read.duration("event-retention", 30 * 86_400_000),
    tombstoneHorizonMs: read.duration("tombstone-horizon", 86_400_000),
    intervalMs: read.duration("maintenance-interval", 600_000),
  };
  // S6: a statement that drew a token before a tombstone was deleted must
  // have been cancelled by statement_timeout long before the delete. A wide
  // margin also covers a database clock that steps.
  const minimumHorizon = Math.max(60_000, 10 * statementTimeoutMs);
  if (retention.tombstoneHorizonMs < minimumHorizon) {
    throw new ConfigError(
      `--tombstone-horizon (LEASEHOLD_TOMBSTONE_HORIZON) must be at least 1m and 10 times --statement-timeout (${minimumHorizon}ms here), got ${retention.tombstoneHorizonMs}ms`,
    );
  }
  if (retention.intervalMs < 1_000) {
    throw new ConfigError(
      "--maintenance-interval (LEASEHOLD_MAINTENANCE_INTERVAL) must be at least 1s",
    );
  }
  const healthIntervalMs = read.duration("health-interval", 2_000);
  if (healthIntervalMs < 50) {
    throw new ConfigError("--health-interval (LEASEHOLD_HEALTH_INTERVAL) must be at least 50ms");
  }
  const sampleText = read.get("access-log-sample");
  const accessLogSample = sampleText === undefined ? 0 : Number(sampleText);
  if (sampleText !== undefined && (!/^\d*\.?\d+$/.test(sampleText.trim()) || accessLogSample > 1)) {
    throw new ConfigError(
      `--access-log-sample (LEASEHOLD_ACCESS_LOG_SAMPLE) must be a number from 0 to 1, got ${JSON.stringify(sampleText)}`,
    );
  }
  return {
    ops: { auth: parseAuth(read), accessLogSample, healthIntervalMs, retention },
    limits,
  };
}

function parseAuth(read: OpsSettingsReader): AuthConfig {
  const authorizer = read.get("session-authorizer") ?? "own-account";
  if (authorizer !== "own-account" && authorizer !== "acl-table") {
    throw new ConfigError(
      `--session-authorizer (LEASEHOLD_SESSION_AUTHORIZER) must be own-account or acl-table, got ${JSON.stringify(authorizer)}`,
    );
  }
  const adminScope = read.get("admin-scope") ?? "leasehold:admin";
  if (/\s/.test(adminScope) || adminScope === "") {
    throw new ConfigError("--admin-scope (LEASEHOLD_ADMIN_SCOPE) must be one scope without spaces");
  }
  const fenceScope = read.get("fence-scope") ?? "leasehold:fence";
  if (/\s/.test(fenceScope) || fenceScope === "") {
    throw new ConfigError("--fence-scope (LEASEHOLD_FENCE_SCOPE) must be one scope without spaces");
  }
  return { ...parseTokenConfig(read), adminScope, fenceScope, sessionAuthorizer: authorizer };
}

/** The token settings (`tokenSettings`), as the lease server and the guarded store read them. */
export function parseTokenConfig(read: {
  get(name: TokenSettingName): string | undefined;
}): TokenConfig {
  const secretText = read.get("jwt-secret");
  const secretFile = read.get("jwt-secret-file");
  const jwksFile = read.get("jwks-file");
  const sources = [secretText, secretFile, jwksFile].filter((s) => s !== undefined).length;
  if (sources > 1) {
    throw new ConfigError(
      "set only one of LEASEHOLD_JWT_SECRET, --jwt-secret-file (LEASEHOLD_JWT_SECRET_FILE) and --jwks-file (LEASEHOLD_JWKS_FILE)",
    );
  }
  let keys: VerificationKeys | undefined;
  if (secretText !== undefined || secretFile !== undefined) {
    const text =
      secretText ?? readSettingFile("jwt-secret-file", secretFile ?? "").replace(/\r?\n$/, "");
    const secret = new TextEncoder().encode(text);
    // RFC 7518 §3.2: an HS256 key must be at least as long as the hash.
    if (secret.length < 32) {
      throw new ConfigError(
        `the HS256 secret (LEASEHOLD_JWT_SECRET or LEASEHOLD_JWT_SECRET_FILE) must be at least 32 bytes, got ${secret.length}`,
      );
    }
    keys = { kind: "hs256", secret };
  } else if (jwksFile !== undefined) {
    let jwks: JSONWebKeySet;
    try {
      jwks = JSON.parse(readSettingFile("jwks-file", jwksFile)) as JSONWebKeySet;
      createLocalJWKSet(jwks);
    } catch (error) {
      if (error instanceof ConfigError) throw error;
      throw new ConfigError(
        `--jwks-file (LEASEHOLD_JWKS_FILE) ${jwksFile} is not a JSON Web Key Set: ${(error as Error).message}`,
      );
    }
    keys = { kind: "jwks", file: jwksFile, jwks };
  }
  const withoutExp = read.get("allow-tokens-without-exp") ?? "off";
  if (withoutExp !== "on" && withoutExp !== "off") {
    throw new ConfigError(
      `--allow-tokens-without-exp (LEASEHOLD_ALLOW_TOKENS_WITHOUT_EXP) must be on or off, got ${JSON.stringify(withoutExp)}`,
    );
  }
  return {
    keys,
    issuer: read.get("jwt-issuer"),
    audience: (read.get("jwt-audience") ?? "")
      .split(",")
      .map((a) => a.trim())
      .filter((a) => a !== ""),
    accountClaim: read.get("account-claim") ?? "sub",
    allowTokensWithoutExp: withoutExp === "on",
  };
}

/** True for 127.0.0.0/8, ::1 and the name localhost. */
export function isLoopback(host: string): boolean {
  if (host === "localhost") return true;
  const mapped = host.toLowerCase().startsWith("::ffff:") ? host.slice(7) : host;
  if (net.isIPv4(mapped)) return mapped.startsWith("127.");
  if (net.isIPv6(host)) return host === "::1" || /^(0{0,4}:){7}0{0,3}1$/.test(host);
  return false;
}

/**
 * Development mode (neither token keys nor client certificates) accepts
 * calls without credentials, so it may only listen where nobody else can
 * connect. Refuses anything else, saying how to configure authentication.
 */
export function checkExposure(listenHost: string, auth: TokenConfig, tls?: TlsConfig): void {
  if (auth.keys !== undefined || tls?.clients !== undefined || isLoopback(listenHost)) return;
  throw new ConfigError(
    `refusing to listen on ${listenHost} without authentication keys: anyone could reach every account's leases. ` +
      "Set LEASEHOLD_JWT_SECRET or --jwt-secret-file (HS256) or --jwks-file (RS256/ES256), " +
      "or client certificates (--tls-client-ca with --identity-map), " +
      "or listen on a loopback address such as 127.0.0.1 for development",
  );
}

function readSettingFile(name: TokenSettingName, file: string): string {
  try {
    return readFileSync(file, "utf8");
  } catch (error) {
    throw new ConfigError(
      `--${name} (${tokenSettings[name].env}): cannot read ${file}: ${(error as Error).message}`,
    );
  }
}
