// Database times arrive as microseconds since the epoch; a Timestamp keeps
// their full precision. Both the lease server and the guarded store answer
// with them.

import { create } from "@bufbuild/protobuf";
import { type Timestamp, TimestampSchema } from "@bufbuild/protobuf/wkt";

export function timestampFromMicros(us: bigint): Timestamp {
  const seconds = us / 1_000_000n;
  let rest = us % 1_000_000n;
  let s = seconds;
  if (rest < 0n) {
    rest += 1_000_000n;
    s -= 1n;
  }
  return create(TimestampSchema, { seconds: s, nanos: Number(rest) * 1000 });
}
