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
};

/** Formats milliseconds the way durations are written in flags: 1s, 250ms, 1h. */
export function formatDuration(ms: number): string {
  if (ms !== 0 && ms % 3_600_000 === 0) return `${ms / 3_600_000}h`;
  if (ms !== 0 && ms % 60_000 === 0) return `${ms / 60_000}m`;
  if (ms % 1_000 === 0) return `${ms / 1_000}s`;
  return `${ms}ms`;
}

/** Parses "10s", "250ms", "1m", "1h", "1.5s"; a bare number is seconds. */
export function parseDuration(text: string): number | undefined {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(text.trim());
  if (!m) return undefined;
  const value = Number(m[1]);
  const unit = m[2] ?? "s";
  const factor = unit === "ms" ? 1 : unit === "s" ? 1_000 : unit === "m" ? 60_000 : 3_600_000;
  const ms = value * factor;
  return Number.isSafeInteger(Math.round(ms)) ? Math.round(ms) : undefined;
}
