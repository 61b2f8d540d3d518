// Records the lease client's calls as operations of the history
// (op-history.ts). The workload's own calls go through recordCall: one
// operation per call, from before it is made to its answer, whatever the
// client library retried inside it (failover to the next instance); its
// completion counts the attempts left without an answer. The calls
// runExclusive makes on its own (its Acquire, its Release, the KeepAlive
// renewals) are out of the workload's sight: the interceptor records them
// from their attempts on the wire.

import type { Timestamp } from "@bufbuild/protobuf/wkt";
import {
  type CallOptions,
  Code,
  createContextKey,
  createContextValues,
  type Interceptor,
} from "@connectrpc/connect";
import { LeaseNotHeldError, toLeaseholdError } from "../../src/client/index.js";
import type {
  AcquireRequest,
  AcquireResponse,
  CheckFenceRequest,
  CheckFenceResponse,
  GetRequest,
  GetResponse,
  KeepAliveRequest,
  KeepAliveResponse,
  Keeper,
  KeepRequest,
  KeepResponse,
  Lease,
  ReleaseRequest,
  ReleaseResponse,
  RenewRequest,
  RenewResponse,
  RevokeKeeperRequest,
  RevokeKeeperResponse,
  RevokeRequest,
  RevokeResponse,
  SessionKey,
} from "../../src/gen/leasehold/v1/lease_pb.js";
import { lossCauseFromReason } from "../../src/protocol/loss-reason.js";
import type { OpFields, OpValue, Outcome, PendingOp, Recorder } from "./op-history.js";

export const usOf = (ts: Timestamp | undefined) =>
  ts ? Number(ts.seconds) * 1_000_000 + Math.round(ts.nanos / 1000) : 0;
const usOfDuration = (d: Lease["ttl"]) =>
  d ? Number(d.seconds) * 1_000_000 + Math.round(d.nanos / 1000) : 0;
const msOf = (d: Lease["ttl"]) => usOfDuration(d) / 1000;
const keyOf = (key: SessionKey | undefined) => `${key?.accountId ?? ""}/${key?.sessionId ?? ""}`;

/** A lease's fields in an answer: its run, token and database times. */
function leaseFields(lease: Lease): Partial<OpFields> & { value: OpValue } {
  return {
    runId: lease.runId,
    token: Number(lease.fencingToken),
    value: {
      acquiredAtUs: usOf(lease.acquiredAt),
      expiresAtUs: usOf(lease.expiresAt),
      ttlUs: usOfDuration(lease.ttl),
    },
  };
}

/** Codes with which the server certainly did nothing; any other error leaves the outcome unknown. */
const refusals = new Set([
  Code.FailedPrecondition,
  Code.Aborted,
  Code.InvalidArgument,
  Code.PermissionDenied,
  Code.Unauthenticated,
  Code.ResourceExhausted,
  Code.NotFound,
  Code.Unimplemented,
]);

/** A failed call's completion: `fail` for a refusal, else `info`, with its code and LEASE_NOT_HELD cause. */
export function errorOutcome(error: unknown): Outcome {
  const leasehold = toLeaseholdError(error);
  const code = leasehold.code;
  return {
    type: refusals.has(code) ? "fail" : "info",
    error: {
      code: Code[code],
      cause: leasehold instanceof LeaseNotHeldError ? leasehold.lossCause : undefined,
    },
  };
}

/** A stream's error, for the renewals it left unanswered: their outcome is unknown. */
function unknownOutcome(error: unknown): Outcome {
  return { type: "info", error: errorOutcome(error).error };
}

interface UnaryRecording {
  f: string;
  invoke(message: never): OpFields;
  answer(message: never): Outcome;
}

// One entry per LeaseService method the workload calls: its operation's
// name, what its request records, and what its answer does. A new kind of
// call (a keeper's, an election's) is recorded by adding its entry.
/** An Acquire's answer (unary, or on a keeper's stream): `ok` granted, else `fail` with what blocked it. */
function acquireAnswer(m: AcquireResponse): Outcome {
  if (m.acquired && m.lease) {
    const fields = leaseFields(m.lease);
    const keeperId = m.lease.keeperId || undefined;
    return { type: "ok", ...fields, value: { ...fields.value, keeperId } };
  }
  const current = m.current;
  return {
    type: "fail",
    value: {
      ...(current
        ? {
            current: {
              runId: current.runId,
              token: Number(current.fencingToken),
              holder: current.holder,
              expiresAtUs: usOf(current.expiresAt),
            },
          }
        : {}),
      ...(m.lockDelayUntil ? { lockDelayUntilUs: usOf(m.lockDelayUntil) } : {}),
    },
  };
}

/** The key a keeper's own operations are recorded under: it is no session's. */
export const keeperKey = (keeperId: string) => `keeper:${keeperId}`;

/** A keeper's state in an answer (open, re-attach, heartbeat): its id and database deadline. */
function keeperValue(k: Keeper): OpValue {
  return {
    keeperId: k.keeperId,
    expiresAtUs: usOf(k.expiresAt),
    ttlUs: usOfDuration(k.ttl),
    lockDelayMs: msOf(k.lockDelay),
  };
}

const unaryRecordings: Record<string, UnaryRecording> = {
  Acquire: {
    f: "acquire",
    invoke: (m: AcquireRequest) => ({
      key: keyOf(m.key),
      runId: m.runId,
      value: { ttlMs: msOf(m.ttl), waitMs: msOf(m.wait), holder: m.holder },
    }),
    answer: acquireAnswer,
  },
  RevokeKeeper: {
    f: "keeper-revoke",
    invoke: (m: RevokeKeeperRequest) => ({
      key: keeperKey(m.keeperId),
      value: { keeperId: m.keeperId, reason: m.reason },
    }),
    answer: (m: RevokeKeeperResponse) => ({ type: "ok", value: { revoked: m.revoked } }),
  },
  Renew: {
    f: "renew",
    invoke: (m: RenewRequest) => ({ key: keyOf(m.key), runId: m.runId }),
    answer: (m: RenewResponse) =>
      m.lease ? { type: "ok", ...leaseFields(m.lease) } : { type: "info" },
  },
  Release: {
    f: "release",
    invoke: (m: ReleaseRequest) => ({ key: keyOf(m.key), runId: m.runId }),
    answer: (m: ReleaseResponse) => ({ type: "ok", value: { released: m.released } }),
  },
  Revoke: {
    f: "revoke",
    invoke: (m: RevokeRequest) => ({ key: keyOf(m.key), value: { reason: m.reason } }),
    answer: (m: RevokeResponse) => {
      const lease: Partial<OpFields> = m.lease && m.revoked ? leaseFields(m.lease) : {};
      return { type: "ok", ...lease, value: { ...lease.value, revoked: m.revoked } };
    },
  },
  Get: {
    f: "get",
    invoke: (m: GetRequest) => ({ key: keyOf(m.key) }),
    answer: (m: GetResponse) => {
      const lease: Partial<OpFields> = m.held && m.lease ? leaseFields(m.lease) : {};
      return { type: "ok", ...lease, value: { ...lease.value, held: m.held } };
    },
  },
  CheckFence: {
    f: "check-fence",
    invoke: (m: CheckFenceRequest) => ({ key: keyOf(m.key), token: Number(m.fencingToken) }),
    answer: (m: CheckFenceResponse) => ({
      type: "ok",
      value: { fenceCurrent: m.current, highestToken: Number(m.highestToken) },
    }),
  },
};

/** A call recorded by recordCall: the interceptor only counts its attempts left without an answer. */
const recordedCall = createContextKey<{ unanswered: number } | undefined>(undefined, {
  description: "a lease call recorded by its caller",
});

/**
 * Makes one call of the workload (`call` with the call options it is given)
 * and records it as one operation; `method` is the LeaseService method.
 */
export async function recordCall<T>(
  recorder: Recorder,
  method: "Acquire" | "Renew" | "Release" | "Revoke" | "Get" | "CheckFence" | "RevokeKeeper",
  request: unknown,
  call: (options: CallOptions) => Promise<T>,
): Promise<T> {
  const recording = unaryRecordings[method] as UnaryRecording;
  const attempts = { unanswered: 0 };
  return recorder.run(
    recording.f,
    recording.invoke(request as never),
    () => call({ contextValues: createContextValues().set(recordedCall, attempts) }),
    (answer) => withUnanswered(recording.answer(answer as never), attempts.unanswered),
    (error) => withUnanswered(errorOutcome(error), attempts.unanswered),
  );
}

/**
 * An attempt left behind by a failover may still be decided later: the
 * completion says how many there were.
 */
function withUnanswered(outcome: Outcome, unanswered: number): Outcome {
  return unanswered === 0 ? outcome : { ...outcome, value: { ...outcome.value, unanswered } };
}

/**
 * The interceptor that records on `recorder` the calls no recordCall
 * records. It sees each attempt of a call, not the call: an attempt left
 * without an answer keeps its operation open, and the library's next
 * attempt of the same method for the same run completes it; when no
 * attempt follows (the library gave up), the operation stays open, which
 * a reader of the history takes as `info`.
 */
export function recordingInterceptor(recorder: Recorder): Interceptor {
  const retried = new Map<string, { op: PendingOp; unanswered: number }>();
  return (next) => async (req) => {
    if (req.stream) {
      if (req.method.name === "Keep") return recordKeep(recorder, req, next);
      if (req.method.name !== "KeepAlive") return next(req);
      return recordKeepAlive(recorder, req, next);
    }
    const attempts = req.contextValues.get(recordedCall);
    if (attempts) {
      try {
        return await next(req);
      } catch (error) {
        if (errorOutcome(error).type === "info") attempts.unanswered += 1;
        throw error;
      }
    }
    const recording = unaryRecordings[req.method.name];
    if (!recording) return next(req);
    const fields = recording.invoke(req.message as never);
    // The library's next attempt of a call left without an answer (the same
    // method for the same run) continues its operation.
    const id = fields.runId ? `${req.method.name} ${fields.runId}` : undefined;
    const call = (id && retried.get(id)) || {
      op: recorder.invoke(recording.f, fields),
      unanswered: 0,
    };
    if (id) retried.delete(id);
    try {
      const res = await next(req);
      call.op.complete(withUnanswered(recording.answer(res.message as never), call.unanswered));
      return res;
    } catch (error) {
      const outcome = errorOutcome(error);
      if (outcome.type === "info" && id) {
        call.unanswered += 1;
        retried.set(id, call);
      } else call.op.complete(withUnanswered(outcome, call.unanswered));
      throw error;
    }
  };
}

/**
 * KeepAlive renewals: each request pulled onto the stream is invoked, each
 * `lease` answer completes the oldest unanswered renewal of its run `ok`
 * (the server answers a run's renewals in order), an `undecided` answer
 * completes it `info` (nothing is claimed of its lease), a `lost` answer
 * fails every unanswered renewal of its run (the server never renews it again),
 * and renewals still unanswered when the stream ends complete `info`,
 * whatever code ended it: a stream's error refuses no renewal it carried
 * (one ended with RESOURCE_EXHAUSTED or UNAUTHENTICATED drops answers of
 * renewals the database already made), so `fail` would claim too much.
 */
async function recordKeepAlive(
  recorder: Recorder,
  req: Parameters<Parameters<Interceptor>[0]>[0],
  next: Parameters<Interceptor>[0],
) {
  if (!req.stream) return next(req);
  const unanswered = new Map<string, PendingOp[]>();
  const endAll = (outcome: Outcome) => {
    for (const ops of unanswered.values()) for (const op of ops) op.complete(outcome);
    unanswered.clear();
  };
  const requests = req.message as AsyncIterable<KeepAliveRequest>;
  async function* sent() {
    for await (const m of requests) {
      const id = `${keyOf(m.key)} ${m.runId}`;
      const op = recorder.invoke("keepalive", {
        key: keyOf(m.key),
        runId: m.runId,
        value: { ttlMs: msOf(m.ttl) },
      });
      unanswered.set(id, [...(unanswered.get(id) ?? []), op]);
      yield m;
    }
  }
  let res: Awaited<ReturnType<typeof next>>;
  try {
    res = await next({ ...req, message: sent() });
  } catch (error) {
    endAll(unknownOutcome(error));
    throw error;
  }
  if (!res.stream) return res;
  const answers = res.message as AsyncIterable<KeepAliveResponse>;
  async function* received() {
    let ended: Outcome = { type: "info", error: { code: "Unavailable", cause: "stream ended" } };
    try {
      for await (const m of answers) {
        const id = `${keyOf(m.key)} ${m.runId}`;
        const ops = unanswered.get(id) ?? [];
        if (m.result.case === "lease") {
          ops.shift()?.complete({ type: "ok", ...leaseFields(m.result.value) });
        } else if (m.result.case === "lost") {
          const cause = lossCauseFromReason(m.result.value.reason);
          for (const op of ops) op.complete({ type: "fail", error: { code: "Lost", cause } });
          ops.length = 0;
        } else if (m.result.case === "undecided") {
          // The database did not decide it (a statement or lock timeout):
          // recorded as unknown, which claims nothing of the lease.
          ops.shift()?.complete({
            type: "info",
            error: { code: Code[m.result.value.code as Code], cause: "undecided" },
          });
        }
        if (ops.length === 0) unanswered.delete(id);
        yield m;
      }
    } catch (error) {
      ended = unknownOutcome(error);
      throw error;
    } finally {
      endAll(ended);
    }
  }
  return { ...res, message: received() };
}

/** How a Keep request is recorded: its operation and fields, or undefined (a Get: not a keeper operation). */
function keepInvocation(
  m: KeepRequest,
  keeperId: string,
): { f: string; fields: OpFields } | undefined {
  const op = m.op;
  switch (op.case) {
    case "open":
      return {
        f: "keeper-attach",
        fields: {
          key: keeperKey(op.value.keeperId),
          value: {
            keeperId: op.value.keeperId,
            ttlMs: msOf(op.value.ttl),
            lockDelayMs: msOf(op.value.lockDelay),
            holder: op.value.holder,
          },
        },
      };
    case "heartbeat":
      return {
        f: "keeper-heartbeat",
        fields: { key: keeperKey(keeperId), value: { keeperId, ttlMs: msOf(op.value.ttl) } },
      };
    case "acquire":
      return {
        f: "keeper-acquire",
        fields: {
          key: keyOf(op.value.key),
          runId: op.value.runId,
          value: { keeperId, waitMs: msOf(op.value.wait), holder: op.value.holder },
        },
      };
    case "release":
      return {
        f: "keeper-release",
        fields: { key: keyOf(op.value.key), runId: op.value.runId, value: { keeperId } },
      };
    case "close":
      return {
        f: "keeper-close-request",
        fields: { key: keeperKey(keeperId), value: { keeperId } },
      };
    default:
      return undefined;
  }
}

/** An answer to a Keep request, for the operation it completes. */
function keepOutcome(result: KeepResponse["result"]): Outcome | undefined {
  switch (result.case) {
    case "keeper":
      return { type: "ok", value: keeperValue(result.value) };
    case "acquire":
      return acquireAnswer(result.value);
    case "release":
      return { type: "ok", value: { released: result.value.released } };
    case "error": {
      const code = result.value.code as Code;
      return {
        type: refusals.has(code) ? "fail" : "info",
        error: { code: Code[code] ?? String(code) },
      };
    }
    case "lost":
      // The keeper is gone (expired, revoked): the server renewed nothing for this request.
      return {
        type: "fail",
        error: { code: "Lost", cause: lossCauseFromReason(result.value.reason) },
      };
    default:
      return undefined;
  }
}

/**
 * A keeper's Keep stream: every request the client sends on it (open or
 * re-attach, heartbeat, acquire, release, close) is invoked as it goes out,
 * and completed by the answer carrying its id (`ok`; a refusal `fail`; a
 * `lost` answering it `fail`, the keeper being gone). Requests still
 * unanswered when the stream ends complete `info`: the client sends them
 * again on the next stream, where they are new operations. Gets on the
 * stream are not recorded.
 */
async function recordKeep(
  recorder: Recorder,
  req: Parameters<Parameters<Interceptor>[0]>[0],
  next: Parameters<Interceptor>[0],
) {
  if (!req.stream) return next(req);
  const unanswered = new Map<string, PendingOp>();
  let keeperId = "";
  const endAll = (outcome: Outcome) => {
    for (const op of unanswered.values()) op.complete(outcome);
    unanswered.clear();
  };
  const requests = req.message as AsyncIterable<KeepRequest>;
  async function* sent() {
    for await (const m of requests) {
      if (m.op.case === "open" && m.op.value.keeperId) keeperId = m.op.value.keeperId;
      const invocation = keepInvocation(m, keeperId);
      if (invocation) {
        unanswered.get(String(m.id))?.complete({ type: "info" });
        unanswered.set(String(m.id), recorder.invoke(invocation.f, invocation.fields));
      }
      yield m;
    }
  }
  let res: Awaited<ReturnType<typeof next>>;
  try {
    res = await next({ ...req, message: sent() });
  } catch (error) {
    endAll(unknownOutcome(error));
    throw error;
  }
  if (!res.stream) return res;
  const answers = res.message as AsyncIterable<KeepResponse>;
  async function* received() {
    let ended: Outcome = { type: "info", error: { code: "Unavailable", cause: "stream ended" } };
    try {
      for await (const m of answers) {
        const id = String(m.id);
        const op = unanswered.get(id);
        const outcome = keepOutcome(m.result);
        if (op && outcome && m.id !== 0n) {
          unanswered.delete(id);
          op.complete(outcome);
        }
        yield m;
      }
    } catch (error) {
      ended = unknownOutcome(error);
      throw error;
    } finally {
      endAll(ended);
    }
  }
  return { ...res, message: received() };
}
