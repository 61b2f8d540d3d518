// The Keep stream (docs/keepers.md): one bidirectional stream per keeper.
// Its first request opens the keeper (or re-attaches to it by id, after a cut
// stream, on any instance); then heartbeats, and the acquires, releases and
// gets of the keeper's leases, each request answered by its id, in any
// order: an acquire that waits does not hold up the heartbeat behind it.
// A close answers, then ends the stream OK.
//
// The same session serves both paths (the Connect adapter below, the native
// gRPC path in native-streams.ts): they only move messages. Every request is
// checked by the one call policy (its account, the session authorizer) as it
// arrives; a refused request, or bad input in one, is answered in that
// request's `error` (a google.rpc.Status as the unary call's error would
// carry: the error table of src/call/error-codes.ts), and the keeper goes
// on. Only a refused open, the token's expiry or a failure of the stream
// itself ends the stream.
//
// Heartbeats go through KeeperStore.heartbeat, group-committed with every
// other stream's on this instance; acquires, releases and gets go through
// the same store (and its group commits) as the unary calls, a waiting
// acquire through the same waiters.
//
// The stream ends with its keeper's loss: `lost` (with the request id of the
// heartbeat that found it, or 0 when the server learned it otherwise), then
// OK. A stream that ends otherwise (the client left, a deadline, a shutdown)
// leaves the keeper to its deadline: its client re-attaches by id.

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { type Any, AnySchema, anyPack } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, type ServiceImpl } from "@connectrpc/connect";
import { toConnectError } from "../../call/error-codes.js";
import { requestCheckKey } from "../../call/policy-interceptor.js";
import { type Status, StatusSchema } from "../../gen/google/rpc/status_pb.js";
import {
  type AcquireRequest,
  AcquireResponseSchema,
  type GetRequest,
  GetResponseSchema,
  type Keeper,
  KeeperLostSchema,
  KeeperSchema,
  type KeepRequest,
  type KeepResponse,
  KeepResponseSchema,
  type LeaseService,
  type OpenKeeper,
  type ReleaseRequest,
  ReleaseResponseSchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import {
  InvalidArgumentError,
  KeeperNotHeldError,
  PermissionDeniedError,
  ResourceExhaustedError,
  UnauthenticatedError,
} from "../../lease/errors.js";
import { formatDuration, type Limits } from "../../lease/limits.js";
import type {
  KeeperEnd,
  KeeperRecord,
  KeeperStore,
  LeaseStore,
  SessionKey,
} from "../../lease/types.js";
import {
  checkId,
  checkKey,
  checkRunId,
  checkText,
  checkTtl,
  checkWait,
  durationMs,
} from "../../lease/validation.js";
import { LimitName, type LossCause } from "../../protocol/errors.js";
import { lossReasonFromCause } from "../../protocol/loss-reason.js";
import type { Outlet } from "../streams/outlet.js";
import type { Waiters } from "../streams/waiters.js";
import {
  durationFromMicros,
  durationFromMillis,
  leaseToProto,
  timestampFromMicros,
} from "./convert.js";
import { piped } from "./stream-service.js";

export interface KeepServiceDeps {
  /** The publishing lease store. */
  store: LeaseStore;
  /** The publishing keeper store (withKeeperPublishing). */
  keepers: KeeperStore;
  limits: Limits;
  waiters?: Waiters;
}

/** The call policy's check of one request message (access, then the policy's steps). */
export type RequestCheck = (message: object) => void | Promise<void>;

/** A keeper as the wire carries it. */
export function keeperToProto(k: KeeperRecord): Keeper {
  return create(KeeperSchema, {
    keeperId: k.id,
    accountId: k.accountId,
    holder: k.holder,
    ttl: durationFromMillis(k.ttlMs),
    lockDelay: durationFromMillis(k.lockDelayMs),
    expiresAt: timestampFromMicros(k.expiresAtUs),
    remaining: durationFromMicros(k.remainingUs),
  });
}

/**
 * An error as one request's answer: the code, message and details the call
 * policy's error table gives it, as a google.rpc.Status.
 */
export function statusOf(error: unknown): Status {
  const ce = toConnectError(error);
  const details: Any[] = ce.details.map((d) =>
    "desc" in d
      ? anyPack(d.desc, create(d.desc, d.value))
      : create(AnySchema, { typeUrl: `type.googleapis.com/${d.type}`, value: d.value }),
  );
  return create(StatusSchema, { code: ce.code, message: ce.rawMessage, details });
}

const lossOfKeeper: Record<KeeperEnd, LossCause> = {
  expired: "expired",
  revoked: "revoked",
  // Closed by another stream of the same keeper: its leases were released.
  closed: "released",
  not_found: "not_found",
};

/** An error that ends the stream rather than one request: the caller's token or certificate expired. */
function endsStream(error: unknown): boolean {
  return (
    error instanceof UnauthenticatedError ||
    (error instanceof ConnectError && error.code === Code.Unauthenticated)
  );
}

/** The lock-delay an open asks for: 0 to the server's maximum. */
function checkLockDelay(field: string, d: OpenKeeper["lockDelay"], limits: Limits): number {
  const ms = durationMs(field, d) ?? 0;
  if (ms < 0 || ms > limits.maxLockDelayMs) {
    throw new InvalidArgumentError(
      field,
      `must be between 0s and ${formatDuration(limits.maxLockDelayMs)} (--max-lock-delay), got ${formatDuration(ms)}`,
    );
  }
  return ms;
}

/**
 * One Keep stream. Requests go in by `submit` as they arrive, answers come
 * out of `pipe`'s outlet as they are decided.
 */
export class KeepSession {
  private keeper: KeeperRecord | undefined;
  private opening = false;
  /** Requests that arrived while the open was in flight: handled once it is decided. */
  private held: KeepRequest[] = [];
  /** Ids of the requests in flight. */
  private readonly inFlight = new Set<bigint>();
  /** Aborts the stream's waiting acquires when the stream or its keeper ends. */
  private readonly ops = new AbortController();
  private queue: KeepResponse[] = [];
  private outlet: Outlet<KeepResponse> | undefined;
  private blocked = false;
  private flushScheduled = false;
  private requestsEnded = false;
  /** After a close's answer or a `lost`: no more requests; ends once everything is written. */
  private finishing = false;
  private failure: { error: unknown } | undefined;
  private closed = false;

  constructor(
    private readonly deps: KeepServiceDeps,
    private readonly check: RequestCheck,
  ) {}

  /** One request off the wire. */
  submit(req: KeepRequest): void {
    if (this.closed || this.failure || this.finishing) return;
    if (this.keeper === undefined) {
      if (this.opening) {
        if (this.held.length >= this.deps.limits.maxKeeperOpsInFlight) {
          this.answerError(req.id, this.opsLimitError());
          return;
        }
        this.held.push(req);
        return;
      }
      this.open(req);
      return;
    }
    this.handle(req, this.keeper);
  }

  private open(req: KeepRequest): void {
    if (req.op.case !== "open") {
      this.fail(new InvalidArgumentError("open", "must be the first request of a Keep stream"));
      return;
    }
    this.opening = true;
    const open = req.op.value;
    const id = req.id;
    void (async () => {
      await this.check(req);
      const limits = this.deps.limits;
      const accountId = checkId("open.account_id", open.accountId, limits);
      const keeperId =
        open.keeperId === "" ? randomUUID() : checkRunId("open.keeper_id", open.keeperId);
      const holder = checkText("open.holder", open.holder, limits.maxHolderLength);
      const ttlMs = checkTtl("open.ttl", open.ttl, limits);
      const lockDelayMs = checkLockDelay("open.lock_delay", open.lockDelay, limits);
      const opened = await this.deps.keepers.open({
        id: keeperId,
        accountId,
        holder,
        ttlMs,
        lockDelayMs,
      });
      if (!opened.held) throw new KeeperNotHeldError(keeperId, opened.cause);
      return opened.keeper;
    })().then(
      (keeper) => {
        if (this.closed) return;
        this.keeper = keeper;
        this.opening = false;
        this.push(
          create(KeepResponseSchema, {
            id,
            result: { case: "keeper", value: keeperToProto(keeper) },
          }),
        );
        const held = this.held;
        this.held = [];
        for (const r of held) this.submit(r);
        this.maybeFinish();
      },
      // A refused open ends the stream: there is no keeper to go on with.
      (error: unknown) => this.fail(error),
    );
  }

  private handle(req: KeepRequest, keeper: KeeperRecord): void {
    const id = req.id;
    if (id === 0n) {
      this.answerError(
        id,
        new InvalidArgumentError("id", "must not be 0 (0 marks what the server says unasked)"),
      );
      return;
    }
    if (this.inFlight.has(id)) {
      this.answerError(
        id,
        new InvalidArgumentError(
          "id",
          `${id} is in flight: a request id is not reused until its request is answered`,
        ),
      );
      return;
    }
    if (this.inFlight.size >= this.deps.limits.maxKeeperOpsInFlight) {
      this.answerError(id, this.opsLimitError());
      return;
    }
    this.inFlight.add(id);
    let checked: void | Promise<void>;
    try {
      checked = this.check(req);
    } catch (error) {
      this.settle(id, error);
      return;
    }
    const run = () => this.run(req, keeper);
    const answer = checked instanceof Promise ? checked.then(run) : run();
    answer.then(
      (response) => this.answered(id, response),
      (error: unknown) => this.settle(id, error),
    );
  }

  private opsLimitError(): ResourceExhaustedError {
    const max = this.deps.limits.maxKeeperOpsInFlight;
    return new ResourceExhaustedError(
      `the Keep stream has ${max} requests in flight, the most --max-keeper-ops-in-flight allows: wait for their answers`,
      LimitName.keeperOpsInFlight,
      max,
    );
  }

  private answered(id: bigint, response: KeepResponse | undefined): void {
    this.inFlight.delete(id);
    if (response) this.push(response);
    this.maybeFinish();
  }

  private settle(id: bigint, error: unknown): void {
    this.inFlight.delete(id);
    if (endsStream(error)) {
      this.fail(error);
      return;
    }
    this.answerError(id, error);
    this.maybeFinish();
  }

  private answerError(id: bigint, error: unknown): void {
    this.push(
      create(KeepResponseSchema, { id, result: { case: "error", value: statusOf(error) } }),
    );
  }

  /** One request of an open keeper: its answer, undefined when it ended the stream instead. */
  private async run(req: KeepRequest, keeper: KeeperRecord): Promise<KeepResponse | undefined> {
    const id = req.id;
    const op = req.op;
    switch (op.case) {
      case "open":
        throw new InvalidArgumentError(
          "open",
          "is the first request only: this stream's keeper is open",
        );
      case "heartbeat":
        return this.heartbeat(id, keeper, op.value.ttl);
      case "acquire":
        return this.acquire(id, keeper, op.value);
      case "release":
        return this.release(id, keeper, op.value);
      case "get":
        return this.get(id, keeper, op.value);
      case "close":
        return this.closeKeeper(id, keeper);
      default:
        throw new InvalidArgumentError(
          "op",
          "is required: open, heartbeat, acquire, release, get or close",
        );
    }
  }

  private async heartbeat(
    id: bigint,
    keeper: KeeperRecord,
    ttl: OpenKeeper["ttl"],
  ): Promise<KeepResponse | undefined> {
    if (ttl !== undefined) {
      throw new InvalidArgumentError(
        "heartbeat.ttl",
        "must be unset: this server keeps the TTL the keeper was opened with",
      );
    }
    const beat = await this.deps.keepers.heartbeat(keeper.accountId, keeper.id);
    if (!beat.held) {
      this.lose(id, lossOfKeeper[beat.cause]);
      return undefined;
    }
    this.keeper = beat.keeper;
    return create(KeepResponseSchema, {
      id,
      result: { case: "keeper", value: keeperToProto(beat.keeper) },
    });
  }

  /** A key of the keeper's account (K1: a keeper holds leases of its own account only). */
  private keyOf(field: string, key: AcquireRequest["key"], keeper: KeeperRecord): SessionKey {
    const checked = checkKey(`${field}.key`, key, this.deps.limits);
    if (checked.accountId !== keeper.accountId) {
      throw new PermissionDeniedError(`${field}.key.account_id is not the keeper's account`);
    }
    return checked;
  }

  private async acquire(
    id: bigint,
    keeper: KeeperRecord,
    a: AcquireRequest,
  ): Promise<KeepResponse> {
    const limits = this.deps.limits;
    const key = this.keyOf("acquire", a.key, keeper);
    if (a.ttl !== undefined) {
      throw new InvalidArgumentError(
        "acquire.ttl",
        "must be unset on a Keep stream: the lease lives as long as its keeper",
      );
    }
    if (a.keeperId !== "" && a.keeperId.toLowerCase() !== keeper.id) {
      throw new InvalidArgumentError("acquire.keeper_id", "must be empty or this stream's keeper");
    }
    const waitMs = checkWait("acquire.wait", a.wait, limits);
    const runId = a.runId === "" ? randomUUID() : checkRunId("acquire.run_id", a.runId);
    const holder =
      a.holder === ""
        ? keeper.holder
        : checkText("acquire.holder", a.holder, limits.maxHolderLength);
    const input = {
      ...key,
      runId,
      ttlMs: Number(keeper.ttlMs),
      holder,
      keeperId: keeper.id,
    };
    const waiters = this.deps.waiters;
    const result =
      waiters && waitMs > 0
        ? await waiters.acquire(input, waitMs, this.ops.signal)
        : await this.deps.store.acquire(input);
    return create(KeepResponseSchema, {
      id,
      result: {
        case: "acquire",
        value: create(AcquireResponseSchema, {
          acquired: result.acquired,
          lease: result.acquired ? leaseToProto(result.lease) : undefined,
          current: !result.acquired && result.current ? leaseToProto(result.current) : undefined,
          lockDelayUntil:
            !result.acquired && result.lockDelayUntilUs !== undefined
              ? timestampFromMicros(result.lockDelayUntilUs)
              : undefined,
        }),
      },
    });
  }

  private async release(
    id: bigint,
    keeper: KeeperRecord,
    r: ReleaseRequest,
  ): Promise<KeepResponse> {
    const key = this.keyOf("release", r.key, keeper);
    const runId = checkRunId("release.run_id", r.runId);
    const ended = await this.deps.store.release(key, runId);
    return create(KeepResponseSchema, {
      id,
      result: {
        case: "release",
        value: create(ReleaseResponseSchema, { released: ended !== undefined }),
      },
    });
  }

  private async get(id: bigint, keeper: KeeperRecord, g: GetRequest): Promise<KeepResponse> {
    const key = this.keyOf("get", g.key, keeper);
    const lease = await this.deps.store.get(key);
    const delayUntil = lease === undefined ? await this.deps.store.lockDelayUntil(key) : undefined;
    return create(KeepResponseSchema, {
      id,
      result: {
        case: "get",
        value: create(GetResponseSchema, {
          held: lease !== undefined,
          lease: lease ? leaseToProto(lease) : undefined,
          lockDelayUntil: delayUntil === undefined ? undefined : timestampFromMicros(delayUntil),
        }),
      },
    });
  }

  /** Close: every lease released, the keeper ended (no lock-delay); the answer, then the end. */
  private async closeKeeper(id: bigint, keeper: KeeperRecord): Promise<KeepResponse | undefined> {
    const ended = await this.deps.keepers.end(keeper.accountId, keeper.id, { ended: "closed" });
    if (!ended.ended && ended.cause !== "closed") {
      this.lose(id, lossOfKeeper[ended.cause ?? "not_found"]);
      return undefined;
    }
    this.last(
      create(KeepResponseSchema, {
        id,
        result: {
          case: "keeper",
          value: create(KeeperSchema, {
            ...keeperToProto(keeper),
            expiresAt: undefined,
            remaining: durationFromMillis(0),
          }),
        },
      }),
    );
    return undefined;
  }

  /**
   * The keeper is lost: `lost` (answering request `id`, or 0 unasked), then
   * the stream ends OK once what is queued is written. Its waiting acquires
   * are given up (nothing they could be granted would be valid).
   */
  lose(id: bigint, cause: LossCause, detail = ""): void {
    this.last(
      create(KeepResponseSchema, {
        id,
        result: {
          case: "lost",
          value: create(KeeperLostSchema, { reason: lossReasonFromCause(cause), detail }),
        },
      }),
    );
  }

  /**
   * The stream's last answer (a close's, or `lost`): nothing is answered
   * after it, and the stream ends OK once it is written. The answers of
   * requests still in flight are dropped (their waiting acquires given up).
   */
  private last(response: KeepResponse): void {
    if (this.closed || this.finishing || this.failure) return;
    this.push(response);
    this.finishing = true;
    this.inFlight.clear();
    this.ops.abort(new ConnectError("the keeper ended", Code.Canceled));
    this.notify();
  }

  /** The open keeper's id and account, once it is open. */
  get keeperOf(): { id: string; accountId: string } | undefined {
    return this.keeper;
  }

  /** The client sent its last request: end after the outstanding answers. The keeper goes on. */
  endRequests(): void {
    this.requestsEnded = true;
    this.maybeFinish();
  }

  private maybeFinish(): void {
    if (
      (this.requestsEnded || this.finishing) &&
      !this.opening &&
      (this.inFlight.size === 0 || this.finishing)
    ) {
      this.notify();
    }
  }

  private get done(): boolean {
    return (
      (this.finishing || (this.requestsEnded && !this.opening && this.inFlight.size === 0)) &&
      this.queue.length === 0
    );
  }

  fail(error: unknown): void {
    if (this.failure || this.closed) return;
    this.failure = { error };
    this.queue = [];
    this.notify();
  }

  private push(response: KeepResponse): void {
    if (this.closed || this.failure || this.finishing) return;
    const max = this.deps.limits.maxStreamBacklog;
    if (this.queue.length >= max) {
      this.fail(
        new ResourceExhaustedError(
          `the Keep stream has ${max} answers its client has not read; it is closed so that it holds no more server memory`,
          LimitName.streamBacklog,
          max,
        ),
      );
      return;
    }
    this.queue.push(response);
    this.notify();
  }

  private notify(): void {
    if (!this.outlet || this.flushScheduled || this.closed) return;
    this.flushScheduled = true;
    queueMicrotask(() => {
      this.flushScheduled = false;
      this.flush();
    });
  }

  /** The one way to read the stream's answers (called once). */
  pipe(outlet: Outlet<KeepResponse>): void {
    if (this.outlet) throw new Error("a Keep session is piped once");
    this.outlet = outlet;
    this.notify();
  }

  private flush(): void {
    const outlet = this.outlet;
    if (!outlet || this.blocked || this.closed) return;
    if (this.failure) {
      this.finish(this.failure.error);
      return;
    }
    if (this.queue.length > 0) {
      const answers = this.queue;
      this.queue = [];
      if (!outlet.write(answers)) {
        this.blocked = true;
        outlet.onDrain(() => {
          this.blocked = false;
          this.flush();
        });
        return;
      }
    }
    if (this.done) this.finish();
  }

  private finish(error?: unknown): void {
    const outlet = this.outlet;
    this.close();
    outlet?.end(error);
  }

  /** The call ended (its client left, a deadline, a shutdown): stops without a word; the keeper runs to its deadline. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.queue = [];
    this.held = [];
    this.ops.abort(new ConnectError("the Keep stream ended", Code.Canceled));
  }
}

type Impl = ServiceImpl<typeof LeaseService>;

/** Keep on the Connect adapter (Connect, gRPC-Web, and gRPC when the native path is off). */
export function createKeepService(deps: KeepServiceDeps): Pick<Impl, "keep"> {
  return {
    async *keep(requests, ctx) {
      // The policy's check, handed over by the interceptor: the handler
      // answers a refused request itself (PolicyCall.checkedByHandler).
      const check = ctx.values.get(requestCheckKey);
      if (check === undefined) {
        throw new ConnectError("Keep is served without its request check", Code.Internal);
      }
      const session = new KeepSession(deps, check);
      void (async () => {
        for await (const req of requests) session.submit(req);
        session.endRequests();
      })().catch((error: unknown) => session.fail(error));
      yield* piped<KeepResponse>(
        ctx.signal,
        (outlet) => session.pipe(outlet),
        () => session.close(),
      );
    },
  };
}
