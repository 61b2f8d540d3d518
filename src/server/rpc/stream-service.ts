// The bridge between Connect and the streaming parts of the lease domain:
// KeepAlive, Watch and RequestHandoff. Validates and converts; the behaviour
// lives in streams/ (keepalive.ts, watch-hub.ts, the publishing store), and
// domain errors are mapped to codes once, by the error interceptor.

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type HandlerContext, type ServiceImpl } from "@connectrpc/connect";
import {
  HandoffRequestedSchema,
  type KeepAliveRequest,
  type KeepAliveResponse,
  KeepAliveResponseSchema,
  type LeaseService,
  LostSchema,
  RequestHandoffResponseSchema,
  SessionKeySchema,
  SnapshotSchema,
  type WatchRequest,
  type WatchResponse,
  WatchResponseSchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import { InvalidArgumentError } from "../../lease/errors.js";
import type { Limits } from "../../lease/limits.js";
import type { LeaseStore, Scope } from "../../lease/types.js";
import {
  checkId,
  checkKey,
  checkOptionalTtl,
  checkRunId,
  checkText,
} from "../../lease/validation.js";
import { lossReasonFromCause } from "../../protocol/loss-reason.js";
import type {
  KeepAliveAnswer,
  KeepAliveHub,
  KeepAliveRequest as KeepAliveHubRequest,
} from "../streams/keepalive.js";
import type { WatchHub, WatchMessage } from "../streams/watch-hub.js";
import { changeToEvent, leaseToProto, timestampFromMicros } from "./convert.js";

export interface StreamServiceDeps {
  /** The publishing store (publishing-store.ts). */
  store: LeaseStore;
  limits: Limits;
  keepAlive: KeepAliveHub;
  watch: WatchHub;
}

type Impl = ServiceImpl<typeof LeaseService>;

/**
 * Ends a stream the way its context ended: with the reason the server gave
 * (UNAVAILABLE at shutdown, DEADLINE_EXCEEDED), or quietly when the client
 * went away.
 */
function throwIfAborted(ctx: HandlerContext) {
  if (!ctx.signal.aborted) return;
  const reason: unknown = ctx.signal.reason;
  throw reason instanceof ConnectError
    ? reason
    : new ConnectError("the call was cancelled", Code.Canceled);
}

export function createStreamService(
  deps: StreamServiceDeps,
): Pick<Impl, "keepAlive" | "watch" | "requestHandoff"> {
  const { store, limits } = deps;

  return {
    async *keepAlive(requests, ctx) {
      const session = deps.keepAlive.open();
      const reading = (async () => {
        for await (const req of requests) session.submit(keepAliveRequest(req, limits));
        session.endRequests();
      })().catch((error: unknown) => session.fail(error));
      try {
        for await (const answer of session.answers(ctx.signal)) yield keepAliveAnswer(answer);
        throwIfAborted(ctx);
      } finally {
        // Releases nothing: the stream's leases run to their deadlines.
        session.close();
        void reading;
      }
    },

    async *watch(req, ctx) {
      const watcher = deps.watch.open(watchScope(req, limits), {
        includeRenewals: req.includeRenewals,
      });
      try {
        for await (const message of watcher.messages(ctx.signal)) yield watchMessage(message);
        throwIfAborted(ctx);
      } finally {
        watcher.close();
      }
    },

    async requestHandoff(req) {
      const key = checkKey("key", req.key, limits);
      const requester = checkText("requester_holder", req.requesterHolder, limits.maxHolderLength);
      const reason = checkText("reason", req.reason, limits.maxReasonLength);
      const result = await store.requestHandoff(key, requester, reason);
      return create(RequestHandoffResponseSchema, {
        delivered: result.lease !== undefined,
        current: result.lease ? leaseToProto(result.lease) : undefined,
      });
    },
  };
}

/** A KeepAlive request, validated. */
export function keepAliveRequest(req: KeepAliveRequest, limits: Limits): KeepAliveHubRequest {
  return {
    key: checkKey("key", req.key, limits),
    runId: checkRunId("run_id", req.runId),
    ttlMs: checkOptionalTtl("ttl", req.ttl, limits),
  };
}

/** The scope of a Watch request, validated: one session, or the account when session_id is empty. */
export function watchScope(req: WatchRequest, limits: Limits): Scope {
  if (!req.key) throw new InvalidArgumentError("key", "is required");
  return {
    accountId: checkId("key.account_id", req.key.accountId, limits),
    sessionId: req.key.sessionId === "" ? "" : checkId("key.session_id", req.key.sessionId, limits),
  };
}

export function keepAliveAnswer(answer: KeepAliveAnswer): KeepAliveResponse {
  if (answer.kind === "lease") {
    const lease = leaseToProto(answer.lease);
    return create(KeepAliveResponseSchema, {
      key: lease.key,
      runId: lease.runId,
      result: { case: "lease", value: lease },
    });
  }
  const key = create(SessionKeySchema, answer.key);
  if (answer.kind === "lost") {
    return create(KeepAliveResponseSchema, {
      key,
      runId: answer.runId,
      result: {
        case: "lost",
        value: create(LostSchema, { reason: lossReasonFromCause(answer.cause) }),
      },
    });
  }
  return create(KeepAliveResponseSchema, {
    key,
    runId: answer.runId,
    result: {
      case: "handoffRequested",
      value: create(HandoffRequestedSchema, {
        requesterHolder: answer.requesterHolder,
        reason: answer.reason,
        requestedAt: timestampFromMicros(answer.atUs),
      }),
    },
  });
}

export function watchMessage(message: WatchMessage): WatchResponse {
  if (message.kind === "snapshot") {
    return create(WatchResponseSchema, {
      kind: {
        case: "snapshot",
        value: create(SnapshotSchema, {
          leases: message.leases.map(leaseToProto),
          at: timestampFromMicros(message.atUs),
        }),
      },
    });
  }
  return create(WatchResponseSchema, {
    kind: { case: "event", value: changeToEvent(message.change) },
  });
}
