// KeepAlive streams: one stream carries renewals of many leases. Every
// request is answered with the renewed lease, `lost` or `undecided`, in the
// order the renewals are decided (the key and run in each answer say which
// request it answers). A run answered `lost` is never renewed again on that stream:
// later requests for it are answered `lost` without touching the database.
//
// The stream also carries what concerns its leases as it happens: a handoff
// request for a run it renews, and `lost` as soon as this instance learns
// that the run's lease was released, revoked or taken over.
//
// A renewal the database does not decide (its row stays locked by another
// transaction past lock_timeout, or its batch statement timed out) is
// answered `undecided`, its lease unchanged; its neighbours are answered as
// usual, and the stream goes on. Left unanswered, it looked to a client like
// a stalled connection, and every client of a slow database reconnected.
//
// A client that stops reading must not stall anything else. Renewals are
// decided by the shared batcher whatever a stream's consumer does, and each
// stream's undelivered answers are bounded: past the bound the stream ends
// with RESOURCE_EXHAUSTED. Closing a stream releases nothing: its leases run
// to their deadlines unless renewed elsewhere or released.

import { ResourceExhaustedError } from "../../lease/errors.js";
import { keyString, type LeaseChange, runKey } from "../../lease/lease-change.js";
import type { LeaseRecord, SessionKey } from "../../lease/types.js";
import { LimitName, type LossCause } from "../../protocol/errors.js";
import type { ChangeFeed } from "./change-feed.js";
import type { Outlet } from "./outlet.js";
import { type RenewalBatcher, RenewalUndecidedError } from "./renewal-batcher.js";
import { createStreamLeases, type StreamLeases } from "./stream-limits.js";

export type KeepAliveAnswer =
  | { kind: "lease"; lease: LeaseRecord }
  | { kind: "lost"; key: SessionKey; runId: string; cause: LossCause }
  | {
      kind: "handoff";
      key: SessionKey;
      runId: string;
      requesterHolder: string;
      reason: string;
      atUs: bigint;
    }
  | { kind: "undecided"; key: SessionKey; runId: string; error: RenewalUndecidedError };

export interface KeepAliveRequest {
  key: SessionKey;
  runId: string;
  ttlMs: number | undefined;
}

export interface KeepAliveSession {
  submit(request: KeepAliveRequest): void;
  /** The client sent its last request: end after the outstanding answers. */
  endRequests(): void;
  /** Ends the stream with this error. */
  fail(error: unknown): void;
  /**
   * The one way to read the stream: its answers go to `outlet` as they are
   * decided (those of one renewal batch in one write), until the stream
   * ends. It ends OK once the requests ended and every one is answered and
   * written; with its error when it fails (its undelivered answers dropped;
   * told when the consumer has room); with the hub's reason when the hub
   * closes (at once). Called once.
   */
  pipe(outlet: Outlet<KeepAliveAnswer>): void;
  /** The call ended (its client left, a deadline, its token expired): stops without a word to the outlet. */
  close(): void;
}

export interface KeepAliveHub {
  open(): KeepAliveSession;
  readonly stats: { streams: number; overflows: number };
  start(): void;
  /** Ends every stream with `reason` (the server is shutting down). */
  close(reason: unknown): void;
}

export interface KeepAliveOptions {
  batcher: RenewalBatcher;
  feed: ChangeFeed;
  /** Distinct leases one stream may renew. */
  maxLeasesPerStream: number;
  /** Answers (and renewals in flight) one stream may have undelivered. */
  maxPendingAnswers: number;
}

interface Run {
  key: SessionKey;
  runId: string;
  token: bigint;
}

// Answers handed to the outlet per write.
const answersPerWrite = 512;

class Session implements KeepAliveSession {
  private queue: KeepAliveAnswer[] = [];
  private inFlight = 0;
  private requestsEnded = false;
  private failure: { error: unknown } | undefined;
  private outlet: Outlet<KeepAliveAnswer> | undefined;
  /** The outlet's last write returned false: wait for its drain. */
  private blocked = false;
  private flushScheduled = false;
  /** Set when the hub closed the stream before it was piped. */
  private closedWith: { reason: unknown } | undefined;
  private closed = false;
  /** Runs this stream renews, by key and run. */
  readonly runs = new Map<string, Run>();
  /** Runs answered `lost`, with the cause, in insertion order (bounded). */
  private readonly lost = new Map<string, LossCause>();
  /** The distinct leases this stream carries, against --max-leases-per-stream. */
  private readonly leases: StreamLeases;

  constructor(
    private readonly options: KeepAliveOptions,
    private readonly registry: {
      register(keyString: string, s: Session): void;
      unregister(keyString: string, s: Session): void;
      overflowed(): void;
      closed(s: Session): void;
    },
  ) {
    this.leases = createStreamLeases(options.maxLeasesPerStream);
  }

  submit(request: KeepAliveRequest) {
    if (this.closed || this.failure) return;
    const rk = runKey(request.key, request.runId);
    const cause = this.lost.get(rk);
    if (cause) {
      this.push({ kind: "lost", key: request.key, runId: request.runId, cause });
      return;
    }
    const first = !this.runs.has(rk);
    try {
      this.leases.add(rk);
    } catch (error) {
      this.fail(error);
      return;
    }
    if (!this.hasRoom()) return;
    this.inFlight += 1;
    this.options.batcher.submit(
      {
        accountId: request.key.accountId,
        sessionId: request.key.sessionId,
        runId: request.runId,
        ttlMs: request.ttlMs,
        // A handoff requested before this stream renewed the run (or while
        // the client was moving to this instance) is delivered now.
        lookupHandoff: first,
      },
      rk,
      (error, outcome) => {
        this.inFlight -= 1;
        // The database unreachable: the stream ends, so that the client
        // moves to another instance.
        if (!outcome && !(error instanceof RenewalUndecidedError)) {
          this.fail(error);
          return;
        }
        if (this.closed) return;
        const lostMeanwhile = this.lost.get(rk);
        if (lostMeanwhile) {
          this.push({ kind: "lost", key: request.key, runId: request.runId, cause: lostMeanwhile });
        } else if (!outcome) {
          // Not decided (its row stayed locked, or its batch statement timed
          // out): answered so, the lease unchanged; the stream and its other
          // leases go on. The client's next renewal tries again; its local
          // deadline covers a database that stays slow (L2).
          this.push({
            kind: "undecided",
            key: request.key,
            runId: request.runId,
            error: error as RenewalUndecidedError,
          });
        } else if (outcome.renewed) {
          this.track(rk, request, outcome.lease.fencingToken);
          this.push({ kind: "lease", lease: outcome.lease });
          if (outcome.handoff) {
            this.push({
              kind: "handoff",
              key: request.key,
              runId: request.runId,
              requesterHolder: outcome.handoff.requesterHolder,
              reason: outcome.handoff.reason,
              atUs: outcome.handoff.atUs,
            });
          }
        } else {
          this.markLost(rk, request.key, request.runId, outcome.cause);
        }
        this.notify();
      },
    );
  }

  /** A change to a key this stream renews, from any instance. */
  onChange(change: LeaseChange) {
    for (const [rk, run] of this.runs) {
      if (run.key.accountId !== change.accountId || run.key.sessionId !== change.sessionId) {
        continue;
      }
      const same = run.runId === change.runId && run.token === change.fencingToken;
      if (change.type === "handoff_requested" && same) {
        this.push({
          kind: "handoff",
          key: run.key,
          runId: run.runId,
          requesterHolder: change.requesterHolder,
          reason: change.reason,
          atUs: change.atUs,
        });
      } else if (
        same &&
        (change.type === "released" || change.type === "revoked" || change.type === "expired")
      ) {
        this.markLost(rk, run.key, run.runId, change.type);
      } else if (change.type === "acquired" && change.fencingToken > run.token) {
        this.markLost(rk, run.key, run.runId, "taken_over");
      }
    }
  }

  private track(rk: string, request: KeepAliveRequest, token: bigint) {
    const existing = this.runs.get(rk);
    if (existing) {
      existing.token = token;
      return;
    }
    this.runs.set(rk, { key: request.key, runId: request.runId, token });
    this.registry.register(keyString(request.key), this);
  }

  private markLost(rk: string, key: SessionKey, runId: string, cause: LossCause) {
    if (this.lost.has(rk)) return;
    this.leases.delete(rk);
    if (this.runs.delete(rk)) {
      const k = keyString(key);
      if (![...this.runs.values()].some((r) => keyString(r.key) === k)) {
        this.registry.unregister(k, this);
      }
    }
    this.lost.set(rk, cause);
    // Bounded memory: forget the oldest losses. A forgotten run that asks
    // again is answered by the database, which refuses it all the same (S4).
    if (this.lost.size > this.options.maxLeasesPerStream) {
      const oldest = this.lost.keys().next().value;
      if (oldest !== undefined) this.lost.delete(oldest);
    }
    this.push({ kind: "lost", key, runId, cause });
  }

  private hasRoom(): boolean {
    if (this.queue.length + this.inFlight < this.options.maxPendingAnswers) return true;
    this.registry.overflowed();
    this.fail(
      new ResourceExhaustedError(
        `the KeepAlive stream has ${this.options.maxPendingAnswers} answers its client has not read; it is closed so that it holds no more server memory`,
        LimitName.streamBacklog,
        this.options.maxPendingAnswers,
      ),
    );
    return false;
  }

  private push(answer: KeepAliveAnswer) {
    if (this.closed || this.failure) return;
    if (!this.hasRoom()) return;
    this.queue.push(answer);
    this.notify();
  }

  private notify() {
    if (!this.outlet || this.flushScheduled || this.closed) return;
    // Every answer of one renewal batch arrives in the same turn: one flush
    // takes them all, so a stream writes them at once.
    this.flushScheduled = true;
    queueMicrotask(() => {
      this.flushScheduled = false;
      this.flush();
    });
  }

  pipe(outlet: Outlet<KeepAliveAnswer>) {
    if (this.outlet) throw new Error("a KeepAlive session is piped once");
    this.outlet = outlet;
    if (this.closedWith) outlet.end(this.closedWith.reason);
    else this.notify();
  }

  private flush() {
    const outlet = this.outlet;
    if (!outlet) return;
    while (!this.blocked && !this.closed) {
      // A failure is told once the consumer reads again: its answers were
      // dropped, and ending the call now would stop reading requests the
      // client already sent.
      if (this.failure) {
        this.finish(this.failure.error);
        return;
      }
      const all = this.queue.length <= answersPerWrite;
      const answers = all ? this.queue : this.queue.slice(0, answersPerWrite);
      this.queue = all ? [] : this.queue.slice(answersPerWrite);
      if (answers.length > 0 && !outlet.write(answers)) {
        this.blocked = true;
        outlet.onDrain(() => {
          this.blocked = false;
          this.flush();
        });
      }
      if (this.requestsEnded && this.inFlight === 0 && this.queue.length === 0) {
        this.finish();
        return;
      }
      if (answers.length < answersPerWrite) return;
    }
  }

  /** Ends the stream: the session is closed, then the outlet told. */
  private finish(error?: unknown) {
    const outlet = this.outlet;
    this.close();
    outlet?.end(error);
  }

  endRequests() {
    this.requestsEnded = true;
    this.notify();
  }

  fail(error: unknown) {
    if (this.failure || this.closed) return;
    this.failure = { error };
    this.queue = [];
    this.notify();
  }

  /** The hub closes: the stream ends with `reason`, now or when it is piped. */
  end(reason: unknown) {
    if (this.closed) return;
    if (this.outlet) {
      this.finish(reason);
      return;
    }
    this.closedWith = { reason };
    this.close();
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    for (const k of new Set([...this.runs.values()].map((r) => keyString(r.key)))) {
      this.registry.unregister(k, this);
    }
    this.runs.clear();
    this.queue = [];
    this.registry.closed(this);
  }
}

export function createKeepAliveHub(options: KeepAliveOptions): KeepAliveHub {
  const byKey = new Map<string, Set<Session>>();
  const stats = { streams: 0, overflows: 0 };
  let unsubscribe: (() => void) | undefined;
  const registry = {
    register(k: string, s: Session) {
      let set = byKey.get(k);
      if (!set) {
        set = new Set();
        byKey.set(k, set);
      }
      set.add(s);
    },
    unregister(k: string, s: Session) {
      const set = byKey.get(k);
      set?.delete(s);
      if (set?.size === 0) byKey.delete(k);
    },
    overflowed() {
      stats.overflows += 1;
    },
    closed(s: Session) {
      if (sessions.delete(s)) stats.streams -= 1;
    },
  };
  const sessions = new Set<Session>();
  return {
    stats,
    open() {
      const s = new Session(options, registry);
      sessions.add(s);
      stats.streams += 1;
      return s;
    },
    start() {
      unsubscribe = options.feed.subscribe((change) => {
        if (change.type === "renewed") return;
        const set = byKey.get(keyString(change));
        if (set) for (const s of [...set]) s.onChange(change);
      });
    },
    close(reason) {
      unsubscribe?.();
      for (const s of [...sessions]) s.end(reason);
    },
  };
}
