// Conversions between milliseconds and the protobuf Duration and Timestamp
// messages the API uses.

import { create } from "@bufbuild/protobuf";
import { type Duration, DurationSchema, type Timestamp } from "@bufbuild/protobuf/wkt";

/** A protobuf Duration of `ms` milliseconds (whole milliseconds, not negative). */
export function durationFromMs(ms: number): Duration {
  if (!Number.isFinite(ms) || ms < 0) {
    throw new RangeError(`a duration must be a finite number of milliseconds >= 0, got ${ms}`);
  }
  const whole = Math.round(ms);
  return create(DurationSchema, {
    seconds: BigInt(Math.floor(whole / 1000)),
    nanos: (whole % 1000) * 1_000_000,
  });
}

/** Milliseconds of a protobuf Duration (fractions kept); 0 when unset. */
export function msFromDuration(d: Duration | undefined): number {
  if (!d) return 0;
  return Number(d.seconds) * 1000 + d.nanos / 1_000_000;
}

/** A Date for a protobuf Timestamp (millisecond precision); undefined when unset. */
export function dateFromTimestamp(t: Timestamp | undefined): Date | undefined {
  if (!t) return undefined;
  return new Date(Number(t.seconds) * 1000 + Math.floor(t.nanos / 1_000_000));
}
