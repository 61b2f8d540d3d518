// The bridge between Connect and the streaming parts of the lease domain:
// KeepAlive, Watch and RequestHandoff. Validates and converts; the behaviour
// lives in streams/ (keepalive.ts, watch-hub.ts, the publishing store), and
// domain errors are mapped to codes once, by the call policy's error table.

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ServiceImpl } from "@connectrpc/connect";
import { statusOf } from "../../call/error-codes.js";
import { policyText } from "../../call/error-texts.js";
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
import type { Outlet } from "../streams/outlet.js";
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
 * How a stream ends when its context ended: with the reason the server gave
 * (UNAVAILABLE at shutdown, DEADLINE_EXCEEDED), or CANCELLED when the client
 * went away.
 */
function abortReason(signal: AbortSignal): ConnectError {
  const reason: unknown = signal.reason;
  return reason instanceof ConnectError
    ? reason
    : new ConnectError(policyText.cancelled, Code.Canceled);
}

/**
 * A hub stream's messages as the async iterable a Connect handler returns:
 * `pipe` starts the hub's loop into an outlet whose writes this reads. The
 * consumer is drained (it has room again) once it has taken everything
 * written, so at most one write waits here while connect-node cannot send.
 * Ends as the hub ends the stream (with its error, after what was written),
 * or when `signal` aborts (with its reason); `close` then stops the hub's
 * side.
 */
export async function* piped<T>(
  signal: AbortSignal,
  pipe: (outlet: Outlet<T>) => void,
  close: () => void,
): AsyncGenerator<T> {
  let queue: readonly T[] = [];
  let next = 0;
  let ended: { error: unknown } | undefined;
  let drain: (() => void) | undefined;
  let wake: (() => void) | undefined;
  const wakeUp = () => {
    const w = wake;
    wake = undefined;
    w?.();
  };
  const outlet: Outlet<T> = {
    write(messages) {
      queue = next < queue.length ? [...queue.slice(next), ...messages] : messages;
      next = 0;
      wakeUp();
      return false;
    },
    onDrain(listener) {
      drain = listener;
    },
    end(error) {
      ended = { error };
      wakeUp();
    },
  };
  signal.addEventListener("abort", wakeUp);
  try {
    pipe(outlet);
    for (;;) {
      if (signal.aborted) throw abortReason(signal);
      if (next < queue.length) {
        yield queue[next++] as T;
        continue;
      }
      if (ended) {
        if (ended.error !== undefined) throw ended.error;
        return;
      }
      const drained = drain;
      drain = undefined;
      drained?.();
      if (next < queue.length || ended) continue;
      await new Promise<void>((resolve) => {
        wake = resolve;
      });
    }
  } finally {
    signal.removeEventListener("abort", wakeUp);
    // Releases nothing: a KeepAlive stream's leases run to their deadlines.
    close();
  }
}

export function createStreamService(
  deps: StreamServiceDeps,
): Pick<Impl, "keepAlive" | "watch" | "requestHandoff"> {
  const { store, limits } = deps;

  return {
    async *keepAlive(requests, ctx) {
      const session = deps.keepAlive.open();
      void (async () => {
        for await (const req of requests) session.submit(keepAliveRequest(req, limits));
        session.endRequests();
      })().catch((error: unknown) => session.fail(error));
      for await (const answer of piped<KeepAliveAnswer>(
        ctx.signal,
        (outlet) => session.pipe(outlet),
        () => session.close(),
      )) {
        yield keepAliveAnswer(answer);
      }
    },

    async *watch(req, ctx) {
      const watcher = deps.watch.open(watchScope(req, limits), {
        includeRenewals: req.includeRenewals,
      });
      for await (const message of piped<WatchMessage>(
        ctx.signal,
        (outlet) => watcher.pipe(outlet),
        () => watcher.close(),
      )) {
        yield watchMessage(message);
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
  if (answer.kind === "undecided") {
    return create(KeepAliveResponseSchema, {
      key,
      runId: answer.runId,
      result: { case: "undecided", value: statusOf(answer.error) },
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
