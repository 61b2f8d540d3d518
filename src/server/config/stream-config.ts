// Settings of the streaming side (docs/streams.md): whether changes are
// published to other instances, the two batching ticks, and the period of
// the safety re-check. `parseServerConfig` merges them with the others.

import { ConfigError, type SettingsReader } from "../../config/settings.js";

/** Timing of KeepAlive batching, notifications and the re-check. */
export interface StreamTuning {
  /** Publish committed changes to other instances; off: each instance sees only its own. */
  notifications: boolean;
  /** Least time between the starts of two KeepAlive renewal statements; the longest a renewal waits for one. */
  renewTickMs: number;
  /** Longest wait of a committed change for its publishing statement. */
  notifyTickMs: number;
  /** Period of the safety re-check of watchers and waiters against the database. */
  recheckIntervalMs: number;
  /** Period of the end-to-end check of the LISTEN connection (a ping that must come back). */
  listenCheckIntervalMs: number;
}

export const defaultStreamTuning: StreamTuning = {
  notifications: true,
  renewTickMs: 12,
  notifyTickMs: 10,
  recheckIntervalMs: 30_000,
  listenCheckIntervalMs: 15_000,
};

export const streamSettings = {
  notifications: {
    env: "LEASEHOLD_NOTIFICATIONS",
    help: "on|off: tell other instances about changes (default on)",
  },
  "renew-tick": {
    env: "LEASEHOLD_RENEW_TICK",
    help: "KeepAlive renewal statements start at most this often (default 12ms)",
  },
  "notify-tick": {
    env: "LEASEHOLD_NOTIFY_TICK",
    help: "longest wait of a change before it is published (default 10ms)",
  },
  "recheck-interval": {
    env: "LEASEHOLD_RECHECK_INTERVAL",
    help: "watchers and waiters re-read the database this often (default 30s)",
  },
  "listen-check-interval": {
    env: "LEASEHOLD_LISTEN_CHECK_INTERVAL",
    help: "the notification connection is checked end to end this often (default 15s)",
  },
} as const;

export function parseStreamTuning(read: SettingsReader<keyof typeof streamSettings>): StreamTuning {
  const notificationsText = read.get("notifications") ?? "on";
  if (notificationsText !== "on" && notificationsText !== "off") {
    throw new ConfigError(
      `--notifications (LEASEHOLD_NOTIFICATIONS) must be on or off, got ${JSON.stringify(notificationsText)}`,
    );
  }
  const tuning: StreamTuning = {
    notifications: notificationsText === "on",
    renewTickMs: read.duration("renew-tick", defaultStreamTuning.renewTickMs),
    notifyTickMs: read.duration("notify-tick", defaultStreamTuning.notifyTickMs),
    recheckIntervalMs: read.duration("recheck-interval", defaultStreamTuning.recheckIntervalMs),
    listenCheckIntervalMs: read.duration(
      "listen-check-interval",
      defaultStreamTuning.listenCheckIntervalMs,
    ),
  };
  if (tuning.renewTickMs < 1 || tuning.renewTickMs > 1_000) {
    throw new ConfigError("--renew-tick (LEASEHOLD_RENEW_TICK) must be from 1ms to 1s");
  }
  if (tuning.notifyTickMs < 1 || tuning.notifyTickMs > 1_000) {
    throw new ConfigError("--notify-tick (LEASEHOLD_NOTIFY_TICK) must be from 1ms to 1s");
  }
  if (tuning.recheckIntervalMs < 100) {
    throw new ConfigError("--recheck-interval (LEASEHOLD_RECHECK_INTERVAL) must be at least 100ms");
  }
  if (tuning.listenCheckIntervalMs < 1_000) {
    throw new ConfigError(
      "--listen-check-interval (LEASEHOLD_LISTEN_CHECK_INTERVAL) must be at least 1s",
    );
  }
  return tuning;
}
