// The in-process side of lease changes: every committed change made by this
// instance is delivered here at once and handed to the notifier for the
// others; changes from other instances arrive through the notifier. Watchers,
// waiters and KeepAlive streams subscribe here and never see the difference.
//
// RENEWED changes are the exception: thousands per second, wanted by few.
// An instance publishes a renewal only for scopes that some instance has
// announced interest in (a Watch with include_renewals), so the batched
// renewal path stays free of notifications when nobody asked.

import { keyString, type LeaseChange } from "../../lease/lease-change.js";
import type { Scope } from "../../lease/types.js";
import type { Logger } from "../../log/logger.js";
import { outsideCalls } from "../observability/call-trace.js";
import type { Notifier } from "./notifier.js";
import type { NotifierMessage } from "./notify-codec.js";

export type ChangeListener = (change: LeaseChange) => void;

export interface ChangeFeed {
  /** A change this instance committed: delivered here now, published to the others. */
  emit(change: LeaseChange): void;
  /** A change this instance established itself (a confirmed expiry): delivered here only. */
  deliverLocal(change: LeaseChange): void;
  subscribe(listener: ChangeListener): () => void;
  /**
   * Called when changes may have been missed (the notification connection
   * came back): every receiver must re-read the state it depends on.
   */
  onResync(listener: () => void): () => void;
  /** Asks every instance for RENEWED changes of a scope, until the returned function is called. */
  wantRenewals(scope: Scope): () => void;
  /** False when no instance watches renewals of this key: the caller may skip building the change. */
  renewalsWanted(key: Scope): boolean;
  /** True while changes from other instances are flowing (or notifications are off). */
  readonly connected: boolean;
  start(): Promise<void>;
  close(): Promise<void>;
}

export interface ChangeFeedOptions {
  /** Undefined runs without notifications: this instance only sees its own changes. */
  notifier: Notifier | undefined;
  logger: Logger;
  /** How often renewal interest is announced again; it lapses after three periods. */
  interestRefreshMs?: number;
  /** Sees every change that arrives from another instance, before delivery. */
  onRemoteChange?: (change: LeaseChange) => void;
}

export function createChangeFeed(options: ChangeFeedOptions): ChangeFeed {
  const { notifier, logger } = options;
  const refreshMs = options.interestRefreshMs ?? 10_000;
  const listeners = new Set<ChangeListener>();
  const resyncListeners = new Set<() => void>();
  // Local interest: scope key → number of local watchers wanting renewals.
  const localInterest = new Map<string, { scope: Scope; count: number }>();
  // Remote interest: scope key → instance → monotonic time it lapses.
  const remoteInterest = new Map<string, Map<string, number>>();
  let refreshTimer: NodeJS.Timeout | undefined;
  let connected = notifier === undefined;
  let started = false;

  const scopeKey = (s: Scope) => keyString(s);

  // Listeners run outside the call that committed the change: what it wakes
  // (another call's waiting Acquire) is not part of that call's trace.
  function deliver(change: LeaseChange) {
    outsideCalls(deliverNow, change);
  }

  function deliverNow(change: LeaseChange) {
    for (const listener of listeners) {
      try {
        listener(change);
      } catch (error) {
        logger.error({ err: error, type: change.type }, "a change listener failed");
      }
    }
  }

  function wantedLocally(key: Scope): boolean {
    if (localInterest.size === 0) return false;
    return (
      localInterest.has(scopeKey(key)) ||
      localInterest.has(scopeKey({ accountId: key.accountId, sessionId: "" }))
    );
  }

  function wantedRemotely(key: Scope): boolean {
    if (remoteInterest.size === 0) return false;
    const now = performance.now();
    for (const k of [scopeKey(key), scopeKey({ accountId: key.accountId, sessionId: "" })]) {
      const byInstance = remoteInterest.get(k);
      if (!byInstance) continue;
      for (const [instance, until] of byInstance) {
        if (until > now) return true;
        byInstance.delete(instance);
      }
      if (byInstance.size === 0) remoteInterest.delete(k);
    }
    return false;
  }

  // Interest of an instance that stopped announcing (it died) lapses.
  function sweepInterest() {
    const now = performance.now();
    for (const [k, byInstance] of remoteInterest) {
      for (const [instance, until] of byInstance) if (until <= now) byInstance.delete(instance);
      if (byInstance.size === 0) remoteInterest.delete(k);
    }
  }

  function announceInterest() {
    if (!notifier || localInterest.size === 0) return;
    notifier.announce({
      kind: "interest",
      source: "",
      scopes: [...localInterest.values()].map((i) => i.scope),
      forMs: refreshMs * 3,
    });
  }

  function onMessage(message: NotifierMessage) {
    switch (message.kind) {
      case "changes":
        for (const change of message.changes) {
          options.onRemoteChange?.(change);
          deliver(change);
        }
        return;
      case "interest": {
        const until = performance.now() + message.forMs;
        for (const scope of message.scopes) {
          const k = scopeKey(scope);
          let byInstance = remoteInterest.get(k);
          if (!byInstance) {
            byInstance = new Map();
            remoteInterest.set(k, byInstance);
          }
          byInstance.set(message.source, until);
        }
        return;
      }
      case "hello":
        announceInterest();
        return;
      case "ping":
        return;
    }
  }

  function resync() {
    for (const listener of resyncListeners) {
      try {
        listener();
      } catch (error) {
        logger.error({ err: error }, "a resync listener failed");
      }
    }
  }

  return {
    get connected() {
      return connected;
    },
    emit(change) {
      if (change.type === "renewed") {
        if (wantedLocally(change)) deliver(change);
        if (wantedRemotely(change)) notifier?.publish(change);
        return;
      }
      deliver(change);
      notifier?.publish(change);
    },
    deliverLocal: deliver,
    subscribe(listener) {
      listeners.add(listener);
      return () => listeners.delete(listener);
    },
    onResync(listener) {
      resyncListeners.add(listener);
      return () => resyncListeners.delete(listener);
    },
    wantRenewals(scope) {
      const k = scopeKey(scope);
      const entry = localInterest.get(k);
      if (entry) entry.count += 1;
      else {
        localInterest.set(k, { scope, count: 1 });
        notifier?.announce({ kind: "interest", source: "", scopes: [scope], forMs: refreshMs * 3 });
      }
      let done = false;
      return () => {
        if (done) return;
        done = true;
        const current = localInterest.get(k);
        if (!current) return;
        current.count -= 1;
        // The others stop publishing when the announcement lapses.
        if (current.count === 0) localInterest.delete(k);
      };
    },
    renewalsWanted(key) {
      return wantedLocally(key) || wantedRemotely(key);
    },
    async start() {
      if (!notifier || started) return;
      started = true;
      await notifier.start({
        onMessage,
        // Called at the first LISTEN and after every reconnection. Others
        // then tell us what they watch, and every receiver re-reads what it
        // depends on: changes made while nobody listened are gone.
        onListening: () => {
          connected = true;
          notifier.announce({ kind: "hello", source: "" });
          announceInterest();
          resync();
        },
        onConnectionLost: () => {
          connected = false;
        },
      });
      refreshTimer = setInterval(() => {
        sweepInterest();
        announceInterest();
      }, refreshMs);
      refreshTimer.unref();
    },
    async close() {
      if (refreshTimer) clearInterval(refreshTimer);
      await notifier?.close();
      listeners.clear();
      resyncListeners.clear();
    },
  };
}
