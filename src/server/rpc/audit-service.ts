// History and Revoke: the audit trail of a session, and the audited admin
// end of a valid lease (S3 allows no other way to end another run's lease).
// Validation and mapping only; SQL lives in event-store.ts and lease-store.ts.

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
import { leaseToProto, timestampFromMicros } from "./convert.js";
import { InvalidArgumentError } from "../lease/errors.js";
import type { EventRecord, EventStore } from "../db/event-store.js";
import { mapErrors } from "./lease-service.js";
import type { LeaseStore } from "../db/lease-store.js";
import type { Limits } from "../lease/limits.js";
import { checkKey, checkPageSize, checkText } from "../lease/validation.js";

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
    history: mapErrors(async (req) => {
      const key = checkKey("key", req.key, limits);
      const pageSize = checkPageSize("page_size", req.pageSize, limits);
      const before = decodeEventToken(req.pageToken);
      const page = await events.history(key, pageSize, before);
      return create(HistoryResponseSchema, {
        events: page.events.map(eventToProto),
        nextPageToken: page.nextBefore === undefined ? "" : encodeEventToken(page.nextBefore),
      });
    }),

    revoke: mapErrors(async (req) => {
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
    }),
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

/** History page tokens are opaque to clients: base64url of the last event id. */
export function encodeEventToken(before: bigint): string {
  return Buffer.from(`e1:${before}`, "utf8").toString("base64url");
}

export function decodeEventToken(token: string): bigint | undefined {
  if (token === "") return undefined;
  const text = /^[A-Za-z0-9_-]{1,64}$/.test(token)
    ? Buffer.from(token, "base64url").toString("utf8")
    : "";
  const m = /^e1:(\d{1,19})$/.exec(text);
  const id = m?.[1] === undefined ? undefined : BigInt(m[1]);
  if (id === undefined || id > 9_223_372_036_854_775_807n) {
    throw new InvalidArgumentError("page_token", "is not a token returned by this service");
  }
  return id;
}
