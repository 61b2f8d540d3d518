// S6 under churn: many runs on independent connections acquire, renew,
// release, abandon (let expire) and retry on a few keys. Every grant is
// recorded; per key, tokens must strictly increase in the order of the
// database's grant times, and no token may be issued twice. It includes the
// race the tombstones exist for: a release followed at once by a re-acquire,
// racing fresh acquirers of the same key.

import { randomUUID } from "node:crypto";
import { describe, expect, it } from "vitest";
import { LeaseNotHeldError } from "../../src/lease/errors.js";
import type { LeaseStore, SessionKey } from "../../src/lease/types.js";
import type { Sql } from "../../src/postgres/pool.js";
import { createLeaseStore } from "../../src/server/db/lease-store.js";
import { useTestDatabase } from "../support/fixture.js";
import { freshKey } from "../support/leases.js";
import { waitFor } from "../support/wait.js";

const { db } = useTestDatabase();

interface Grant {
  session: string;
  runId: string;
  token: bigint;
  /** The database's grant time (acquired_at), µs. */
  atUs: bigint;
  /** When the grant stopped being valid: its deadline, or its release time. */
  endUs: bigint;
  ended: "expired" | "released";
  how: "acquire" | "reacquire-after-release" | "race-fresh" | "race-reacquire";
}

interface Runner {
  sql: Sql;
  store: LeaseStore;
}

const runner = (): Runner => {
  const sql = db.connect(1);
  return { sql, store: createLeaseStore(sql) };
};

const pick = <T>(items: readonly T[]): T => items[Math.floor(Math.random() * items.length)] as T;

/** Sleeps on the database clock until the given instant (µs since the epoch). */
async function sleepUntil(sql: Sql, us: bigint): Promise<void> {
  await sql`SELECT pg_sleep_until(to_timestamp(${us.toString()}::numeric / 1000000))`;
}

describe("S6 monotonic fencing under churn", () => {
  it("S1, S6: concurrent acquire/renew/release/expiry/retry and release-then-reacquire racing fresh acquirers: per key, tokens strictly increase in grant-time order and none is issued twice", async () => {
    const keys = [freshKey("churn"), freshKey("churn"), freshKey("churn")];
    const grants: Grant[] = [];
    const retries: { original: bigint; again: bigint }[] = [];

    // Part 1: sixteen runs churning on three keys.
    const runners = Array.from({ length: 16 }, runner);
    await Promise.all(runners.map((r) => r.store.get(keys[0] as SessionKey)));
    await Promise.all(
      runners.map(async ({ sql, store }) => {
        for (let n = 0; n < 30; n++) {
          const key = pick(keys);
          const runId = randomUUID();
          const ttlMs = pick([40, 80, 120]);
          const r = await store.acquire({ ...key, runId, ttlMs, holder: "churn" });
          if (!r.acquired) {
            // Wake exactly at the holder's deadline, with everyone else
            // waiting on it: expiry takeovers race each other.
            if (r.current) await sleepUntil(sql, r.current.expiresAtUs);
            continue;
          }
          const grant: Grant = {
            session: key.sessionId,
            runId,
            token: r.lease.fencingToken,
            atUs: r.lease.acquiredAtUs,
            endUs: r.lease.expiresAtUs,
            ended: "expired",
            how: "acquire",
          };
          grants.push(grant);
          const action = pick(["release", "renew-release", "abandon", "retry", "reacquire"]);
          if (action === "retry") {
            // S6: an idempotent retry of the same run keeps its token — while
            // its lease is valid. After its deadline the run never holds the
            // session again (S4): refused, never a new grant. Either way the
            // lease is then left to expire.
            let again: Awaited<ReturnType<LeaseStore["acquire"]>>;
            try {
              again = await store.acquire({ ...key, runId, ttlMs, holder: "churn" });
            } catch (error) {
              expect(error).toBeInstanceOf(LeaseNotHeldError);
              expect((error as LeaseNotHeldError).reason).toBe("expired");
              continue;
            }
            if (again.acquired) {
              expect(again.retried).toBe(true);
              retries.push({ original: grant.token, again: again.lease.fencingToken });
              grant.endUs = again.lease.expiresAtUs;
            }
            continue;
          }
          if (action === "renew-release") {
            const renewed = await store.renew(key, runId, ttlMs);
            if (renewed.held) grant.endUs = renewed.lease.expiresAtUs;
          }
          if (action === "abandon") continue;
          const released = await store.release(key, runId);
          if (released) {
            grant.endUs = released.expiresAtUs;
            grant.ended = "released";
          }
          if (action === "reacquire" && released) {
            // The same client at once takes the key again as a new run,
            // racing every other runner that is waiting for it.
            const nextRun = randomUUID();
            const re = await store.acquire({ ...key, runId: nextRun, ttlMs, holder: "churn" });
            if (re.acquired) {
              const regrant: Grant = {
                session: key.sessionId,
                runId: nextRun,
                token: re.lease.fencingToken,
                atUs: re.lease.acquiredAtUs,
                endUs: re.lease.expiresAtUs,
                ended: "expired",
                how: "reacquire-after-release",
              };
              grants.push(regrant);
              const gone = await store.release(key, nextRun);
              if (gone) {
                regrant.endUs = gone.expiresAtUs;
                regrant.ended = "released";
              }
            }
          }
        }
      }),
    );

    // Part 2: the tombstone race, head on. X holds the key; X releases and
    // re-acquires as a new run while three fresh acquirers on their own
    // connections try at the same moment. Exactly one of them wins.
    const key = freshKey("tombstone-race");
    const [x, ...fresh] = Array.from({ length: 4 }, runner) as [Runner, ...Runner[]];
    let holder = randomUUID();
    const first = await x.store.acquire({ ...key, runId: holder, ttlMs: 30_000, holder: "x" });
    if (!first.acquired) throw new Error("the race key must start free");
    grants.push({
      session: key.sessionId,
      runId: holder,
      token: first.lease.fencingToken,
      atUs: first.lease.acquiredAtUs,
      endUs: first.lease.expiresAtUs,
      ended: "expired",
      how: "acquire",
    });
    let holderStore = x.store;
    for (let round = 0; round < 60; round++) {
      const reacquirer = randomUUID();
      const prior = grants.at(-1) as Grant;
      // Even rounds: the fresh acquirers keep trying from before the release
      // until they see it, racing the release itself. Odd rounds: they start
      // the moment the release commits, together with the re-acquire.
      const together = round % 2 === 1;
      let releasedNow: () => void = () => {};
      const releaseCommitted = new Promise<void>((resolve) => {
        releasedNow = resolve;
      });
      const attempts = await Promise.all([
        (async () => {
          const released = await holderStore.release(key, holder);
          if (!released) throw new Error("the holder's own release must succeed");
          prior.endUs = released.expiresAtUs;
          prior.ended = "released";
          releasedNow();
          const r = await holderStore.acquire({
            ...key,
            runId: reacquirer,
            ttlMs: 30_000,
            holder: "x",
          });
          return { r, runId: reacquirer, store: holderStore, how: "race-reacquire" as const };
        })(),
        ...fresh.map(async ({ store }) => {
          const runId = randomUUID();
          if (together) await releaseCommitted;
          // Until the prior run's lease is gone: granted, or another run holds it.
          const r = await waitFor(
            async () => {
              const a = await store.acquire({ ...key, runId, ttlMs: 30_000, holder: "fresh" });
              return a.acquired || (a.current && a.current.runId !== prior.runId) ? a : undefined;
            },
            { what: "a fresh acquirer to see the prior run's lease end", intervalMs: 0 },
          );
          return { r, runId, store, how: "race-fresh" as const };
        }),
      ]);
      const winners = attempts.filter((a) => a.r.acquired);
      expect(winners).toHaveLength(1);
      const winner = winners[0];
      if (!winner?.r.acquired) throw new Error("unreachable");
      grants.push({
        session: key.sessionId,
        runId: winner.runId,
        token: winner.r.lease.fencingToken,
        atUs: winner.r.lease.acquiredAtUs,
        endUs: winner.r.lease.expiresAtUs,
        ended: "expired",
        how: winner.how,
      });
      holder = winner.runId;
      holderStore = winner.store;
    }

    // No token issued twice; a retry of the same run is the same grant.
    const tokens = grants.map((g) => g.token);
    expect(new Set(tokens).size).toBe(tokens.length);
    for (const r of retries) expect(r.again).toBe(r.original);

    // Per key, in the order of the database's grant times, tokens strictly
    // increase, and each grant starts no earlier than the previous one ended (S1).
    const sessions = [...keys, key].map((k) => k.sessionId);
    for (const session of sessions) {
      const mine = grants
        .filter((g) => g.session === session)
        .sort((a, b) => (a.atUs < b.atUs ? -1 : a.atUs > b.atUs ? 1 : 0));
      for (let i = 1; i < mine.length; i++) {
        const prev = mine[i - 1] as Grant;
        const cur = mine[i] as Grant;
        expect(cur.atUs).toBeGreaterThan(prev.atUs);
        expect(cur.token).toBeGreaterThan(prev.token);
        expect(cur.atUs).toBeGreaterThanOrEqual(prev.endUs);
      }
    }

    // The record is complete: the database's audit trail holds exactly the
    // grants the runs were told about, at the same grant times.
    const events = await db.sql<{ sessionId: string; fencingToken: bigint; atUs: bigint }[]>`
      SELECT session_id, fencing_token, (extract(epoch FROM at) * 1000000)::bigint AS at_us
      FROM lease_events
      WHERE type = 'acquired' AND account_id = ${key.accountId} AND session_id IN ${db.sql(sessions)}`;
    const told = grants.map((g) => `${g.session}/${g.token}/${g.atUs}`).sort();
    const recorded = events.map((e) => `${e.sessionId}/${e.fencingToken}/${e.atUs}`).sort();
    expect(recorded).toEqual(told);

    // The churn really exercised every path it claims to.
    const takeoversAfter = (ended: Grant["ended"]) =>
      sessions.reduce((n, session) => {
        const mine = grants
          .filter((g) => g.session === session)
          .sort((a, b) => (a.atUs < b.atUs ? -1 : 1));
        return n + mine.slice(1).filter((_, i) => mine[i]?.ended === ended).length;
      }, 0);
    expect(takeoversAfter("expired")).toBeGreaterThan(10);
    expect(takeoversAfter("released")).toBeGreaterThan(10);
    expect(retries.length).toBeGreaterThan(0);
    expect(grants.filter((g) => g.how === "reacquire-after-release").length).toBeGreaterThan(0);
    expect(grants.filter((g) => g.how === "race-fresh").length).toBeGreaterThan(0);
    expect(grants.filter((g) => g.how === "race-reacquire").length).toBeGreaterThan(0);
  });
});
