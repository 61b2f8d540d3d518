// Input limits (DESIGN §7). One object, built from configuration, read by
// validation; defaults are what a deployment gets without flags.

export interface Limits {
  minTtlMs: number;
  maxTtlMs: number;
  maxWaitMs: number;
  maxIdLength: number;
  maxHolderLength: number;
  maxReasonLength: number;
  defaultPageSize: number;
  maxPageSize: number;
  /** Largest request message, in bytes (Connect's readMaxBytes). */
  maxMessageBytes: number;
  /** Distinct leases one KeepAlive stream may carry at once. */
  maxLeasesPerStream: number;
  /** Open Watch streams per account, across the calls this instance serves. */
  maxWatchersPerAccount: number;
  /** Valid leases one account may hold at once; 0 means no quota. */
  maxLeasesPerAccount: number;
  /** Answers a KeepAlive stream may hold for a client that does not read. */
  maxStreamBacklog: number;
  /** Changes buffered per watcher before it gets a fresh snapshot instead. */
  watchBufferLength: number;
  /** Open keepers one account may hold at once; 0 means no limit. */
  maxKeepersPerAccount: number;
  /** Open leases one keeper may hold at once; 0 means no limit. */
  maxLeasesPerKeeper: number;
  /** Requests one Keep stream may have in flight (unanswered) at once. */
  maxKeeperOpsInFlight: number;
  /** The longest lock-delay a keeper may ask for (K2). */
  maxLockDelayMs: number;
}

export const defaultLimits: Limits = {
  minTtlMs: 1_000,
  maxTtlMs: 3_600_000,
  maxWaitMs: 300_000,
  maxIdLength: 128,
  maxHolderLength: 64,
  maxReasonLength: 256,
  defaultPageSize: 100,
  maxPageSize: 1_000,
  maxMessageBytes: 64 * 1024,
  maxLeasesPerStream: 1_000,
  maxWatchersPerAccount: 100,
  maxLeasesPerAccount: 10_000,
  maxStreamBacklog: 4_096,
  watchBufferLength: 1_024,
  maxKeepersPerAccount: 0,
  maxLeasesPerKeeper: 0,
  maxKeeperOpsInFlight: 256,
  maxLockDelayMs: 60_000,
};

/** Formats milliseconds the way durations are written in flags: 1s, 250ms, 1h. */
export function formatDuration(ms: number): string {
  if (ms !== 0 && ms % 86_400_000 === 0) return `${ms / 86_400_000}d`;
  if (ms !== 0 && ms % 3_600_000 === 0) return `${ms / 3_600_000}h`;
  if (ms !== 0 && ms % 60_000 === 0) return `${ms / 60_000}m`;
  if (ms % 1_000 === 0) return `${ms / 1_000}s`;
  return `${ms}ms`;
}

/** Parses "10s", "250ms", "1m", "1h", "30d", "1.5s"; a bare number is seconds. */
export function parseDuration(text: string): number | undefined {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$/.exec(text.trim());
  if (!m) return undefined;
  const value = Number(m[1]);
  const unit = m[2] ?? "s";
  const factor =
    unit === "ms"
      ? 1
      : unit === "s"
        ? 1_000
        : unit === "m"
          ? 60_000
          : unit === "h"
            ? 3_600_000
            : 86_400_000;
  const ms = value * factor;
  return Number.isSafeInteger(Math.round(ms)) ? Math.round(ms) : undefined;
}
