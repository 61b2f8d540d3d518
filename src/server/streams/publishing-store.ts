// The lease store as the services use it: each write, once its statement has
// committed and answered, is handed to the change feed. Publishing therefore
// never runs inside the writing transaction (DESIGN §3), and no service can
// forget it.

import { changeFromLease } from "../../lease/lease-change.js";
import type { KeeperStore, LeaseStore } from "../../lease/types.js";
import type { ChangeFeed } from "./change-feed.js";

export function withPublishing(store: LeaseStore, feed: ChangeFeed): LeaseStore {
  return {
    ...store,
    async acquire(input) {
      const result = await store.acquire(input);
      if (!result.acquired) return result;
      if (result.retried) {
        // The same run again: no new grant, only a later deadline.
        if (feed.renewalsWanted(result.lease)) feed.emit(changeFromLease("renewed", result.lease));
        return result;
      }
      const { lease, expired } = result;
      if (expired) {
        feed.emit({
          ...changeFromLease("expired", { ...lease, ...expired, remainingUs: 0n }),
          atUs: expired.expiresAtUs,
          eventId: expired.eventId,
        });
      }
      feed.emit(changeFromLease("acquired", lease, { eventId: result.eventId }));
      return result;
    },
    async renew(key, runId, ttlMs) {
      const result = await store.renew(key, runId, ttlMs);
      if (result.held && feed.renewalsWanted(result.lease)) {
        feed.emit(changeFromLease("renewed", result.lease));
      }
      return result;
    },
    async renewMany(items, options) {
      const results = await store.renewMany(items, options);
      for (const r of results) {
        if (r.outcome === "renewed" && feed.renewalsWanted(r.lease)) {
          feed.emit(changeFromLease("renewed", r.lease));
        }
      }
      return results;
    },
    async release(key, runId, grant) {
      const ended = await store.release(key, runId, grant);
      if (ended) feed.emit(changeFromLease("released", ended, { eventId: ended.eventId }));
      return ended;
    },
    async revoke(key, reason) {
      const ended = await store.revoke(key, reason);
      if (ended) feed.emit(changeFromLease("revoked", ended, { eventId: ended.eventId, reason }));
      return ended;
    },
    async requestHandoff(key, requesterHolder, reason) {
      const result = await store.requestHandoff(key, requesterHolder, reason);
      if (result.lease) {
        feed.emit(
          changeFromLease("handoff_requested", result.lease, {
            atUs: result.atUs,
            eventId: result.eventId,
            reason,
            requesterHolder,
          }),
        );
      }
      return result;
    },
  };
}

/**
 * The keepers as the services use them: a close or a revoke of a keeper,
 * once its statements have committed, hands one change per lease it ended to
 * the change feed (RELEASED for a close, REVOKED with the reason for a
 * revoke), so that watchers, waiting acquirers and KeepAlive streams learn of
 * it then, not at the keeper's deadline.
 */
export function withKeeperPublishing(keepers: KeeperStore, feed: ChangeFeed): KeeperStore {
  return {
    ...keepers,
    async end(accountId, id, how) {
      const result = await keepers.end(accountId, id, how);
      const type = how.ended === "closed" ? "released" : "revoked";
      const reason = how.ended === "revoked" ? how.reason : "";
      for (const lease of result.leases) {
        feed.emit(changeFromLease(type, lease, { eventId: lease.eventId, reason }));
      }
      return result;
    },
  };
}
