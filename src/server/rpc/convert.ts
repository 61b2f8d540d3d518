// Stored records to wire messages. Database times arrive as microseconds
// since the epoch, so Timestamps keep the database's full precision.

import { create } from "@bufbuild/protobuf";
import { type Duration, DurationSchema } from "@bufbuild/protobuf/wkt";
import {
  type Event,
  EventSchema,
  EventType,
  type Lease,
  LeaseSchema,
  SessionKeySchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import type { ChangeType, LeaseChange } from "../../lease/lease-change.js";
import type { LeaseRecord } from "../../lease/types.js";
import { timestampFromMicros } from "../../protocol/timestamps.js";

// In src/protocol, shared with the guarded store; the services here take it from this module.
export { timestampFromMicros };

export function durationFromMicros(us: bigint): Duration {
  return create(DurationSchema, {
    seconds: us / 1_000_000n,
    nanos: Number(us % 1_000_000n) * 1000,
  });
}

export function durationFromMillis(ms: number | bigint): Duration {
  return durationFromMicros(BigInt(ms) * 1000n);
}

export function leaseToProto(r: LeaseRecord): Lease {
  return create(LeaseSchema, {
    key: create(SessionKeySchema, { accountId: r.accountId, sessionId: r.sessionId }),
    runId: r.runId,
    fencingToken: r.fencingToken,
    holder: r.holder,
    ttl: durationFromMillis(r.ttlMs),
    acquiredAt: timestampFromMicros(r.acquiredAtUs),
    expiresAt: timestampFromMicros(r.expiresAtUs),
    remaining: durationFromMicros(r.remainingUs),
    keeperId: r.keeperId ?? "",
  });
}

const eventTypes: Record<ChangeType, EventType> = {
  acquired: EventType.ACQUIRED,
  released: EventType.RELEASED,
  expired: EventType.EXPIRED,
  revoked: EventType.REVOKED,
  handoff_requested: EventType.HANDOFF_REQUESTED,
  renewed: EventType.RENEWED,
};

export function changeToEvent(c: LeaseChange): Event {
  return create(EventSchema, {
    type: eventTypes[c.type],
    key: create(SessionKeySchema, { accountId: c.accountId, sessionId: c.sessionId }),
    runId: c.runId,
    fencingToken: c.fencingToken,
    holder: c.holder,
    reason: c.reason,
    at: timestampFromMicros(c.atUs),
    lease: c.lease ? leaseToProto(c.lease) : undefined,
    requesterHolder: c.requesterHolder,
    id: c.eventId,
  });
}
