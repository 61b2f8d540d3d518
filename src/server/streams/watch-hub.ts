// Watch: a snapshot of a scope (one session, or every session of an
// account), then every change to it, from every server instance.
//
// Changes reach a watcher from several instances over separate paths, so
// they may arrive out of order or twice (a release published by one instance
// before the grant published by another; an expiry found by this instance's
// timer and also reported by the next grant). Each watcher keeps, per key,
// the newest fencing token it has shown and whether that grant has ended,
// and drops what is older (S6: only the token orders grants). Its snapshot
// seeds that state from every stored row of the scope, tombstones included.
//
// A watcher's buffer is bounded. When a slow consumer lets it fill, the
// buffered changes are dropped and the next message is a fresh snapshot:
// the consumer loses intermediate transitions but never the current state,
// and server memory stays bounded (docs/streams.md).

import { endsLease, keyString, type LeaseChange } from "../../lease/lease-change.js";
import type { LeaseRecord, LeaseStore, Scope, SessionRow } from "../../lease/types.js";
import type { Logger } from "../../log/logger.js";
import type { ChangeFeed } from "./change-feed.js";
import type { ExpiryTracker } from "./expiry-tracker.js";
import { createSliceScheduler, type Outlet } from "./outlet.js";

export type WatchMessage =
  | { kind: "snapshot"; leases: LeaseRecord[]; atUs: bigint }
  | { kind: "change"; change: LeaseChange };

export interface Watcher {
  /**
   * The one way to read a watcher: its messages go to `outlet` — a snapshot
   * first, then the changes, and a fresh snapshot whenever one is due (the
   * buffer overflowed while the consumer did not read, a missed change was
   * found) — until the hub closes (the outlet ends with its reason) or a
   * snapshot cannot be read (with that error). Writes are paced by the hub:
   * the watchers of one change are served in slices, with a turn of the
   * event loop between them. Called once.
   */
  pipe(outlet: Outlet<WatchMessage>): void;
  /** The call ended (its client left, a deadline, its token expired): stops without a word to the outlet. */
  close(): void;
}

export interface WatchHub {
  open(scope: Scope, options: { includeRenewals: boolean }): Watcher;
  readonly stats: { watchers: number; overflows: number; resnapshots: number };
  start(): void;
  /** Ends every watcher with `reason` (the server is shutting down). */
  close(reason: unknown): void;
}

export interface WatchHubOptions {
  store: LeaseStore;
  feed: ChangeFeed;
  tracker: ExpiryTracker;
  logger: Logger;
  /** Changes buffered per watcher before it is sent a fresh snapshot instead. */
  bufferLength: number;
  /** How often every watched scope is compared with the database. */
  recheckIntervalMs: number;
  /** How long a difference found by the re-check may take to arrive as a change. */
  recheckGraceMs?: number;
  /** Watchers written to before the fan-out lets the event loop turn (default 256). */
  watchersPerTurn?: number;
}

interface KeyState {
  token: bigint;
  ended: boolean;
  /** Newest handoff request shown for this grant (audit id), to drop repeats. */
  handoffId?: bigint;
}

/**
 * The per-key order guard described at the top of this file: remembers the
 * newest grant shown per key and whether it ended, and refuses what is older.
 */
export class OrderGuard {
  private state = new Map<string, KeyState>();

  /** Starts over from a reading of every stored row in scope. */
  seed(
    rows: readonly { accountId: string; sessionId: string; fencingToken: bigint; valid: boolean }[],
  ) {
    this.state = new Map(
      rows.map((r) => [keyString(r), { token: r.fencingToken, ended: !r.valid }]),
    );
  }

  /** True when the change is news to the watcher (and records it). */
  accept(change: LeaseChange): boolean {
    const k = changeKey(change);
    const known = this.state.get(k);
    const t = change.fencingToken;
    const newer = !known || t > known.token;
    const sameLive = known !== undefined && t === known.token && !known.ended;
    if (change.type === "acquired") {
      if (!newer) return false;
      this.state.set(k, { token: t, ended: false });
      return true;
    }
    if (endsLease(change.type)) {
      if (!newer && !sameLive) return false;
      this.state.set(k, { token: t, ended: true });
      return true;
    }
    // renewed, handoff_requested: about a live grant.
    if (!newer && !sameLive) return false;
    const state = newer ? { token: t, ended: false } : (known as KeyState);
    if (change.type === "handoff_requested") {
      if (state.handoffId !== undefined && change.eventId <= state.handoffId) return false;
      state.handoffId = change.eventId;
    }
    this.state.set(k, state);
    return true;
  }

  /** Whether what was shown accounts for a row read earlier; `key` is its keyString when known. */
  covers(
    row: { accountId: string; sessionId: string; fencingToken: bigint; valid: boolean },
    key = keyString(row),
  ) {
    const known = this.state.get(key);
    if (!known) return false;
    if (known.token !== row.fencingToken) return known.token > row.fencingToken;
    return row.valid || known.ended;
  }
}

// A change is offered to every watcher of its scope one after the other:
// its key is made once, not once per watcher.
let lastChange: LeaseChange | undefined;
let lastChangeKey = "";
function changeKey(change: LeaseChange): string {
  if (change !== lastChange) {
    lastChange = change;
    lastChangeKey = keyString(change);
  }
  return lastChangeKey;
}

class WatcherImpl implements Watcher {
  queue: LeaseChange[] = [];
  needsSnapshot = true;
  readonly guard = new OrderGuard();
  private outlet: Outlet<WatchMessage> | undefined;
  /** A snapshot is being read. */
  private busy = false;
  /** The outlet's last write returned false: wait for its drain. */
  private blocked = false;
  /** Set when the hub closed the watcher before it was piped. */
  private closedWith: { reason: unknown } | undefined;
  closed = false;
  private readonly flushBound = () => this.flush();

  constructor(
    readonly scope: Scope,
    readonly includeRenewals: boolean,
    private readonly hub: {
      bufferLength: number;
      read(scope: Scope): Promise<{ rows: SessionRow[]; observedAtUs: bigint }>;
      schedule(work: () => void): void;
      detach(w: WatcherImpl): void;
      overflowed(): void;
      resnapshotted(): void;
    },
  ) {}

  offer(change: LeaseChange) {
    if (this.closed) return;
    if (change.type === "renewed" && !this.includeRenewals) return;
    if (this.needsSnapshot) {
      // A snapshot is due; it will show this committed change.
      this.ready();
      return;
    }
    if (this.queue.length >= this.hub.bufferLength) {
      this.queue = [];
      this.needsSnapshot = true;
      this.hub.overflowed();
    } else {
      this.queue.push(change);
    }
    this.ready();
  }

  resnapshot() {
    if (this.closed) return;
    this.needsSnapshot = true;
    this.queue = [];
    this.ready();
  }

  private ready() {
    if (this.outlet && !this.closed) this.hub.schedule(this.flushBound);
  }

  pipe(outlet: Outlet<WatchMessage>) {
    if (this.outlet) throw new Error("a watcher is piped once");
    this.outlet = outlet;
    if (this.closedWith) outlet.end(this.closedWith.reason);
    else this.ready();
  }

  private flush() {
    const outlet = this.outlet;
    if (!outlet || this.busy || this.blocked || this.closed) return;
    if (this.needsSnapshot) {
      this.busy = true;
      this.snapshot().then(
        (message) => {
          this.busy = false;
          this.write(outlet, [message]);
          // Changes that arrived while the snapshot was read follow it.
          this.ready();
        },
        (error: unknown) => {
          this.busy = false;
          this.finish(error);
        },
      );
      return;
    }
    const messages: WatchMessage[] = [];
    for (const change of this.queue) {
      if (this.guard.accept(change)) messages.push({ kind: "change", change });
    }
    this.queue = [];
    this.write(outlet, messages);
  }

  private write(outlet: Outlet<WatchMessage>, messages: WatchMessage[]) {
    if (messages.length === 0 || this.closed) return;
    if (!outlet.write(messages)) {
      this.blocked = true;
      outlet.onDrain(() => {
        this.blocked = false;
        this.ready();
      });
    }
  }

  private async snapshot(): Promise<WatchMessage> {
    this.needsSnapshot = false;
    this.queue = [];
    const reading = await this.hub.read(this.scope);
    this.guard.seed(reading.rows);
    this.hub.resnapshotted();
    return {
      kind: "snapshot",
      leases: reading.rows.filter((r) => r.valid).map(toLease),
      atUs: reading.observedAtUs,
    };
  }

  /** Ends the stream: the watcher is closed, then the outlet told. */
  private finish(error: unknown) {
    if (this.closed) return;
    const outlet = this.outlet;
    this.close();
    outlet?.end(error);
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
    this.queue = [];
    this.hub.detach(this);
  }
}

function toLease(row: SessionRow): LeaseRecord {
  return {
    accountId: row.accountId,
    sessionId: row.sessionId,
    runId: row.runId,
    fencingToken: row.fencingToken,
    holder: row.holder,
    ttlMs: row.ttlMs,
    acquiredAtUs: row.acquiredAtUs,
    expiresAtUs: row.expiresAtUs,
    remainingUs: row.remainingUs,
    ...(row.keeperId ? { keeperId: row.keeperId } : {}),
  };
}

export function createWatchHub(options: WatchHubOptions): WatchHub {
  const { store, feed, tracker, logger } = options;
  const graceMs = options.recheckGraceMs ?? Math.min(2_000, options.recheckIntervalMs);
  const byKey = new Map<string, Set<WatcherImpl>>();
  const byAccount = new Map<string, Set<WatcherImpl>>();
  const releases = new Map<WatcherImpl, (() => void)[]>();
  const stats = { watchers: 0, overflows: 0, resnapshots: 0 };
  const stops: (() => void)[] = [];
  let recheckTimer: NodeJS.Timeout | undefined;

  const indexOf = (scope: Scope) =>
    scope.sessionId === ""
      ? { map: byAccount, k: scope.accountId }
      : { map: byKey, k: keyString(scope) };

  function* watchersOf(key: Scope): Generator<WatcherImpl> {
    const exact = byKey.get(keyString(key));
    if (exact) yield* exact;
    const account = byAccount.get(key.accountId);
    if (account) yield* account;
  }

  const hubForWatchers = {
    bufferLength: options.bufferLength,
    // One change reaches every watcher of its scope in the same turn:
    // thousands of writes at once would stall the event loop.
    schedule: createSliceScheduler(options.watchersPerTurn ?? 256),
    read: async (scope: Scope) => {
      const reading = await store.readScopes([scope]);
      tracker.observe(reading);
      return reading;
    },
    detach(w: WatcherImpl) {
      const { map, k } = indexOf(w.scope);
      const set = map.get(k);
      set?.delete(w);
      if (set?.size === 0) map.delete(k);
      for (const release of releases.get(w) ?? []) release();
      releases.delete(w);
      stats.watchers -= 1;
    },
    overflowed: () => {
      stats.overflows += 1;
    },
    resnapshotted: () => {
      stats.resnapshots += 1;
    },
  };

  // Rows compared by the re-check before it lets the event loop turn.
  const recheckSlice = 10_000;

  // Slow safety net for changes whose notification was lost (an instance
  // that died between commit and publish): read every watched scope, give
  // in-flight changes `graceMs` to arrive, then send a fresh snapshot to
  // each watcher whose view does not account for what was read.
  async function recheck() {
    const watchers = [...releases.keys()];
    if (watchers.length === 0) return;
    const scopes = new Map<string, Scope>();
    for (const w of watchers) scopes.set(keyString(w.scope), w.scope);
    let rows: SessionRow[];
    try {
      rows = (await store.readScopes([...scopes.values()])).rows;
    } catch (error) {
      logger.warn({ err: error }, "watch re-check could not read the database");
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, graceMs).unref());
    // Every watcher is compared with every row of its scope: with thousands
    // of watchers of one account that is millions of lookups, so each row's
    // key is made once per scope, and the watchers are gone through in
    // slices with a turn of the event loop between them. In one pass, 1,000
    // watchers of an account with 143 rows held the event loop for 62 ms.
    const rowsOf = new Map<string, { row: SessionRow; key: string }[]>();
    for (const [k, scope] of scopes) {
      rowsOf.set(
        k,
        rows
          .filter(
            (r) =>
              r.accountId === scope.accountId &&
              (scope.sessionId === "" || r.sessionId === scope.sessionId),
          )
          .map((row) => ({ row, key: keyString(row) })),
      );
    }
    let compared = 0;
    for (const w of watchers) {
      if (w.closed || w.needsSnapshot) continue;
      const inScope = rowsOf.get(keyString(w.scope)) ?? [];
      if (inScope.some(({ row, key }) => !w.guard.covers(row, key))) {
        logger.info({ scope: w.scope }, "watch re-check found a missed change; sending a snapshot");
        w.resnapshot();
      }
      compared += inScope.length + 1;
      if (compared >= recheckSlice) {
        compared = 0;
        await new Promise((resolve) => setImmediate(resolve));
      }
    }
  }

  return {
    stats,
    open(scope, { includeRenewals }) {
      const w = new WatcherImpl(scope, includeRenewals, hubForWatchers);
      const { map, k } = indexOf(scope);
      let set = map.get(k);
      if (!set) {
        set = new Set();
        map.set(k, set);
      }
      set.add(w);
      const held = [tracker.hold(scope)];
      if (includeRenewals) held.push(feed.wantRenewals(scope));
      releases.set(w, held);
      stats.watchers += 1;
      return w;
    },
    start() {
      stops.push(
        feed.subscribe((change) => {
          for (const w of watchersOf(change)) w.offer(change);
        }),
        feed.onResync(() => {
          for (const w of releases.keys()) w.resnapshot();
        }),
        tracker.onStale((key) => {
          for (const w of watchersOf(key)) w.resnapshot();
        }),
      );
      recheckTimer = setInterval(() => void recheck(), options.recheckIntervalMs);
      recheckTimer.unref();
    },
    close(reason) {
      if (recheckTimer) clearInterval(recheckTimer);
      for (const stop of stops) stop();
      for (const w of [...releases.keys()]) w.end(reason);
    },
  };
}
