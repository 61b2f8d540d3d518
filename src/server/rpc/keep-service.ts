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
import { Code, ConnectError, type ServiceImpl } from "@connectrpc/connect";
import { statusOf } from "../../call/error-codes.js";
import { requestCheckKey } from "../../call/policy-interceptor.js";
import {
  type AcquireRequest,
  type GetRequest,
  HandoffRequestedSchema,
  type Keeper,
  KeeperHandoffRequestedSchema,
  KeeperLeaseLostSchema,
  KeeperLostSchema,
  KeeperSchema,
  type KeepRequest,
  type KeepResponse,
  KeepResponseSchema,
  type LeaseService,
  type OpenKeeper,
  type ReleaseRequest,
  ReleaseResponseSchema,
  RevokeKeeperResponseSchema,
  SessionKeySchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import {
  InvalidArgumentError,
  KeeperNotHeldError,
  PermissionDeniedError,
  ResourceExhaustedError,
  UnauthenticatedError,
} from "../../lease/errors.js";
import { keyString, type LeaseChange, runKey } from "../../lease/lease-change.js";
import { formatDuration, type Limits } from "../../lease/limits.js";
import type {
  AcquireInput,
  AcquireResult,
  KeeperEnd,
  KeeperLease,
  KeeperRecord,
  KeeperStore,
  LeaseStore,
  SessionKey,
} from "../../lease/types.js";
import {
  checkId,
  checkKey,
  checkOptionalTtl,
  checkRunId,
  checkText,
  checkTtl,
  checkWait,
  durationMs,
} from "../../lease/validation.js";
import { LimitName, type LossCause } from "../../protocol/errors.js";
import { lossReasonFromCause } from "../../protocol/loss-reason.js";
import type { ChangeFeed } from "../streams/change-feed.js";
import type { Outlet } from "../streams/outlet.js";
import type { Waiters } from "../streams/waiters.js";
import {
  acquireResponse,
  durationFromMicros,
  durationFromMillis,
  getResponse,
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
  /** What the streams learn of their leases' ends and handoffs (createKeeperFollow). */
  follow?: KeeperFollow;
  /** The database clock, as this instance tracks it: the keeper's deadline is armed on it. */
  databaseNowUs?: () => bigint;
}

/**
 * The keepers' streams of this instance, by the keys of their leases: one
 * subscription to the change feed (every instance's changes) hands each
 * change to the streams following its key.
 */
export interface KeeperFollow {
  add(key: string, session: KeepSession): void;
  remove(key: string, session: KeepSession): void;
  /** The streams of keeper `id` on this instance (one, or a few while one re-attaches). */
  attach(id: string, session: KeepSession): void;
  detach(id: string, session: KeepSession): void;
  /**
   * Keeper `id` was ended here (a RevokeKeeper): its streams on this
   * instance read it now. Those on other instances learn at their next
   * heartbeat, their deadline check, or a change of one of its leases.
   */
  ended(id: string): void;
  start(): void;
  close(): void;
}

export function createKeeperFollow(feed: ChangeFeed): KeeperFollow {
  const byKey = new Map<string, Set<KeepSession>>();
  const byKeeper = new Map<string, Set<KeepSession>>();
  let unsubscribe: (() => void) | undefined;
  return {
    attach(id, session) {
      let set = byKeeper.get(id);
      if (!set) {
        set = new Set();
        byKeeper.set(id, set);
      }
      set.add(session);
    },
    detach(id, session) {
      const set = byKeeper.get(id);
      set?.delete(session);
      if (set?.size === 0) byKeeper.delete(id);
    },
    ended(id) {
      for (const session of [...(byKeeper.get(id) ?? [])]) session.keeperEnded();
    },
    add(key, session) {
      let set = byKey.get(key);
      if (!set) {
        set = new Set();
        byKey.set(key, set);
      }
      set.add(session);
    },
    remove(key, session) {
      const set = byKey.get(key);
      set?.delete(session);
      if (set?.size === 0) byKey.delete(key);
    },
    start() {
      unsubscribe = feed.subscribe((change) => {
        if (change.type === "renewed" || change.type === "acquired") return;
        const set = byKey.get(keyString(change));
        if (set) for (const session of [...set]) session.onChange(change);
      });
    },
    close() {
      unsubscribe?.();
      byKey.clear();
      byKeeper.clear();
    },
  };
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

const lossOfKeeper: Record<KeeperEnd, LossCause> = {
  expired: "expired",
  revoked: "revoked",
  // Closed by another stream of the same keeper: its leases were released.
  closed: "released",
  not_found: "not_found",
};

/** An acquire that may wait, noted as it arrived: what gives it up, and when it was answered. */
interface MayWait {
  readonly own: AbortController;
  /** Resolves once the acquire is answered (KeepSession.depart). */
  readonly answered: Promise<void>;
  readonly markAnswered: () => void;
}

/** What a request's arrival noted (KeepSession.arrive). */
interface Arrival {
  /** An acquire that may wait: its run key, and what gives it up. */
  readonly wait?: { readonly rk: string; readonly acquire: MayWait };
  /** A release: the waiting acquires of its run that arrived before it. */
  readonly release?: readonly MayWait[];
}

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
  /**
   * The acquires of this stream that may wait, by run key, registered as
   * they arrive (before their checks, which may finish in any order): a
   * release of the same run gives up those that arrived before it, so a
   * candidate that stopped waiting leaves no waiter.
   */
  private readonly waiting = new Map<string, Set<MayWait>>();
  private queue: KeepResponse[] = [];
  private outlet: Outlet<KeepResponse> | undefined;
  private blocked = false;
  private flushScheduled = false;
  private requestsEnded = false;
  /** After a close's answer or a `lost`: no more requests; ends once everything is written. */
  private finishing = false;
  private failure: { error: unknown } | undefined;
  private closed = false;
  /** The keeper's open leases this stream follows, by run key. */
  private readonly runs = new Map<string, KeeperLease>();
  /** This stream's close is in flight: the releases it publishes are its own. */
  private closing = false;
  /** Fires at the keeper's deadline: a keeper not renewed by then is lost. */
  private deadlineTimer: NodeJS.Timeout | undefined;
  /** The deadline the timer was armed for. */
  private armedUs = 0n;

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
      // A re-attach follows the leases acquired before (on any stream, any instance).
      const leases = await this.deps.keepers.leasesOf(accountId, keeperId);
      return { keeper: opened.keeper, leases };
    })().then(
      ({ keeper, leases }) => {
        if (this.closed) return;
        this.keeper = keeper;
        this.opening = false;
        for (const lease of leases) this.follow(lease);
        this.deps.follow?.attach(keeper.id, this);
        this.armDeadline(keeper.expiresAtUs);
        this.push(
          create(KeepResponseSchema, {
            id,
            result: {
              case: "keeper",
              value: create(KeeperSchema, { ...keeperToProto(keeper), leases: leases.length }),
            },
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
    const arrival = this.arrive(req);
    let checked: void | Promise<void>;
    try {
      checked = this.check(req);
    } catch (error) {
      this.depart(arrival);
      this.settle(id, error);
      return;
    }
    const run = () => this.run(req, keeper, arrival);
    const answer = checked instanceof Promise ? checked.then(run) : run();
    answer.then(
      (response) => {
        this.depart(arrival);
        this.answered(id, response);
      },
      (error: unknown) => {
        this.depart(arrival);
        this.settle(id, error);
      },
    );
  }

  /**
   * Notes a request in arrival order: an acquire that may wait is
   * registered under its run; a release takes the waiting acquires of its
   * run registered so far (given up once the release passes its checks).
   */
  private arrive(req: KeepRequest): Arrival | undefined {
    const op = req.op;
    if (op.case !== "acquire" && op.case !== "release") return undefined;
    const { key, runId } = op.value;
    if (key === undefined || runId === "") return undefined;
    const rk = runKey(key, runId.toLowerCase());
    if (op.case === "release") return { release: [...(this.waiting.get(rk) ?? [])] };
    if (op.value.wait === undefined) return undefined;
    let markAnswered!: () => void;
    const answered = new Promise<void>((resolve) => {
      markAnswered = resolve;
    });
    const acquire: MayWait = { own: new AbortController(), answered, markAnswered };
    let set = this.waiting.get(rk);
    if (!set) {
      set = new Set();
      this.waiting.set(rk, set);
    }
    set.add(acquire);
    return { wait: { rk, acquire } };
  }

  private depart(arrival: Arrival | undefined): void {
    if (!arrival?.wait) return;
    const { rk, acquire } = arrival.wait;
    const set = this.waiting.get(rk);
    set?.delete(acquire);
    if (set?.size === 0) this.waiting.delete(rk);
    acquire.markAnswered();
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
  private async run(
    req: KeepRequest,
    keeper: KeeperRecord,
    arrival: Arrival | undefined,
  ): Promise<KeepResponse | undefined> {
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
        return this.acquire(id, keeper, op.value, arrival?.wait?.acquire.own);
      case "release":
        return this.release(id, keeper, op.value, arrival?.release ?? []);
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
    // A new TTL, within the server's bounds, kept by the keeper from now on.
    const ttlMs = checkOptionalTtl("heartbeat.ttl", ttl, this.deps.limits);
    const beat = await this.deps.keepers.heartbeat(keeper.accountId, keeper.id, ttlMs);
    if (!beat.held) {
      this.lose(id, lossOfKeeper[beat.cause]);
      return undefined;
    }
    this.keeper = beat.keeper;
    this.armDeadline(beat.keeper.expiresAtUs);
    return create(KeepResponseSchema, {
      id,
      result: {
        case: "keeper",
        value: create(KeeperSchema, { ...keeperToProto(beat.keeper), leases: this.runs.size }),
      },
    });
  }

  /**
   * Arms the check at the keeper's deadline (on the database clock as this
   * instance tracks it): a keeper that no heartbeat renewed by then (on this
   * stream or, after a re-attach, another) is lost, and its stream is told
   * at once rather than at its next heartbeat.
   */
  private armDeadline(expiresAtUs: bigint, atLeastMs = 1): void {
    const now = this.deps.databaseNowUs;
    if (now === undefined || this.closed) return;
    clearTimeout(this.deadlineTimer);
    this.armedUs = expiresAtUs;
    const waitMs = Math.max(atLeastMs, Number(expiresAtUs - now()) / 1_000 + 1);
    this.deadlineTimer = setTimeout(() => this.checkKeeper(), Math.min(waitMs, 2 ** 31 - 1));
  }

  /** The keeper was ended on this instance: read it now rather than at its deadline. */
  keeperEnded(): void {
    if (this.closing) return;
    clearTimeout(this.deadlineTimer);
    this.checkKeeper();
  }

  /** Reads the keeper: still valid (re-arms at its deadline), or lost (`lost`, then the end). */
  private checkKeeper(): void {
    const keeper = this.keeper;
    if (!keeper || this.closed || this.finishing) return;
    const armedUs = this.armedUs;
    this.deps.keepers.status(keeper.accountId, keeper.id).then(
      (status) => {
        // The same deadline, not yet past on the database's own clock (this
        // instance's estimate of it ran early): read again a little later,
        // not in a loop.
        if (status.valid) {
          this.armDeadline(status.expiresAtUs, status.expiresAtUs === armedUs ? 25 : 1);
        } else this.lose(0n, lossOfKeeper[status.cause], status.reason);
      },
      // The database could not say: asked again after a while (a heartbeat
      // may answer first).
      () => {
        if (!this.closed) {
          this.deadlineTimer = setTimeout(() => this.checkKeeper(), 1_000);
        }
      },
    );
  }

  private follow(lease: KeeperLease): void {
    const rk = runKey(lease, lease.runId);
    if (!this.runs.has(rk)) this.deps.follow?.add(keyString(lease), this);
    this.runs.set(rk, lease);
  }

  private unfollow(key: SessionKey, runId: string): void {
    if (!this.runs.delete(runKey(key, runId))) return;
    const k = keyString(key);
    for (const other of this.runs.values()) if (keyString(other) === k) return;
    this.deps.follow?.remove(k, this);
  }

  /** A change of a key one of this stream's leases is on, from any instance. */
  onChange(change: LeaseChange): void {
    const keeper = this.keeper;
    if (!keeper || this.closed || this.finishing || this.closing) return;
    const key = { accountId: change.accountId, sessionId: change.sessionId };
    const run = this.runs.get(runKey(key, change.runId));
    if (!run || run.fencingToken !== change.fencingToken) return;
    const keyProto = create(SessionKeySchema, key);
    if (change.type === "handoff_requested") {
      this.push(
        create(KeepResponseSchema, {
          id: 0n,
          result: {
            case: "handoffRequested",
            value: create(KeeperHandoffRequestedSchema, {
              key: keyProto,
              runId: run.runId,
              request: create(HandoffRequestedSchema, {
                requesterHolder: change.requesterHolder,
                reason: change.reason,
                requestedAt: timestampFromMicros(change.atUs),
              }),
            }),
          },
        }),
      );
      return;
    }
    if (change.type !== "revoked" && change.type !== "released" && change.type !== "expired") {
      return;
    }
    const cause: LossCause = change.type;
    this.unfollow(key, run.runId);
    // One lease ended, or the keeper with all of them: the keeper's row says which.
    this.deps.keepers.status(keeper.accountId, keeper.id).then(
      (status) => {
        if (!status.valid) {
          this.lose(0n, lossOfKeeper[status.cause], status.reason);
          return;
        }
        this.push(
          create(KeepResponseSchema, {
            id: 0n,
            result: {
              case: "leaseLost",
              value: create(KeeperLeaseLostSchema, {
                key: keyProto,
                runId: run.runId,
                reason: lossReasonFromCause(cause),
              }),
            },
          }),
        );
      },
      (error: unknown) => this.fail(error),
    );
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
    own: AbortController | undefined,
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
        ? await this.waitFor(input, waitMs, waiters, own ?? new AbortController())
        : await this.deps.store.acquire(input);
    if (result.acquired) this.follow(result.lease);
    return create(KeepResponseSchema, {
      id,
      result: {
        case: "acquire",
        value: acquireResponse(result),
      },
    });
  }

  /**
   * A waiting acquire, given up when the stream or keeper ends or when a
   * release of the same run arrives; a grant made as it was given up is
   * ended again (by the waiters, or here when the first attempt made it).
   */
  private async waitFor(
    input: AcquireInput,
    waitMs: number,
    waiters: Waiters,
    own: AbortController,
  ): Promise<AcquireResult> {
    own.signal.throwIfAborted();
    const result = await waiters.acquire(
      input,
      waitMs,
      AbortSignal.any([this.ops.signal, own.signal]),
    );
    if (result.acquired && own.signal.aborted) {
      await this.deps.store.release(input, input.runId);
      throw own.signal.reason;
    }
    return result;
  }

  private async release(
    id: bigint,
    keeper: KeeperRecord,
    r: ReleaseRequest,
    earlier: readonly MayWait[],
  ): Promise<KeepResponse> {
    const key = this.keyOf("release", r.key, keeper);
    const runId = checkRunId("release.run_id", r.runId);
    for (const given of earlier) {
      given.own.abort(
        new ConnectError(
          "the acquire was given up: its run was released while it waited",
          Code.Canceled,
        ),
      );
    }
    // Decided once they are answered: an attempt of theirs still deciding
    // may grant the run, and this release then ends that grant (the waiters'
    // own release of it is guarded by the grant's deadline, which a lease on
    // a keeper does not carry).
    await Promise.all(earlier.map((given) => given.answered));
    // Not followed from here: this stream's own release is no loss to report.
    this.unfollow(key, runId);
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
        value: getResponse(lease, delayUntil),
      },
    });
  }

  /** Close: every lease released, the keeper ended (no lock-delay); the answer, then the end. */
  private async closeKeeper(id: bigint, keeper: KeeperRecord): Promise<KeepResponse | undefined> {
    this.closing = true;
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
    clearTimeout(this.deadlineTimer);
    for (const run of [...this.runs.values()]) this.unfollow(run, run.runId);
    if (this.keeper) this.deps.follow?.detach(this.keeper.id, this);
    this.ops.abort(new ConnectError("the Keep stream ended", Code.Canceled));
  }
}

type Impl = ServiceImpl<typeof LeaseService>;

/**
 * Keep on the Connect adapter (Connect, gRPC-Web, and gRPC when the native
 * path is off), and RevokeKeeper (unary, both paths).
 */
export function createKeepService(deps: KeepServiceDeps): Pick<Impl, "keep" | "revokeKeeper"> {
  return {
    async revokeKeeper(req) {
      // Admin scope (access.ts); audited: one REVOKED row per lease, with the reason.
      const accountId = checkId("account_id", req.accountId, deps.limits);
      const keeperId = checkRunId("keeper_id", req.keeperId);
      const reason = checkText("reason", req.reason, deps.limits.maxReasonLength);
      if (reason.trim() === "") {
        throw new InvalidArgumentError(
          "reason",
          "is required: a revoke is audited with its reason",
        );
      }
      const result = await deps.keepers.end(accountId, keeperId, { ended: "revoked", reason });
      if (result.ended) deps.follow?.ended(keeperId);
      return create(RevokeKeeperResponseSchema, {
        revoked: result.ended,
        leasesRevoked: result.leases.length,
      });
    },

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
