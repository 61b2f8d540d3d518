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
  Lease,
  ReleaseRequest,
  ReleaseResponse,
  RenewRequest,
  RenewResponse,
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
const unaryRecordings: Record<string, UnaryRecording> = {
  Acquire: {
    f: "acquire",
    invoke: (m: AcquireRequest) => ({
      key: keyOf(m.key),
      runId: m.runId,
      value: { ttlMs: msOf(m.ttl), waitMs: msOf(m.wait), holder: m.holder },
    }),
    answer: (m: AcquireResponse) => {
      if (m.acquired && m.lease) return { type: "ok", ...leaseFields(m.lease) };
      const current = m.current;
      return {
        type: "fail",
        value: current
          ? {
              current: {
                runId: current.runId,
                token: Number(current.fencingToken),
                holder: current.holder,
                expiresAtUs: usOf(current.expiresAt),
              },
            }
          : {},
      };
    },
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
  method: "Acquire" | "Renew" | "Release" | "Revoke" | "Get" | "CheckFence",
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
 * (the server answers a run's renewals in order), a `lost` answer fails
 * every unanswered renewal of its run (the server never renews it again),
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
