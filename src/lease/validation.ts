// Request validation: every rule names its field, so a client sees
// `ttl must be between 1s and 1h, got 0s`, never a database error.

import { InvalidArgumentError } from "./errors.js";
import { formatDuration, type Limits } from "./limits.js";
import type { SessionKey } from "./types.js";

/** A protobuf Duration as generated code holds it. */
export interface DurationLike {
  seconds: bigint;
  nanos: number;
}

// Session and account ids: printable ASCII without spaces or characters that
// need quoting in URLs, logs or shells.
const idPattern = /^[A-Za-z0-9._:@+=-]+$/;
const uuidPattern = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
// Labels and reasons are free text, but without control characters.
// biome-ignore lint/suspicious/noControlCharactersInRegex: the point is to reject them
const controlPattern = /[\u0000-\u001f\u007f]/;

export function checkId(field: string, value: string, limits: Pick<Limits, "maxIdLength">): string {
  if (value.length === 0) throw new InvalidArgumentError(field, "must not be empty");
  if (value.length > limits.maxIdLength) {
    throw new InvalidArgumentError(
      field,
      `must be at most ${limits.maxIdLength} characters, got ${value.length}`,
    );
  }
  if (!idPattern.test(value)) {
    throw new InvalidArgumentError(field, "may contain only letters, digits and . _ : @ + = -");
  }
  return value;
}

export function checkKey(
  field: string,
  key: { accountId: string; sessionId: string } | undefined,
  limits: Pick<Limits, "maxIdLength">,
): SessionKey {
  if (!key) throw new InvalidArgumentError(field, "is required");
  return {
    accountId: checkId(`${field}.account_id`, key.accountId, limits),
    sessionId: checkId(`${field}.session_id`, key.sessionId, limits),
  };
}

/** A run id is a UUID; returned lower-cased so comparisons are exact. */
export function checkRunId(field: string, value: string): string {
  if (value.length === 0) throw new InvalidArgumentError(field, "is required");
  if (!uuidPattern.test(value)) {
    throw new InvalidArgumentError(field, `must be a UUID, got ${JSON.stringify(clip(value))}`);
  }
  return value.toLowerCase();
}

/** Tokens come from a sequence that starts at 1: zero means unset, negatives were never granted. */
export function checkFencingToken(field: string, token: bigint): bigint {
  if (token <= 0n) {
    throw new InvalidArgumentError(field, `must be a positive fencing token, got ${token}`);
  }
  return token;
}

export function checkText(field: string, value: string, max: number): string {
  if (value.length > max) {
    throw new InvalidArgumentError(field, `must be at most ${max} characters, got ${value.length}`);
  }
  if (controlPattern.test(value)) {
    throw new InvalidArgumentError(field, "must not contain control characters");
  }
  return value;
}

/** Milliseconds of a Duration, or undefined when unset. Sub-millisecond parts are dropped. */
export function durationMs(field: string, d: DurationLike | undefined): number | undefined {
  if (!d) return undefined;
  const { seconds, nanos } = d;
  if (
    !Number.isInteger(nanos) ||
    nanos <= -1_000_000_000 ||
    nanos >= 1_000_000_000 ||
    (seconds > 0n && nanos < 0) ||
    (seconds < 0n && nanos > 0)
  ) {
    throw new InvalidArgumentError(field, "is not a valid duration");
  }
  if (seconds > 315_576_000_000n || seconds < -315_576_000_000n) {
    throw new InvalidArgumentError(field, "is out of range");
  }
  return Number(seconds) * 1000 + Math.trunc(nanos / 1_000_000);
}

export function checkTtl(field: string, d: DurationLike | undefined, limits: Limits): number {
  const ms = durationMs(field, d);
  if (ms === undefined) throw new InvalidArgumentError(field, "is required");
  return checkTtlMs(field, ms, limits);
}

export function checkOptionalTtl(
  field: string,
  d: DurationLike | undefined,
  limits: Limits,
): number | undefined {
  const ms = durationMs(field, d);
  return ms === undefined ? undefined : checkTtlMs(field, ms, limits);
}

function checkTtlMs(field: string, ms: number, limits: Limits): number {
  if (ms < limits.minTtlMs || ms > limits.maxTtlMs) {
    throw new InvalidArgumentError(
      field,
      `must be between ${formatDuration(limits.minTtlMs)} and ${formatDuration(limits.maxTtlMs)}, got ${formatDuration(ms)}`,
    );
  }
  return ms;
}

export function checkWait(field: string, d: DurationLike | undefined, limits: Limits): number {
  const ms = durationMs(field, d) ?? 0;
  if (ms < 0 || ms > limits.maxWaitMs) {
    throw new InvalidArgumentError(
      field,
      `must be between 0s and ${formatDuration(limits.maxWaitMs)}, got ${formatDuration(ms)}`,
    );
  }
  return ms;
}

export function checkPageSize(field: string, value: number, limits: Limits): number {
  if (value < 0) throw new InvalidArgumentError(field, `must not be negative, got ${value}`);
  if (value === 0) return limits.defaultPageSize;
  return Math.min(value, limits.maxPageSize);
}

function clip(value: string): string {
  return value.length > 40 ? `${value.slice(0, 40)}…` : value;
}
