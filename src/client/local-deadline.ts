// The local deadline of L2: the latest instant, on this process's monotonic
// clock, at which the client can still vouch that its lease is valid.
//
// For every confirmed grant or renewal it is
//     (when the request was sent) + (the lease's `remaining`) − margin.
// The server computed `remaining` at some instant after the request was sent,
// so counting it from the send time errs early by the request's flight and
// processing time and never late; the margin covers the rest (clock-rate
// drift, the time work needs to notice the abort). Neither a slow response
// nor a wall-clock jump can push it later, and `expires_at` (a database
// wall-clock instant) is never used.

import type { Duration } from "@bufbuild/protobuf/wkt";
import { msFromDuration } from "./durations.js";

/** Default safety margin as a fraction of the TTL. */
export const defaultMarginFraction = 0.1;

/** Default renewal interval as a fraction of the usable window (TTL − margin). */
export const defaultRenewFraction = 1 / 3;

/**
 * The monotonic instant (performance.now() scale, ms) until which a lease
 * confirmed by a response to a request sent at `sentAt` is valid locally.
 */
export function localDeadline(
  sentAt: number,
  lease: { remaining?: Duration | undefined },
  marginMs: number,
): number {
  return sentAt + msFromDuration(lease.remaining) - marginMs;
}

/** Timing of one run: TTL, safety margin and renewal interval, checked for sense. */
export interface LeaseTiming {
  ttlMs: number;
  marginMs: number;
  renewIntervalMs: number;
}

/**
 * Fills in the defaults (margin = TTL/10, renewals every third of TTL −
 * margin, i.e. every 0.3 TTL by default) and checks
 * that a renewal is due well before the local deadline: with a renewal
 * interval close to TTL − margin one slow answer would abort the run.
 */
export function leaseTiming(options: {
  ttlMs: number;
  safetyMarginMs?: number | undefined;
  renewIntervalMs?: number | undefined;
}): LeaseTiming {
  const { ttlMs } = options;
  if (!Number.isFinite(ttlMs) || ttlMs <= 0) {
    throw new RangeError(`ttlMs must be a positive number of milliseconds, got ${ttlMs}`);
  }
  const marginMs = options.safetyMarginMs ?? ttlMs * defaultMarginFraction;
  if (!(marginMs >= 0 && marginMs < ttlMs)) {
    throw new RangeError(
      `safetyMarginMs must be at least 0 and below ttlMs (${ttlMs}), got ${marginMs}`,
    );
  }
  const renewIntervalMs = options.renewIntervalMs ?? (ttlMs - marginMs) * defaultRenewFraction;
  if (!(renewIntervalMs > 0 && renewIntervalMs <= (ttlMs - marginMs) / 2)) {
    throw new RangeError(
      `renewIntervalMs must be above 0 and at most half of ttlMs − safetyMarginMs (${(ttlMs - marginMs) / 2}), got ${renewIntervalMs}`,
    );
  }
  return { ttlMs, marginMs, renewIntervalMs };
}
