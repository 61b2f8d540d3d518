// Leader election (DESIGN E1) on a session key: an election is the session
// `{ accountId, sessionId: election }` of the account, so it shares the data
// model, quotas, ACLs, audit history and web page of every other session.
// The leader is the run that holds the session's lease; its term is the
// grant's fencing token (S6: strictly increasing per election, accepted by
// every fence); its value is the lease's holder label.
//
// campaign() is runExclusive() with a body that hands its context out and
// waits for the leadership to end: the grant, the late-grant refusal, the
// keep-alive on the client's shared stream, the local deadline (L2) and the
// release-unless-lost are runExclusive's, unchanged. What this file adds is
// the waiting loop (a waiting Acquire is bounded by the server's --max-wait),
// the one-call-per-term callbacks, proclaim, and observe's gap-free change
// stream over Watch and History. With a keeper, runExclusive's keeper form
// holds the lease instead: the same context and rules, the keeper's timing.

import { type CallOptions, Code } from "@connectrpc/connect";
import {
  EventType,
  type HandoffRequested,
  type Lease,
  type Event as LeaseEvent,
} from "../gen/leasehold/v1/lease_pb.js";
import type { LeaseClient } from "./client.js";
import { dateFromTimestamp, durationFromMs } from "./durations.js";
import {
  CanceledError,
  DeadlineExceededError,
  InvalidArgumentError,
  LateGrantError,
  LeaseLostError,
  LeaseNotHeldError,
  NotAcquiredError,
  toLeaseholdError,
  UnavailableError,
} from "./errors.js";
import type { FencingSource } from "./fencing.js";
import type { Keeper } from "./keeper.js";
import type { LeaseContext } from "./run-exclusive.js";

/** The longest label the server keeps (its `holder` limit), and so the longest value. */
export const maxElectionValueLength = 64;

/** Which election: a session key of the account. */
export interface ElectionKey {
  readonly accountId: string;
  /** The election's name; it is the session id of the lease. */
  readonly election: string;
}

/** The leader of an election, as the server last reported it. */
export interface Leader {
  /** The advertised value (the lease's holder label). */
  readonly value: string;
  /** The term: the grant's fencing token. */
  readonly term: bigint;
  /** The leader's run id. */
  readonly runId: string;
  /** When its lease ends unless renewed, on the database clock. */
  readonly expiresAt: Date | undefined;
}

/**
 * Why a term ended: the leader resigned (or its `lead` returned), its lease
 * was lost (`cause` says how: expired, revoked, taken over, the local
 * deadline passed with no confirmed renewal, renewals failed), or the
 * caller's signal aborted.
 */
export type StopReason =
  | { readonly kind: "resigned" }
  | { readonly kind: "lost"; readonly cause: LeaseLostError }
  | { readonly kind: "cancelled"; readonly cause: unknown };

/** The callbacks of a campaign, as client-go's leaderelection names them. */
export interface ElectionCallbacks {
  /** This candidate became leader with this term. Called before campaign() returns. */
  onStartedLeading?(term: bigint): void;
  /**
   * The term ended. Called exactly once per term that onStartedLeading
   * began, whatever ended it, as soon as the leadership's signal aborts
   * (before a successor can be granted, L2, unless an operator revoked the
   * term: fences refuse the old term).
   */
  onStoppedLeading?(term: bigint, reason: StopReason): void;
}

/** Options of `campaign`. */
export interface CampaignOptions extends ElectionKey, ElectionCallbacks {
  /** The advertised value, at most 64 characters (it is the lease's holder label). */
  readonly value: string;
  /** TTL of the leader's lease, in ms; default 10 000. */
  readonly ttlMs?: number;
  /** Subtracted from every local deadline, in ms; default TTL/10. */
  readonly safetyMarginMs?: number;
  /** Time between renewals, in ms; default about every 0.3 TTL. */
  readonly renewIntervalMs?: number;
  /** Give up campaigning after this long, in ms (NotAcquiredError); default: never. */
  readonly timeoutMs?: number;
  /**
   * Campaign on this keeper (docs/keepers.md): the waiting Acquire and the
   * leader's lease ride the keeper's stream, its heartbeat keeps the lease,
   * and the keeper's TTL, margin and lock-delay apply (leave `ttlMs`,
   * `safetyMarginMs` and `renewIntervalMs` out). The keeper lost while
   * waiting ends the campaign (its LeaseLostError); lost while leading, it
   * ends the term (`lost`).
   */
  readonly keeper?: Keeper;
  /**
   * Longest single waiting Acquire, in ms; the campaign asks again when it
   * runs out. Keep it at or below the server's --max-wait (default 5m).
   * Default 60 000.
   */
  readonly waitChunkMs?: number;
}

/** A term of leadership, from campaign(). Present it to fences as a lease's context. */
export interface Leadership extends FencingSource {
  /** The term: this grant's fencing token. */
  readonly term: bigint;
  /** The same number, as fences read it. */
  readonly fencingToken: bigint;
  /** The election's session key. */
  readonly key: { readonly accountId: string; readonly sessionId: string };
  /** This candidate's run id. */
  readonly runId: string;
  /** The value advertised now. */
  readonly value: string;
  /** The lease as last confirmed by the server. */
  readonly lease: Lease;
  /**
   * Aborts before the database deadline when leadership can no longer be
   * vouched for (lost, revoked, taken over, local deadline passed), and when
   * the term ends any other way (resign, the caller's signal). Stop acting
   * as leader when it aborts.
   */
  readonly signal: AbortSignal;
  /** Resolves with why the term ended, once it has. */
  readonly ended: Promise<StopReason>;
  /** Milliseconds until the local deadline, as of now. */
  remainingMs(): number;
  /** Throws once leadership is lost or ended (read from the clock, as runExclusive's context). */
  throwIfLost(): void;
  /** Call options for a fenced call made as leader (see `fencingInterceptor`). */
  callOptions(): CallOptions;
  /** The fencing headers of this term; throws once it has ended. */
  headers(): Headers;
  /** Calls `listener` for each handoff request someone sends to the leader. */
  onHandoffRequested(listener: (request: HandoffRequested) => void): () => void;
  /**
   * Advertises `value` instead, keeping the term (an idempotent re-acquire
   * by the same run: the server keeps the token and changes the label).
   * Refused once leadership is lost or ended; the server refuses it too when
   * the lease is no longer this run's (S4).
   */
  proclaim(value: string): Promise<void>;
  /** Ends the term at once (Release) and lets the next candidate in. Idempotent. */
  resign(): Promise<void>;
}

/** A promise and its settling functions (Promise.withResolvers, before ES2024). */
function deferred<T>(): {
  promise: Promise<T>;
  resolve: (value: T) => void;
  reject: (reason: unknown) => void;
} {
  let resolve!: (value: T) => void;
  let reject!: (reason: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

function checkValue(value: string): void {
  if ([...value].length > maxElectionValueLength) {
    const rule = `must be at most ${maxElectionValueLength} characters (it is the lease's holder label), got ${[...value].length}`;
    throw new InvalidArgumentError(`value ${rule}`, "value", rule);
  }
}

function sessionKeyOf(key: ElectionKey): { accountId: string; sessionId: string } {
  return { accountId: key.accountId, sessionId: key.election };
}

function leaderOf(lease: Lease): Leader {
  return {
    value: lease.holder,
    term: lease.fencingToken,
    runId: lease.runId,
    expiresAt: lease.expiresAt ? dateFromTimestamp(lease.expiresAt) : undefined,
  };
}

/**
 * Waits until this candidate leads the election, then returns its
 * Leadership (E1).
 *
 * The wait is the server's waiting Acquire, served in arrival order on one
 * instance (docs/client.md, "Leader election"); it is asked again whenever
 * one wait runs out, with the same run id. A grant whose answer arrives
 * after its own local deadline is refused and released, and the campaign
 * goes on. It throws — leaving no lease and no waiter on the server — when
 * `signal` aborts (CanceledError or the signal's reason), when the waiting
 * call fails (its connection lost: the server drops the waiter with the
 * call, and the client releases by run id in case a grant raced the
 * failure), or when `timeoutMs` passes (NotAcquiredError naming the
 * leader). It never returns a Leadership without a live grant.
 */
export async function campaign(
  client: LeaseClient,
  options: CampaignOptions,
  callOptions: { signal?: AbortSignal } = {},
): Promise<Leadership> {
  checkValue(options.value);
  const key = sessionKeyOf(options);
  const callerSignal = callOptions.signal;
  callerSignal?.throwIfAborted();
  const ttlMs = options.ttlMs ?? 10_000;
  const chunkMs = options.waitChunkMs ?? 60_000;
  const giveUpAt =
    options.timeoutMs === undefined
      ? Number.POSITIVE_INFINITY
      : performance.now() + options.timeoutMs;

  // One signal for the whole run, aborted by the caller at any time. The
  // campaign's timeout aborts nothing: the last wait is cut to end at it,
  // and the server's answer then names the leader.
  const run = new AbortController();
  const onCallerAbort = () => run.abort(callerSignal?.reason);
  callerSignal?.addEventListener("abort", onCallerAbort, { once: true });
  let timedOut = false;

  let lastSeen: Lease | undefined;
  for (;;) {
    const waitMs = Math.max(0, Math.min(chunkMs, giveUpAt - performance.now()));
    const granted = deferred<{ ctx: LeaseContext; stop: () => void }>();
    const finished = deferred<void>();
    let started = false;
    const holding = client
      .runExclusive(
        key,
        async (ctx) => {
          started = true;
          const over = new Promise<void>((resolve) => {
            ctx.signal.addEventListener("abort", () => resolve(), { once: true });
          });
          granted.resolve({ ctx, stop: () => finished.resolve() });
          await Promise.race([over, finished.promise]);
        },
        options.keeper
          ? { keeper: options.keeper, waitMs, holder: options.value, signal: run.signal }
          : {
              ttlMs,
              waitMs,
              holder: options.value,
              safetyMarginMs: options.safetyMarginMs,
              renewIntervalMs: options.renewIntervalMs,
              signal: run.signal,
            },
      )
      .then(
        () => undefined,
        (error: unknown) => {
          if (!started) granted.reject(error);
        },
      );
    let term: { ctx: LeaseContext; stop: () => void };
    try {
      term = await granted.promise;
    } catch (error) {
      // A grant whose answer came too late is released; one that had already
      // ended when runExclusive re-acquired to confirm it (LEASE_NOT_HELD:
      // this run's lease expired before the answer arrived) is none either.
      // Each attempt is a new run, so the next one can be granted.
      if (error instanceof LateGrantError || error instanceof LeaseNotHeldError) continue;
      if (error instanceof NotAcquiredError && !run.signal.aborted) {
        lastSeen = error.current ?? lastSeen;
        if (performance.now() < giveUpAt) continue;
        timedOut = true;
      }
      callerSignal?.removeEventListener("abort", onCallerAbort);
      if (timedOut) {
        throw new NotAcquiredError(
          `election ${options.accountId}/${options.election} not won within ${options.timeoutMs}ms`,
          lastSeen,
          { cause: error },
        );
      }
      if (run.signal.aborted && callerSignal?.aborted) {
        throw new CanceledError("the campaign was cancelled", Code.Canceled, {
          cause: callerSignal.reason,
        });
      }
      throw toLeaseholdError(error);
    }
    if (term.ctx.signal.aborted && callerSignal?.aborted) {
      // Cancelled as the grant arrived: the grant is released (runExclusive
      // ends it with the cancelled run), and no term is reported.
      callerSignal.removeEventListener("abort", onCallerAbort);
      await holding;
      throw new CanceledError("the campaign was cancelled", Code.Canceled, {
        cause: callerSignal.reason,
      });
    }
    return startTerm(client, options, term.ctx, term.stop, holding, {
      ttlMs,
      detach: () => callerSignal?.removeEventListener("abort", onCallerAbort),
    });
  }
}

function startTerm(
  client: LeaseClient,
  options: CampaignOptions,
  ctx: LeaseContext,
  stop: () => void,
  holding: Promise<void>,
  extra: { ttlMs: number; detach: () => void },
): Leadership {
  const term = ctx.fencingToken;
  let value = options.value;
  let resigning = false;
  const ended = deferred<StopReason>();
  const onAbort = () => {
    const reason: unknown = ctx.signal.reason;
    let why: StopReason;
    if (reason instanceof LeaseLostError && reason.lossReason === "released") {
      why = { kind: "resigned" };
    } else if (reason instanceof LeaseLostError) {
      why = { kind: "lost", cause: reason };
    } else if (resigning) {
      why = { kind: "resigned" };
    } else {
      why = { kind: "cancelled", cause: reason };
    }
    extra.detach();
    ended.resolve(why);
    try {
      options.onStoppedLeading?.(term, why);
    } catch {
      // A callback's own failure must not keep the term from ending.
    }
  };

  const leadership: Leadership = {
    term,
    fencingToken: term,
    key: ctx.key,
    runId: ctx.runId,
    get value() {
      return value;
    },
    get lease() {
      return ctx.lease;
    },
    signal: ctx.signal,
    ended: ended.promise,
    remainingMs: () => ctx.remainingMs(),
    throwIfLost: () => ctx.throwIfLost(),
    callOptions: () => ctx.callOptions(),
    headers: () => ctx.headers(),
    onHandoffRequested: (listener) => ctx.onHandoffRequested(listener),
    async proclaim(next) {
      checkValue(next);
      ctx.throwIfLost();
      // The same run again: the server keeps the token and takes the label.
      // A lease on a keeper is re-acquired on that keeper (a plain Acquire
      // names no keeper, and the server refuses it the lease).
      const response = options.keeper
        ? await options.keeper.acquire(
            { key: ctx.key, runId: ctx.runId, holder: next },
            { signal: ctx.signal },
          )
        : await client.acquire(
            { key: ctx.key, runId: ctx.runId, ttl: durationFromMs(extra.ttlMs), holder: next },
            { signal: ctx.signal },
          );
      ctx.throwIfLost();
      if (!response.acquired || response.lease?.fencingToken !== term) {
        throw new NotAcquiredError(
          `term ${term} of ${ctx.key.accountId}/${ctx.key.sessionId} is over: the value was not changed`,
          response.current,
        );
      }
      value = next;
    },
    async resign() {
      resigning = true;
      stop();
      await holding;
    },
  };
  try {
    options.onStartedLeading?.(term);
  } catch {
    // As onStoppedLeading: the callback's failure is the caller's.
  }
  // A term lost between the grant and here (or in onStartedLeading) still
  // gets its one onStoppedLeading: a listener added to an aborted signal
  // would never run.
  if (ctx.signal.aborted) onAbort();
  else ctx.signal.addEventListener("abort", onAbort, { once: true });
  return leadership;
}

/** The current leader of an election, or undefined when nobody leads. */
export async function leader(
  client: LeaseClient,
  key: ElectionKey,
  options: CallOptions = {},
): Promise<Leader | undefined> {
  const response = await client.get({ key: sessionKeyOf(key) }, options);
  return response.held && response.lease ? leaderOf(response.lease) : undefined;
}

/** One change of an election, as observe() yields it. */
export type ElectionChange =
  /** The first item: the leader as of when observing began (undefined: none). */
  | { readonly type: "current"; readonly leader: Leader | undefined }
  /** A new term began. */
  | { readonly type: "elected"; readonly leader: Leader }
  /** The leader advertised another value in the same term. */
  | { readonly type: "proclaimed"; readonly leader: Leader }
  /** The term ended and nobody leads now (resigned, expired, revoked). */
  | {
      readonly type: "ended";
      readonly term: bigint;
      readonly how: "resigned" | "expired" | "revoked";
    };

// Codes after which opening the Watch again cannot succeed.
const stopCodes = new Set<Code>([
  Code.InvalidArgument,
  Code.PermissionDenied,
  Code.Unauthenticated,
  Code.Unimplemented,
]);

const endings = new Map<EventType, "resigned" | "expired" | "revoked">([
  [EventType.RELEASED, "resigned"],
  [EventType.EXPIRED, "expired"],
  [EventType.REVOKED, "revoked"],
]);

/**
 * Observes an election: yields the current leader first, then every change
 * in order — a new term, a proclaimed value, a term that ended with no
 * successor — until `options.signal` aborts (the iteration then ends).
 *
 * Across a reconnect (the stream cut, the instance gone: the next
 * configured instance is tried) and whenever the server sends a fresh
 * snapshot (it could not vouch that no change was missed), the terms
 * granted meanwhile are read from History before the snapshot is applied,
 * so no term the server recorded is skipped; changes are deduplicated by
 * term, so none is yielded twice.
 */
export async function* observe(
  client: LeaseClient,
  key: ElectionKey,
  options: { signal?: AbortSignal; reconnectDelayMs?: number } = {},
): AsyncGenerator<ElectionChange, void, undefined> {
  const sessionKey = sessionKeyOf(key);
  const signal = options.signal;
  let current: Leader | undefined;
  let highest = 0n;
  let started = false;
  let failures = 0;

  // Applies one event; returns the change to yield, if it is one.
  const apply = (event: LeaseEvent): ElectionChange | undefined => {
    if (event.type === EventType.ACQUIRED) {
      if (event.fencingToken <= highest) return undefined;
      highest = event.fencingToken;
      // History's events carry no lease: the leader from the event's fields.
      current = event.lease
        ? leaderOf(event.lease)
        : {
            value: event.holder,
            term: event.fencingToken,
            runId: event.runId,
            expiresAt: undefined,
          };
      return { type: "elected", leader: current };
    }
    if (event.type === EventType.RENEWED && event.lease) {
      if (current?.term !== event.fencingToken || event.lease.holder === current.value) {
        return undefined;
      }
      current = leaderOf(event.lease);
      return { type: "proclaimed", leader: current };
    }
    const how = endings.get(event.type);
    if (how === undefined || current?.term !== event.fencingToken) return undefined;
    current = undefined;
    return { type: "ended", term: event.fencingToken, how };
  };

  // The events recorded after the last term seen, oldest first.
  const missed = async (): Promise<LeaseEvent[]> => {
    const found: LeaseEvent[] = [];
    let pageToken = "";
    for (;;) {
      const response = await client.history(
        { key: sessionKey, pageSize: 100, pageToken },
        { signal },
      );
      let reached = false;
      for (const event of response.events) {
        // Newest first: stop at the grant of the last term seen (its end,
        // recorded after it, is kept) or anything older.
        if (
          event.fencingToken < highest ||
          (event.fencingToken === highest && event.type === EventType.ACQUIRED)
        ) {
          reached = true;
          break;
        }
        found.push(event);
      }
      if (reached || response.nextPageToken === "") break;
      pageToken = response.nextPageToken;
    }
    return found.reverse();
  };

  // Reconciles a snapshot: History first when it may hide a change.
  async function* resync(leases: readonly Lease[]): AsyncGenerator<ElectionChange> {
    const lease = leases.find((l) => l.key?.sessionId === key.election);
    if (!started) {
      started = true;
      current = lease ? leaderOf(lease) : undefined;
      if (lease && lease.fencingToken > highest) highest = lease.fencingToken;
      yield { type: "current", leader: current };
      return;
    }
    for (const event of await missed()) {
      const change = apply(event);
      if (change) yield change;
    }
    // What History could not show (trimmed by age): said from the snapshot.
    if (lease && lease.fencingToken > highest) {
      highest = lease.fencingToken;
      current = leaderOf(lease);
      yield { type: "elected", leader: current };
    } else if (!lease && current) {
      // The snapshot shows no leader, but History (read after it) may show a
      // term granted since: that one still leads, and its end will come on
      // the stream. Only a term that Get also finds over has ended.
      const now = await client.get({ key: sessionKey }, { signal });
      if (now.lease?.fencingToken !== current.term) {
        const term = current.term;
        current = undefined;
        yield { type: "ended", term, how: "expired" };
      }
    } else if (lease && current?.term === lease.fencingToken && lease.holder !== current.value) {
      current = leaderOf(lease);
      yield { type: "proclaimed", leader: current };
    }
  }

  // Terms granted before observing began are not changes: every grant
  // committed before this read has a token at most this (S6), and every
  // later one reaches the Watch opened after it, or its snapshot.
  highest = (await client.checkFence({ key: sessionKey, fencingToken: 1n }, { signal }))
    .highestToken;
  let reconnecting = false;
  while (!signal?.aborted) {
    try {
      // The client's streams go to the instance that answered its last
      // unary call, and its unary calls fail over: one Get, before the
      // Watch opens again, moves it to an instance that answers.
      if (reconnecting) await client.get({ key: sessionKey }, { signal });
      reconnecting = true;
      for await (const message of client.watch(
        { key: sessionKey, includeRenewals: true },
        { signal },
      )) {
        failures = 0;
        if (message.kind.case === "snapshot") {
          yield* resync(message.kind.value.leases);
        } else if (message.kind.case === "event" && started) {
          const change = apply(message.kind.value);
          if (change) yield change;
        }
      }
    } catch (error) {
      if (signal?.aborted) return;
      const failure = toLeaseholdError(error);
      if (stopCodes.has(failure.code)) throw failure;
    }
    if (signal?.aborted) return;
    // The stream ended or failed: open it again after a short backoff.
    failures += 1;
    const bound = Math.min(2_000, (options.reconnectDelayMs ?? 100) * 2 ** Math.min(failures, 5));
    await pause(Math.random() * bound, signal);
  }
}

/** Resolves after `ms`, or at once when `signal` aborts. */
function pause(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise<void>((resolve) => {
    if (signal?.aborted) {
      resolve();
      return;
    }
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}

/** Options of `runElection`. */
export interface RunElectionOptions extends CampaignOptions {
  /** Called for every change of leader, this candidate's own terms included. */
  onNewLeader?(leader: Leader): void;
  /** Campaign again after a term ends (default true); false stops after one term. */
  readonly again?: boolean;
}

/**
 * Campaigns, runs `lead` while leading (it gets the Leadership; stop when
 * its signal aborts), resigns when `lead` settles, and campaigns again
 * (unless `again` is false) until `signal` aborts. A campaign whose waiting
 * call was lost (UnavailableError, DeadlineExceededError: an instance gone,
 * a connection reset or stalled) is started again after a backoff (100 ms
 * doubling to 2 s, full jitter). Resolves when it stops; rejects with any
 * other campaign error (a refusal, a timeout's NotAcquiredError) or with
 * the error `lead` threw.
 */
export async function runElection(
  client: LeaseClient,
  options: RunElectionOptions,
  lead: (leadership: Leadership) => Promise<void>,
  callOptions: { signal?: AbortSignal } = {},
): Promise<void> {
  const { signal } = callOptions;
  const watching = new AbortController();
  const onAbort = () => watching.abort();
  signal?.addEventListener("abort", onAbort, { once: true });
  const watcher =
    options.onNewLeader === undefined
      ? Promise.resolve()
      : (async () => {
          for await (const change of observe(client, options, { signal: watching.signal })) {
            if (change.type !== "ended" && change.leader) options.onNewLeader?.(change.leader);
          }
        })().catch(() => undefined);
  let failures = 0;
  try {
    for (let terms = 0; !signal?.aborted && (terms === 0 || options.again !== false); ) {
      let leadership: Leadership;
      try {
        leadership = await campaign(client, options, { signal });
        failures = 0;
      } catch (error) {
        if (signal?.aborted) return;
        // The waiting call's connection or instance went away: campaign
        // again (with a new run id, so nothing of the failed one is reused)
        // after a backoff with full jitter. Any other failure is the answer.
        if (!(error instanceof UnavailableError || error instanceof DeadlineExceededError)) {
          throw error;
        }
        failures += 1;
        await pause(Math.random() * Math.min(2_000, 100 * 2 ** Math.min(failures, 5)), signal);
        continue;
      }
      terms += 1;
      try {
        await lead(leadership);
      } finally {
        await leadership.resign();
      }
    }
  } finally {
    signal?.removeEventListener("abort", onAbort);
    watching.abort();
    await watcher;
  }
}
