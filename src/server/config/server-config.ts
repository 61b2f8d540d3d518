// Configuration of `leasehold serve`: the hosting settings, TTL bounds, the
// streaming side and the operational surface. Flags override environment
// variables, which override defaults; every bad value is a ConfigError naming
// the flag and the rule.

import { fileURLToPath } from "node:url";
import {
  type HostConfig,
  type HostDefaults,
  hostSettings,
  parseHostConfig,
} from "../../config/host-config.js";
import {
  checkExposure,
  type OpsConfig,
  opsSettings,
  parseOpsConfig,
} from "../../config/ops-config.js";
import { ConfigError, integerSetting, readSettings, type Setting } from "../../config/settings.js";
import { defaultLimits, type Limits } from "../../lease/limits.js";
import { parseStreamTuning, type StreamTuning, streamSettings } from "./stream-config.js";
import { parseTracingConfig, type TracingConfig, tracingSettings } from "./tracing-config.js";

/** The built web page of this package (vite's output), served at `/`. */
export const defaultWebDir = fileURLToPath(new URL("../../../web/dist/", import.meta.url));

export interface ServerConfig extends HostConfig {
  limits: Limits;
  ops: OpsConfig;
  streams: StreamTuning;
  /** Folder of the built web page served at `/`. */
  webDir: string;
  /**
   * Who serves gRPC clients' unary calls: the native path (grpc-native.ts)
   * or, like every other protocol, the Connect adapter.
   */
  grpcPath: "native" | "connect";
  /** OpenTelemetry spans (tracing-config.ts); off by default. */
  tracing: TracingConfig;
}

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
  "max-keepers-per-account": {
    env: "LEASEHOLD_MAX_KEEPERS_PER_ACCOUNT",
    help: "open keepers per account, 0 for no limit (default 0)",
  },
  "max-leases-per-keeper": {
    env: "LEASEHOLD_MAX_LEASES_PER_KEEPER",
    help: "open leases on one keeper, 0 for no limit (default 0)",
  },
  "max-keeper-ops-in-flight": {
    env: "LEASEHOLD_MAX_KEEPER_OPS_IN_FLIGHT",
    help: "requests one Keep stream may have unanswered (default 256)",
  },
  "max-lock-delay": {
    env: "LEASEHOLD_MAX_LOCK_DELAY",
    help: "longest lock-delay a keeper may ask for (default 60s)",
  },
  ...streamSettings,
  ...opsSettings,
  ...tracingSettings,
  "grpc-path": {
    env: "LEASEHOLD_GRPC_PATH",
    help: "native (default) or connect: what serves gRPC clients' LeaseService calls",
  },
  "web-dir": {
    env: "LEASEHOLD_WEB_DIR",
    help: "built web page served at / (default web/dist of this package)",
  },
} as const satisfies Record<string, Setting>;

export function parseServerConfig(
  argv: string[],
  env: NodeJS.ProcessEnv = process.env,
): ServerConfig {
  const read = readSettings(serverSettings, argv, env);
  const count = (
    name: "max-keepers-per-account" | "max-leases-per-keeper" | "max-keeper-ops-in-flight",
    fallback: number,
    min: number,
    max: number,
  ) => integerSetting(name, serverSettings[name], read.get(name), fallback, min, max);
  const host = parseHostConfig(read, leaseServerDefaults);
  const limits: Limits = {
    ...defaultLimits,
    minTtlMs: read.duration("min-ttl", defaultLimits.minTtlMs),
    maxTtlMs: read.duration("max-ttl", defaultLimits.maxTtlMs),
    maxWaitMs: read.duration("max-wait", defaultLimits.maxWaitMs),
    maxKeepersPerAccount: count(
      "max-keepers-per-account",
      defaultLimits.maxKeepersPerAccount,
      0,
      1_000_000_000,
    ),
    maxLeasesPerKeeper: count(
      "max-leases-per-keeper",
      defaultLimits.maxLeasesPerKeeper,
      0,
      1_000_000_000,
    ),
    maxKeeperOpsInFlight: count(
      "max-keeper-ops-in-flight",
      defaultLimits.maxKeeperOpsInFlight,
      1,
      100_000,
    ),
    maxLockDelayMs: read.duration("max-lock-delay", defaultLimits.maxLockDelayMs),
  };
  if (limits.maxLockDelayMs > 86_400_000) {
    throw new ConfigError(
      `--max-lock-delay (LEASEHOLD_MAX_LOCK_DELAY) must be at most 1d, got ${limits.maxLockDelayMs}ms`,
    );
  }
  if (limits.minTtlMs < 1 || limits.minTtlMs > limits.maxTtlMs) {
    throw new ConfigError("--min-ttl must be at least 1ms and not above --max-ttl");
  }
  const ops = parseOpsConfig(read, host.statementTimeoutMs);
  checkExposure(host.listenHost, ops.ops.auth, host.tls);
  return {
    ...host,
    limits: { ...limits, ...ops.limits },
    ops: ops.ops,
    streams: parseStreamTuning(read),
    webDir: read.get("web-dir") ?? defaultWebDir,
    grpcPath: parseGrpcPath(read.get("grpc-path")),
    tracing: parseTracingConfig(read, env),
  };
}

function parseGrpcPath(text: string | undefined): "native" | "connect" {
  const value = text ?? "native";
  if (value !== "native" && value !== "connect") {
    throw new ConfigError(
      `--grpc-path (LEASEHOLD_GRPC_PATH) must be native or connect, got ${JSON.stringify(value)}`,
    );
  }
  return value;
}
