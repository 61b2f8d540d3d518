// History and Revoke: the audit trail of a session, and the audited admin
// end of a valid lease (S3 allows no other way to end another run's lease).
// Validation and mapping only; SQL lives in db/. Errors are mapped to codes
// once, by the call policy (src/call/error-codes.ts).

import { create } from "@bufbuild/protobuf";
import type { ServiceImpl } from "@connectrpc/connect";
import {
  type Event,
  EventSchema,
  EventType,
  HistoryResponseSchema,
  type LeaseService,
  RevokeResponseSchema,
  SessionKeySchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import { InvalidArgumentError } from "../../lease/errors.js";
import type { Limits } from "../../lease/limits.js";
import { eventPageToken } from "../../lease/page-token.js";
import type { EventRecord, EventStore, LeaseStore } from "../../lease/types.js";
import { checkKey, checkPageSize, checkText } from "../../lease/validation.js";
import { leaseToProto, timestampFromMicros } from "./convert.js";

export interface AuditServiceDeps {
  store: LeaseStore;
  events: EventStore;
  limits: Limits;
  /** Told of every revoke that ended a lease, with the request's key and reason. */
  onRevoked?: (info: { accountId: string; sessionId: string; reason: string }) => void;
}

type Impl = ServiceImpl<typeof LeaseService>;

export function createAuditService(deps: AuditServiceDeps): Pick<Impl, "history" | "revoke"> {
  const { store, events, limits } = deps;
  return {
    async history(req) {
      const key = checkKey("key", req.key, limits);
      const pageSize = checkPageSize("page_size", req.pageSize, limits);
      const before = eventPageToken.decode(req.pageToken);
      const page = await events.history(key, pageSize, before);
      return create(HistoryResponseSchema, {
        events: page.events.map(eventToProto),
        nextPageToken: page.nextBefore === undefined ? "" : eventPageToken.encode(page.nextBefore),
      });
    },

    async revoke(req) {
      const key = checkKey("key", req.key, limits);
      const reason = checkText("reason", req.reason, limits.maxReasonLength);
      if (reason.trim() === "") {
        throw new InvalidArgumentError(
          "reason",
          "is required: a revoke is audited with its reason",
        );
      }
      const ended = await store.revoke(key, reason);
      if (ended) deps.onRevoked?.({ ...key, reason });
      return create(RevokeResponseSchema, {
        revoked: ended !== undefined,
        lease: ended ? leaseToProto(ended) : undefined,
      });
    },
  };
}

const eventTypes: Record<EventRecord["type"], EventType> = {
  acquired: EventType.ACQUIRED,
  released: EventType.RELEASED,
  expired: EventType.EXPIRED,
  revoked: EventType.REVOKED,
  handoff_requested: EventType.HANDOFF_REQUESTED,
};

function eventToProto(e: EventRecord): Event {
  const handoff = e.type === "handoff_requested";
  return create(EventSchema, {
    id: e.id,
    type: eventTypes[e.type] ?? EventType.UNSPECIFIED,
    key: create(SessionKeySchema, { accountId: e.accountId, sessionId: e.sessionId }),
    runId: e.runId ?? "",
    fencingToken: e.fencingToken ?? 0n,
    holder: handoff ? "" : (e.holder ?? ""),
    requesterHolder: handoff ? (e.holder ?? "") : "",
    reason: e.reason ?? "",
    at: timestampFromMicros(e.atUs),
  });
}
