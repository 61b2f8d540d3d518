// runExclusive (DESIGN §6, L2): acquire, keep alive on the client's shared
// KeepAlive stream, run the work with a signal that aborts as soon as the
// client can no longer vouch for its lease, and release when the work
// settles, whatever way it settles.

import { randomUUID } from "node:crypto";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { type CallOptions, createContextValues } from "@connectrpc/connect";
import type {
  AcquireRequestSchema,
  AcquireResponse,
  HandoffRequested,
  Lease,
  ReleaseRequestSchema,
  ReleaseResponse,
} from "../gen/leasehold/v1/lease_pb.js";
import { dateFromTimestamp, durationFromMs, msFromDuration } from "./durations.js";
import {
  LateGrantError,
  type LeaseholdError,
  type LeaseLossReason,
  LeaseLostError,
  NotAcquiredError,
  toLeaseholdError,
} from "./errors.js";
import { type FencingSource, fencingContextKey, fencingHeaders, refusalOf } from "./fencing.js";
import type { KeepAliveChannel } from "./keepalive.js";
import { leaseTiming, localDeadline } from "./local-deadline.js";

/** A session key: the account and the session within it. */
export interface SessionKeyInit {
  readonly accountId: string;
  readonly sessionId: string;
}

/** Options of `runExclusive`. */
export interface RunExclusiveOptions {
  /** Lease TTL in ms; default 10 000. */
  ttlMs?: number;
  /** How long to wait for a held session to become free, in ms; default 0 (fail at once with NotAcquiredError). */
  waitMs?: number;
  /** A label of this holder shown to others ("desktop", "browser"). */
  holder?: string;
  /**
   * The run's id (a UUID, in either case; the run uses it lower-cased, as the
   * server does); default a new random one. Reuse it only to retry the same run.
   */
  runId?: string;
  /** Subtracted from every local deadline, in ms; default TTL/10. */
  safetyMarginMs?: number;
  /** Time between renewals, in ms; default (TTL − margin)/3, about every 0.3 TTL. */
  renewIntervalMs?: number;
  /** Cancels the run: aborts an acquire in progress, or aborts the work's signal. */
  signal?: AbortSignal;
}

/** What `work` receives: its lease, its fencing token, and the signal to stop on. */
export interface LeaseContext extends FencingSource {
  /**
   * Aborts when the lease is lost (`lost` on the stream), when a renewal
   * fails, when the local deadline passes without a confirmed renewal, or
   * when the caller's signal aborts. Its `reason` is a LeaseLostError (or the
   * caller's reason). Stop all work, and all writes, when it aborts.
   */
  readonly signal: AbortSignal;
  /** The fencing token of this run's lease; present it with every write. */
  readonly fencingToken: bigint;
  /** The session this run holds. */
  readonly key: SessionKeyInit;
  /** This run's id. */
  readonly runId: string;
  /** The lease as last confirmed by the server (updated on every renewal). */
  readonly lease: Lease;
  /** Milliseconds until the local deadline, as of now (0 once passed). */
  remainingMs(): number;
  /**
   * Calls `listener` for every handoff request (someone asked this run to
   * finish and release, e.g. "continue on this device"), including ones that
   * arrived before the listener was added. Returns a function that removes it.
   */
  onHandoffRequested(listener: (request: HandoffRequested) => void): () => void;
  /**
   * Throws the run's LeaseLostError once its lease is lost — the local
   * deadline read from the monotonic clock now, so a deadline whose timer
   * has not run yet (an event loop blocked past it) counts — or once the run
   * has ended and released it (`lossReason` `released`); a CanceledError
   * once the caller cancelled the run. `fencingInterceptor` calls it before
   * every call made for this run.
   */
  throwIfLost(): void;
  /**
   * Call options for a request made on behalf of this lease: the run's
   * signal, and the context value that `fencingInterceptor()` turns into the
   * fencing headers. Throws as `throwIfLost` does once the lease has ended.
   */
  callOptions(): CallOptions;
  /**
   * The fencing headers, for clients that do not use `fencingInterceptor`.
   * Throws as `throwIfLost` does once the lease has ended: a lost lease has
   * no headers.
   */
  headers(): Headers;
}

/** The parts of a lease client runExclusive needs. */
export interface RunExclusiveDeps {
  acquire(
    request: MessageInitShape<typeof AcquireRequestSchema>,
    options?: CallOptions,
  ): Promise<AcquireResponse>;
  release(
    request: MessageInitShape<typeof ReleaseRequestSchema>,
    options?: CallOptions,
  ): Promise<ReleaseResponse>;
  keepAlive: KeepAliveChannel;
  defaultTimeoutMs: number;
  now: () => number;
  onReleaseError?: (error: LeaseholdError, key: SessionKeyInit, runId: string) => void;
}

function describeHolder(lease: Lease | undefined): string {
  if (!lease) return "another run";
  const who = lease.holder === "" ? "another run" : JSON.stringify(lease.holder);
  const left = (msFromDuration(lease.remaining) / 1000).toFixed(1);
  return `${who} (run ${lease.runId}, token ${lease.fencingToken}), ${left}s left`;
}

/**
 * The NotAcquiredError of a refused grant: who holds the session, or until
 * when a lock-delay (K2) keeps it from everyone.
 */
export function notAcquired(key: SessionKeyInit, response: AcquireResponse): NotAcquiredError {
  const lockDelayUntil = dateFromTimestamp(response.lockDelayUntil);
  const session = `session ${key.accountId}/${key.sessionId}`;
  if (lockDelayUntil && !response.current) {
    return new NotAcquiredError(
      `${session} is in its lock-delay until ${lockDelayUntil.toISOString()} (the keeper of its last lease expired)`,
      undefined,
      { lockDelayUntil },
    );
  }
  return new NotAcquiredError(
    `${session} is held by ${describeHolder(response.current)}`,
    response.current,
    { lockDelayUntil },
  );
}

/**
 * Runs `work` while holding the session's lease. See `LeaseClient.runExclusive`.
 */
export async function runExclusive<T>(
  deps: RunExclusiveDeps,
  key: SessionKeyInit,
  work: (ctx: LeaseContext) => Promise<T> | T,
  options: RunExclusiveOptions = {},
): Promise<T> {
  const timing = leaseTiming({
    ttlMs: options.ttlMs ?? 10_000,
    safetyMarginMs: options.safetyMarginMs,
    renewIntervalMs: options.renewIntervalMs,
  });
  const waitMs = options.waitMs ?? 0;
  // The server keeps a run id as PostgreSQL prints a uuid, lower case, and
  // answers with it: an upper-case id would match none of its answers.
  const runId = options.runId?.toLowerCase() ?? randomUUID();
  const sessionKey = { accountId: key.accountId, sessionId: key.sessionId };
  const { now } = deps;
  options.signal?.throwIfAborted();

  const release = async () => {
    try {
      // Waiting longer than a TTL is pointless: by then the lease has
      // expired anyway.
      const timeoutMs = Math.min(deps.defaultTimeoutMs, timing.ttlMs);
      await deps.release({ key: sessionKey, runId }, { timeoutMs });
    } catch (error) {
      // The lease then ends at its deadline; S5 makes a late release harmless.
      deps.onReleaseError?.(toLeaseholdError(error), sessionKey, runId);
    }
  };

  // One grant attempt: the lease, its local deadline, and whether the answer
  // arrived too late to use.
  const attempt = async (wait: number) => {
    const sentAt = now();
    const response = await deps.acquire(
      {
        key: sessionKey,
        runId,
        ttl: durationFromMs(timing.ttlMs),
        wait: wait > 0 ? durationFromMs(wait) : undefined,
        holder: options.holder ?? "",
      },
      { signal: options.signal, timeoutMs: wait + deps.defaultTimeoutMs },
    );
    const arrivedAt = now();
    if (!response.acquired || !response.lease) {
      throw notAcquired(key, response);
    }
    const deadline = localDeadline(sentAt, response.lease, timing.marginMs);
    return {
      lease: response.lease,
      deadline,
      late: arrivedAt >= deadline,
      elapsed: arrivedAt - sentAt,
    };
  };

  let grant: Awaited<ReturnType<typeof attempt>>;
  try {
    grant = await attempt(waitMs);
  } catch (error) {
    // The request may have been granted with its answer lost on the way
    // back; release by run_id (a no-op when nothing was granted) rather than
    // leave a lease nobody renews blocking the session for a whole TTL.
    if (!(error instanceof NotAcquiredError)) void release();
    throw error;
  }
  if (grant.late && waitMs > 0) {
    // A waited grant is late by construction when the wait was long: the
    // server may have granted it long after the request left. Confirm it by
    // re-acquiring with the same run_id (idempotent: same token, deadline
    // counted from this new request) instead of trusting the old answer.
    grant = await attempt(0).catch(async (error: unknown) => {
      await release();
      throw error;
    });
  }
  if (grant.late) {
    await release();
    throw new LateGrantError(grant.lease, grant.elapsed);
  }

  let lease = grant.lease;
  let deadline = grant.deadline;
  const controller = new AbortController();
  const handoffs = new HandoffRelay();

  // Set once the run can no longer vouch for its lease. From then on nothing
  // is sent for it, not even a Release (DESIGN.md §6, docs/clients.md): a
  // lease lost at its local deadline is left to expire on the server.
  let lost = false;
  const lose = (reason: LeaseLossReason, message: string, cause?: unknown) => {
    if (controller.signal.aborted) return;
    lost = true;
    controller.abort(new LeaseLostError(message, reason, { cause }));
    stopKeepingAlive();
  };

  let deadlineTimer: NodeJS.Timeout | undefined;
  const armDeadline = () => {
    clearTimeout(deadlineTimer);
    deadlineTimer = setTimeout(
      () => {
        if (now() >= deadline) {
          lose("deadline", "the local deadline passed without a confirmed renewal");
        } else {
          armDeadline();
        }
      },
      Math.max(0, deadline - now()),
    );
  };

  const registration = deps.keepAlive.register({
    key: sessionKey,
    runId,
    responseTimeoutMs: timing.renewIntervalMs,
    onRenewed: (renewed, sentAt) => {
      if (controller.signal.aborted) return;
      // L2: a confirmation that arrives after the local deadline cannot
      // revive the run: the lease may have expired and been taken meanwhile.
      if (now() >= deadline) {
        lose("deadline", "the local deadline passed before a renewal was confirmed");
        return;
      }
      lease = renewed;
      if (sentAt === undefined) return;
      const next = localDeadline(sentAt, renewed, timing.marginMs);
      if (next > deadline) {
        deadline = next;
        armDeadline();
      }
    },
    onLost: (cause) =>
      lose(
        cause ?? "renewal_failed",
        `the server reports the lease lost (${cause?.replace("_", " ") ?? "no reason given"})`,
      ),
    onHandoffRequested: (request) => handoffs.push(request),
    onFailed: (error, reason) => lose(reason, `renewals failed: ${error.message}`, error),
  });
  const renewTimer = setInterval(() => registration.renew(), timing.renewIntervalMs);
  function stopKeepingAlive() {
    clearInterval(renewTimer);
    clearTimeout(deadlineTimer);
    registration.remove();
  }
  armDeadline();

  const onCallerAbort = () => {
    if (controller.signal.aborted) return;
    controller.abort(options.signal?.reason);
    stopKeepingAlive();
  };
  options.signal?.addEventListener("abort", onCallerAbort, { once: true });

  const ctx = createLeaseContext({
    signal: controller.signal,
    fencingToken: grant.lease.fencingToken,
    key: sessionKey,
    runId,
    lease: () => lease,
    remainingMs: () => Math.max(0, deadline - now()),
    handoffs,
    // L2 by the clock, not only by the timer: the deadline timer cannot
    // fire while the event loop is busy, and a call made meanwhile would
    // present a lease that may already be gone from the database.
    checkDeadline: () => {
      if (now() >= deadline) {
        lose("deadline", "the local deadline passed without a confirmed renewal");
      }
    },
  });

  try {
    return await work(ctx);
  } finally {
    options.signal?.removeEventListener("abort", onCallerAbort);
    clearInterval(renewTimer);
    // The run's own renewal may still be on the way (the first one leaves
    // as the stream opens): released before it arrives, the lease would be
    // refused to it as "released", a loss in the server's metrics though
    // the run ended it itself. Its answer (or a stall) comes first.
    if (!controller.signal.aborted) await registration.settled();
    stopKeepingAlive();
    // L2: once the work has settled, nothing may present this lease again.
    if (!controller.signal.aborted) {
      controller.abort(new LeaseLostError("the run ended and released its lease", "released"));
    }
    if (!lost) await release();
  }
}

/**
 * Handoff requests of one run: kept, so that a listener added late still
 * hears the ones that came before it, and passed to every listener.
 */
export class HandoffRelay {
  private readonly seen: HandoffRequested[] = [];
  private readonly listeners = new Set<(request: HandoffRequested) => void>();

  push(request: HandoffRequested): void {
    this.seen.push(request);
    for (const listener of this.listeners) listener(request);
  }

  listen(listener: (request: HandoffRequested) => void): () => void {
    this.listeners.add(listener);
    for (const request of this.seen) queueMicrotask(() => listener(request));
    return () => this.listeners.delete(listener);
  }
}

/** What a LeaseContext is made of: the run's state, read through functions. */
export interface LeaseContextParts {
  signal: AbortSignal;
  fencingToken: bigint;
  key: SessionKeyInit;
  runId: string;
  lease: () => Lease;
  remainingMs: () => number;
  handoffs: HandoffRelay;
  /** Ends the run (aborts `signal`) when its local deadline has passed by the clock. */
  checkDeadline: () => void;
}

/**
 * The context `work` receives, for a lease kept alive on its own
 * (runExclusive) or on a keeper (keeper.ts): the same shape and rules.
 */
export function createLeaseContext(parts: LeaseContextParts): LeaseContext {
  const { signal } = parts;
  const ctx: LeaseContext = {
    signal,
    fencingToken: parts.fencingToken,
    key: parts.key,
    runId: parts.runId,
    get lease() {
      return parts.lease();
    },
    remainingMs: parts.remainingMs,
    onHandoffRequested: (listener) => parts.handoffs.listen(listener),
    throwIfLost: () => {
      parts.checkDeadline();
      if (signal.aborted) throw refusalOf(signal.reason);
    },
    callOptions: () => {
      ctx.throwIfLost();
      return {
        signal,
        contextValues: createContextValues().set(fencingContextKey, ctx),
      };
    },
    headers: () => fencingHeaders(ctx),
  };
  return ctx;
}
