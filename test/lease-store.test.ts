// The lease rules of DESIGN §1, checked at the store against real PostgreSQL
// over independent connections.

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import { DatabaseUnavailableError } from "../src/lease/errors.js";
import type { LeaseStore, SessionKey } from "../src/lease/types.js";
import type { Sql } from "../src/postgres/pool.js";
import { endOne } from "../src/server/db/end-statement.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { renewOne } from "../src/server/db/renew-statement.js";
import { openTransaction } from "./support/db.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey, lockLeaseRow, untilExpired } from "./support/leases.js";
import { waitFor } from "./support/wait.js";

const { db } = useTestDatabase();
let store: LeaseStore;

beforeAll(() => {
  store = createLeaseStore(db.sql);
});

const acquire = (s: LeaseStore, key: { accountId: string; sessionId: string }, ttlMs = 30_000) =>
  s.acquire({ ...key, runId: randomUUID(), ttlMs, holder: "test" });

describe("S2 atomic acquire", () => {
  it("S1, S2: two independent connections racing for one key: exactly one wins, 200 rounds", async () => {
    const a = createLeaseStore(db.connect(1));
    const b = createLeaseStore(db.connect(1));
    // Both connections are open before the race so neither pays a connect.
    await Promise.all([a.get(freshKey()), b.get(freshKey())]);
    for (let round = 0; round < 200; round++) {
      const key = freshKey("race");
      const [ra, rb] = await Promise.all([acquire(a, key), acquire(b, key)]);
      const winners = [ra, rb].filter((r) => r.acquired);
      expect(winners).toHaveLength(1);
      const loser = [ra, rb].find((r) => !r.acquired);
      const winner = winners[0];
      if (!loser || loser.acquired || !winner?.acquired) throw new Error("unreachable");
      expect(loser.current?.runId).toBe(winner.lease.runId);
    }
  });

  it("S1, S2: 32 racers on 32 connections: exactly one wins each round", async () => {
    const pools: Sql[] = Array.from({ length: 32 }, () => db.connect(1));
    const stores = pools.map((p) => createLeaseStore(p));
    await Promise.all(stores.map((s) => s.get(freshKey())));
    for (let round = 0; round < 10; round++) {
      const key = freshKey("race32");
      const results = await Promise.all(stores.map((s) => acquire(s, key)));
      expect(results.filter((r) => r.acquired)).toHaveLength(1);
      const held = await store.get(key);
      const winner = results.find((r) => r.acquired);
      expect(held?.runId).toBe(winner?.acquired ? winner.lease.runId : "none");
    }
  });
});

describe("S3 no overwrite", () => {
  it("S3: a valid lease is not taken by a new run; the loser is told who holds it", async () => {
    const key = freshKey();
    const first = await acquire(store, key);
    const second = await store.acquire({
      ...key,
      runId: randomUUID(),
      ttlMs: 30_000,
      holder: "browser",
    });
    expect(first.acquired).toBe(true);
    expect(second.acquired).toBe(false);
    if (!first.acquired || second.acquired) throw new Error("unreachable");
    expect(second.current?.runId).toBe(first.lease.runId);
    expect(second.current?.fencingToken).toBe(first.lease.fencingToken);
    expect((await store.get(key))?.runId).toBe(first.lease.runId);
  });

  it("S3, S6: the same run_id re-acquiring its valid lease gets the same token and a new deadline", async () => {
    const key = freshKey();
    const runId = randomUUID();
    const first = await store.acquire({ ...key, runId, ttlMs: 10_000, holder: "a" });
    const again = await store.acquire({ ...key, runId, ttlMs: 20_000, holder: "a" });
    if (!first.acquired || !again.acquired) throw new Error("both must be granted");
    expect(again.retried).toBe(true);
    expect(again.lease.fencingToken).toBe(first.lease.fencingToken);
    expect(again.lease.acquiredAtUs).toBe(first.lease.acquiredAtUs);
    expect(again.lease.expiresAtUs).toBeGreaterThan(first.lease.expiresAtUs);
  });
});

describe("S4 no resurrection, S5 owner-checked release", () => {
  it("S4, S5: after expiry another run takes over; the old run can neither renew nor release it", async () => {
    const key = freshKey();
    const a = await acquire(store, key, 100);
    if (!a.acquired) throw new Error("a must be granted");
    await untilExpired(db.sql, key);
    const b = await acquire(store, key);
    if (!b.acquired) throw new Error("b must take over after expiry");
    expect(b.lease.fencingToken).toBeGreaterThan(a.lease.fencingToken);

    expect(await store.renew(key, a.lease.runId, undefined)).toEqual({
      held: false,
      cause: "taken_over",
    });
    expect(await store.release(key, a.lease.runId)).toBeUndefined();
    const now = await store.get(key);
    expect(now?.runId).toBe(b.lease.runId);
    expect(now?.expiresAtUs).toBe(b.lease.expiresAtUs);
  });

  it("S4: a late renewal of an expired run fails even when nobody took over", async () => {
    const key = freshKey();
    const a = await acquire(store, key, 100);
    if (!a.acquired) throw new Error("a must be granted");
    await untilExpired(db.sql, key);
    expect(await store.renew(key, a.lease.runId, 30_000)).toEqual({
      held: false,
      cause: "expired",
    });
    expect(await store.get(key)).toBeUndefined();
  });

  it("S4: renewal of a released or unknown lease names the cause", async () => {
    const key = freshKey();
    const a = await acquire(store, key);
    if (!a.acquired) throw new Error("a must be granted");
    await store.release(key, a.lease.runId);
    expect(await store.renew(key, a.lease.runId, undefined)).toEqual({
      held: false,
      cause: "released",
    });
    expect(await store.renew(freshKey(), randomUUID(), undefined)).toEqual({
      held: false,
      cause: "not_found",
    });
    const b = await acquire(store, key);
    if (!b.acquired) throw new Error("b must be granted");
    await store.revoke(key, "operator");
    expect(await store.renew(key, b.lease.runId, undefined)).toEqual({
      held: false,
      cause: "revoked",
    });
  });

  it("S4: a valid renewal extends the deadline from the database clock and keeps the token", async () => {
    const key = freshKey();
    const a = await acquire(store, key, 5_000);
    if (!a.acquired) throw new Error("a must be granted");
    const renewed = await store.renew(key, a.lease.runId, 60_000);
    if (!renewed.held) throw new Error("renewal of a valid lease must succeed");
    expect(renewed.lease.fencingToken).toBe(a.lease.fencingToken);
    expect(renewed.lease.ttlMs).toBe(60_000n);
    expect(renewed.lease.expiresAtUs).toBeGreaterThan(a.lease.expiresAtUs);
    expect(renewed.lease.remainingUs).toBeLessThanOrEqual(60_000_000n);
    expect(renewed.lease.remainingUs).toBeGreaterThan(59_000_000n);
  });

  it("a renewal alone of a lease of its own answers it without a keeper id (the KeepAlive encoder writes a present one)", async () => {
    const key = freshKey();
    const a = await acquire(store, key, 5_000);
    if (!a.acquired) throw new Error("a must be granted");
    const renewed = await store.renew(key, a.lease.runId, undefined);
    if (!renewed.held) throw new Error("renewal of a valid lease must succeed");
    expect(renewed.lease).not.toHaveProperty("keeperId");
  });

  it("S5: a release by another run_id leaves the lease; releasing nothing is released=false", async () => {
    const key = freshKey();
    const a = await acquire(store, key);
    if (!a.acquired) throw new Error("a must be granted");
    expect(await store.release(key, randomUUID())).toBeUndefined();
    expect((await store.get(key))?.runId).toBe(a.lease.runId);
    expect((await store.release(key, a.lease.runId))?.runId).toBe(a.lease.runId);
    expect(await store.release(key, a.lease.runId)).toBeUndefined();
    expect(await store.get(key)).toBeUndefined();
  });

  it("S5, S6: release keeps a tombstone, so the next acquire draws a larger token", async () => {
    const key = freshKey();
    const a = await acquire(store, key);
    if (!a.acquired) throw new Error("a must be granted");
    await store.release(key, a.lease.runId);
    const [row] = await db.sql`
      SELECT run_id, ended, expires_at <= clock_timestamp() AS past FROM leases
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    expect(row).toMatchObject({ runId: a.lease.runId, ended: "released", past: true });
    const b = await acquire(store, key);
    if (!b.acquired) throw new Error("b must be granted");
    expect(b.lease.fencingToken).toBeGreaterThan(a.lease.fencingToken);
  });
});

describe("S6 monotonic fencing", () => {
  it("S6: tokens strictly increase across release-reacquire and expiry takeovers", async () => {
    const key = freshKey();
    const tokens: bigint[] = [];
    for (let i = 0; i < 10; i++) {
      const r = await acquire(store, key, 60);
      if (!r.acquired) throw new Error("the key must be free");
      tokens.push(r.lease.fencingToken);
      if (i % 2 === 0) await store.release(key, r.lease.runId);
      else await untilExpired(db.sql, key);
    }
    for (let i = 1; i < tokens.length; i++) {
      expect(tokens[i]).toBeGreaterThan(tokens[i - 1] as bigint);
    }
  });

  it("S1, S6: under concurrent release/re-acquire churn on 3 keys, per-key tokens increase in grant order and never overlap", async () => {
    const keys = [freshKey("churn"), freshKey("churn"), freshKey("churn")];
    const workers = Array.from({ length: 12 }, () => createLeaseStore(db.connect(1)));
    type Grant = { key: string; token: bigint; at: bigint; end: bigint };
    const grants: Grant[] = [];
    await Promise.all(
      workers.map(async (w, i) => {
        for (let n = 0; n < 40; n++) {
          const key = keys[(i + n) % keys.length] as (typeof keys)[number];
          const r = await acquire(w, key, 30_000);
          if (!r.acquired) continue;
          const released = await w.release(key, r.lease.runId);
          if (!released) throw new Error("a holder's own release must succeed");
          grants.push({
            key: key.sessionId,
            token: r.lease.fencingToken,
            at: r.lease.acquiredAtUs,
            end: released.expiresAtUs,
          });
        }
      }),
    );
    expect(grants.length).toBeGreaterThan(30);
    for (const key of keys) {
      const mine = grants
        .filter((g) => g.key === key.sessionId)
        .sort((x, y) => (x.at < y.at ? -1 : 1));
      for (let i = 1; i < mine.length; i++) {
        const prev = mine[i - 1] as Grant;
        const cur = mine[i] as Grant;
        expect(cur.token).toBeGreaterThan(prev.token);
        // S1: the next grant starts no earlier than the previous one ended.
        expect(cur.at).toBeGreaterThanOrEqual(prev.end);
      }
    }
    expect(new Set(grants.map((g) => g.token)).size).toBe(grants.length);
  });
});

describe("S8 independence", () => {
  it("S8: a transaction holding one key's row lock makes that key fail fast; other keys proceed", async () => {
    const locked = freshKey();
    const other = freshKey();
    await acquire(store, locked, 100);
    await untilExpired(db.sql, locked);
    const fast = createLeaseStore(db.connect(2, { lockTimeoutMs: 200 }));

    const lock = await lockLeaseRow(db, locked, { lockTimeoutMs: 5_000 });
    try {
      await expect(acquire(fast, locked)).rejects.toBeInstanceOf(DatabaseUnavailableError);
      const free = await acquire(fast, other);
      expect(free.acquired).toBe(true);
    } finally {
      await lock.end();
    }
    expect((await acquire(fast, locked)).acquired).toBe(true);
  });
});

describe("a decision that waited on a row lock", () => {
  // A statement takes its snapshot, then waits for the row lock of a
  // renewal in progress; once the renewal commits, the row it locks is a
  // version its snapshot does not see. It must decide on that row (or
  // retry), never answer as if there were no lease.

  /**
   * Grants a fresh lease, holds its row with an uncommitted renewal, starts
   * `decide` on it, and commits the renewal once `decide` waits on the row
   * lock: the lease's run and what `decide` answered.
   */
  async function decidedAfterARenewal<T>(
    prefix: string,
    decide: (key: SessionKey, runId: string) => Promise<T>,
  ): Promise<{ runId: string; answer: T; key: SessionKey }> {
    const key = freshKey(prefix);
    const granted = await acquire(store, key);
    if (!granted.acquired) throw new Error("not granted");
    const renewal = await openTransaction(
      db,
      (tx) => tx`UPDATE leases SET expires_at = clock_timestamp() + ttl
                 WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`,
    );
    const decision = decide(key, granted.lease.runId);
    await waitFor(
      async () =>
        (
          await db.sql`SELECT 1 FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock'`
        ).length > 0,
      { what: "the store's statement to wait on the renewal's row lock" },
    );
    await renewal.end();
    return { runId: granted.lease.runId, answer: await decision, key };
  }

  it("S4, audit order: a release or revoke that read its clock before a renewal it then waited behind ends the lease no earlier than that renewal's reading", async () => {
    for (const how of ["released", "revoked"] as const) {
      const key = freshKey(`end-after-renewal-${how}`);
      const granted = await acquire(store, key);
      if (!granted.acquired) throw new Error("not granted");
      // Another transaction holds the row; the end reads its clock and waits;
      // only then does that transaction renew the lease (a later clock
      // reading) and commit, so the end decides on the renewed version.
      const conn = db.connect(1);
      let locked!: () => void;
      const isLocked = new Promise<void>((resolve) => {
        locked = resolve;
      });
      let renew!: () => void;
      const renewNow = new Promise<void>((resolve) => {
        renew = resolve;
      });
      const renewal = conn.begin(async (t) => {
        await t`SELECT 1 FROM leases
                WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} FOR UPDATE`;
        locked();
        await renewNow;
        const [r] = await t<{ readingUs: bigint }[]>`
          UPDATE leases SET expires_at = clock_timestamp() + ttl
          WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
          RETURNING (extract(epoch FROM expires_at - ttl) * 1000000)::bigint AS reading_us`;
        return r?.readingUs;
      });
      await isLocked;
      const ended =
        how === "released" ? store.release(key, granted.lease.runId) : store.revoke(key, "test");
      await waitFor(
        async () =>
          (
            await db.sql`SELECT 1 FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'`
          ).length > 0,
        { what: `the ${how} statement to wait on the row lock` },
      );
      renew();
      const renewedAtUs = await renewal;
      await conn.end({ timeout: 1 });
      expect(await ended).toBeDefined();
      if (renewedAtUs === undefined) throw new Error("the renewal renewed nothing");
      const [end] = await db.sql<{ endUs: bigint; eventUs: bigint }[]>`
        SELECT (extract(epoch FROM l.expires_at) * 1000000)::bigint AS end_us,
               (extract(epoch FROM e.at) * 1000000)::bigint AS event_us
        FROM leases l JOIN lease_events e USING (account_id, session_id)
        WHERE l.account_id = ${key.accountId} AND l.session_id = ${key.sessionId}
          AND e.type = ${how}`;
      expect(end?.endUs).toBeGreaterThanOrEqual(renewedAtUs);
      expect(end?.eventUs).toBeGreaterThanOrEqual(renewedAtUs);
    }
  });

  it("S5: a release waiting for a renewal of its own lease ends it", async () => {
    const { runId, answer, key } = await decidedAfterARenewal("wait-release", (k, run) =>
      store.release(k, run),
    );
    expect(answer?.runId).toBe(runId);
    expect(await store.get(key)).toBeUndefined();
  });

  it("a revoke waiting for a renewal of the lease ends it", async () => {
    const { runId, answer, key } = await decidedAfterARenewal("wait-revoke", (k) =>
      store.revoke(k, "test"),
    );
    expect(answer?.runId).toBe(runId);
    expect(await store.get(key)).toBeUndefined();
  });

  it("S4: a renewal waiting for another renewal of its valid lease renews it, not `expired`", async () => {
    const { runId, answer } = await decidedAfterARenewal("wait-renew", (k, run) =>
      store.renew(k, run, undefined),
    );
    expect(answer).toMatchObject({ held: true, lease: { runId } });
  });

  it("the single-row statements decide in the attempt that waited, not only in a retry", async () => {
    const ended = await decidedAfterARenewal("wait-endOne", (k, runId) =>
      endOne(db.sql, { ...k, runId, ended: "released", reason: undefined }, { wait: true }),
    );
    expect(ended.answer.outcome).toBe("ended");
    const renewed = await decidedAfterARenewal("wait-renewOne", (k, runId) =>
      renewOne(db.sql, { ...k, runId, ttlMs: undefined, lookupHandoff: false }, { wait: true }),
    );
    expect(renewed.answer.outcome).toBe("renewed");
  });

  it("S4: a batch of renewals retried alone after a renewal held the row renews it in the attempt that waited", async () => {
    const { answer } = await decidedAfterARenewal("wait-renew-many", (k, runId) =>
      store.renewMany([{ ...k, runId, ttlMs: undefined, lookupHandoff: false }], { wait: true }),
    );
    // The waiting form updates by key, so it decides on the version it
    // locked (by ctid it could only answer busy again).
    expect(answer[0]?.outcome).toBe("renewed");
  });
});

describe("List", () => {
  it("S1: list shows only valid leases, paged by session_id", async () => {
    const account = `list-${randomUUID().slice(0, 8)}`;
    for (let i = 0; i < 5; i++) {
      await store.acquire({
        accountId: account,
        sessionId: `s${i}`,
        runId: randomUUID(),
        ttlMs: 30_000,
        holder: "",
      });
    }
    const gone = await store.acquire({
      accountId: account,
      sessionId: "s9",
      runId: randomUUID(),
      ttlMs: 30_000,
      holder: "",
    });
    if (!gone.acquired) throw new Error("s9 must be granted");
    await store.release({ accountId: account, sessionId: "s9" }, gone.lease.runId);
    const first = await store.list(account, 3, undefined);
    expect(first.leases.map((l) => l.sessionId)).toEqual(["s0", "s1", "s2"]);
    expect(first.nextAfter).toBe("s2");
    const second = await store.list(account, 3, first.nextAfter);
    expect(second.leases.map((l) => l.sessionId)).toEqual(["s3", "s4"]);
    expect(second.nextAfter).toBeUndefined();
  });
});
