// google.protobuf.Duration and Timestamp to and from milliseconds.

import { create } from "@bufbuild/protobuf";
import { type Duration, DurationSchema, type Timestamp } from "@bufbuild/protobuf/wkt";

export function durationMs(d: Duration | undefined): number {
  if (d === undefined) return 0;
  return Number(d.seconds) * 1000 + d.nanos / 1e6;
}

export function msDuration(ms: number): Duration {
  const whole = Math.floor(ms);
  return create(DurationSchema, {
    seconds: BigInt(Math.floor(whole / 1000)),
    nanos: (whole % 1000) * 1_000_000,
  });
}

export function timestampDate(t: Timestamp | undefined): Date | undefined {
  if (t === undefined) return undefined;
  return new Date(Number(t.seconds) * 1000 + t.nanos / 1e6);
}

/** Whole seconds left, rounded up, never negative: what a countdown shows. */
export function secondsLeft(deadline: number, now: number): number {
  return Math.max(0, Math.ceil((deadline - now) / 1000));
}
