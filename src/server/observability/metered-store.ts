// The lease store with its outcomes counted for /metrics: a decorator, so
// the store itself stays free of instrumentation.

import { ResourceExhaustedError } from "../../lease/errors.js";
import type { LeaseStore } from "../../lease/types.js";
import type { LeaseMetrics } from "./metrics.js";

export function withMetrics(store: LeaseStore, metrics: LeaseMetrics): LeaseStore {
  const inFlight = async <T>(work: () => Promise<T>): Promise<T> => {
    metrics.queriesInFlight.inc();
    try {
      return await work();
    } finally {
      metrics.queriesInFlight.dec();
    }
  };
  return {
    ...store,
    acquire: (input) =>
      inFlight(async () => {
        let result: Awaited<ReturnType<LeaseStore["acquire"]>>;
        try {
          result = await store.acquire(input);
        } catch (error) {
          if (error instanceof ResourceExhaustedError) metrics.quotaRejections.inc();
          throw error;
        }
        if (result.acquired && !result.retried) {
          metrics.grants.inc();
          // The store names the expired lease a takeover replaced, when it knows.
          if ((result as { expired?: unknown }).expired) metrics.expiries.inc();
        }
        return result;
      }),
    renew: (key, runId, ttlMs) =>
      inFlight(async () => {
        const result = await store.renew(key, runId, ttlMs);
        if (result.held) metrics.renewals.inc();
        // A run that never held the session lost nothing.
        else if (result.cause !== "never_held") metrics.lost(result.cause);
        return result;
      }),
    renewMany: (items, options) =>
      inFlight(async () => {
        const results = await store.renewMany(items, options);
        for (const r of results) {
          if (r.outcome === "renewed") metrics.renewals.inc();
          else if (r.outcome === "lost") metrics.lost(r.cause);
        }
        return results;
      }),
    release: (key, runId, grant) =>
      inFlight(async () => {
        const ended = await store.release(key, runId, grant);
        if (ended) metrics.releases.inc();
        return ended;
      }),
    revoke: (key, reason) =>
      inFlight(async () => {
        const ended = await store.revoke(key, reason);
        if (ended) metrics.revocations.inc();
        return ended;
      }),
    get: (key) => inFlight(() => store.get(key)),
    list: (accountId, limit, after) => inFlight(() => store.list(accountId, limit, after)),
  };
}
