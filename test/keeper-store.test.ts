// Keepers at the store (K1, K2; docs/keepers.md), against real PostgreSQL
// over independent connections: a lease on a keeper lives as long as its
// keeper, one heartbeat writes one row whatever the number of leases, and
// S1–S6 hold for a keeper's leases as for any lease.

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import {
  KeeperNotHeldError,
  LeaseNotHeldError,
  ResourceExhaustedError,
} from "../src/lease/errors.js";
import type {
  AcquireResult,
  KeeperRecord,
  KeeperStore,
  LeaseRecord,
  LeaseStore,
  SessionKey,
} from "../src/lease/types.js";
import type { Sql } from "../src/postgres/pool.js";
import { LimitName } from "../src/protocol/errors.js";
import { createKeeperStore } from "../src/server/db/keeper-store.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { createRetention } from "../src/server/db/retention.js";
import { openTransaction } from "./support/db.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { waitFor } from "./support/wait.js";

const { db } = useTestDatabase();
let store: LeaseStore;
let keepers: KeeperStore;

beforeAll(() => {
  store = createLeaseStore(db.sql);
  keepers = createKeeperStore(db.sql);
});

const account = "acct";

async function openKeeper(
  options: { ttlMs?: number; lockDelayMs?: number; accountId?: string; k?: KeeperStore } = {},
): Promise<KeeperRecord> {
  const opened = await (options.k ?? keepers).open({
    id: randomUUID(),
    accountId: options.accountId ?? account,
    holder: "worker",
    ttlMs: options.ttlMs ?? 30_000,
    lockDelayMs: options.lockDelayMs ?? 0,
  });
  if (!opened.held) throw new Error(`keeper not opened: ${opened.cause}`);
  return opened.keeper;
}

const acquireOn = (keeper: KeeperRecord | undefined, key: SessionKey, s: LeaseStore = store) =>
  s.acquire({ ...key, runId: randomUUID(), ttlMs: 30_000, holder: "t", keeperId: keeper?.id });

function granted(result: AcquireResult): LeaseRecord {
  if (!result.acquired) throw new Error(`not acquired: held by ${result.current?.runId}`);
  return result.lease;
}

/** Waits on the database clock until the keeper's deadline (plus `extraMs`) has passed. */
async function untilKeeperOver(sql: Sql, id: string, extraMs = 0): Promise<void> {
  await sql`
    SELECT pg_sleep_until(expires_at + lock_delay * ${extraMs > 0 ? 1 : 0}
                          + ${extraMs + 1}::int * interval '1 millisecond')
    FROM keepers WHERE id = ${id}::uuid`;
}

/** The row versions (ctid, xmin) of every lease on the keeper, and of the keeper's row. */
async function rowVersions(sql: Sql, id: string) {
  const leases = await sql<{ v: string }[]>`
    SELECT ctid::text || '/' || xmin::text AS v FROM leases
    WHERE keeper_id = ${id}::uuid ORDER BY account_id, session_id`;
  const [keeper] = await sql<{ v: string }[]>`
    SELECT ctid::text || '/' || xmin::text AS v FROM keepers WHERE id = ${id}::uuid`;
  return { leases: leases.map((r) => r.v), keeper: keeper?.v };
}

describe("K1 one heartbeat keeps every lease of a keeper", () => {
  it("K1: a lease on a keeper reports the keeper's deadline, and a heartbeat moves it for every lease", async () => {
    const keeper = await openKeeper();
    const keys = [freshKey("k1"), freshKey("k1"), freshKey("k1")];
    for (const key of keys) {
      const lease = granted(await acquireOn(keeper, key));
      expect(lease.expiresAtUs).toBe(keeper.expiresAtUs);
      expect(lease.ttlMs).toBe(keeper.ttlMs);
    }
    const beat = await keepers.heartbeat(account, keeper.id);
    if (!beat.held) throw new Error("heartbeat failed");
    expect(beat.keeper.expiresAtUs).toBeGreaterThan(keeper.expiresAtUs);
    for (const key of keys) {
      expect((await store.get(key))?.expiresAtUs).toBe(beat.keeper.expiresAtUs);
    }
    const listed = await store.list(account, 10_000, undefined);
    for (const key of keys) {
      const lease = listed.leases.find((l) => l.sessionId === key.sessionId);
      expect(lease?.expiresAtUs).toBe(beat.keeper.expiresAtUs);
    }
  });

  it("K1: one heartbeat writes the keeper's row and no lease row, with 1,000 leases on it", async () => {
    const keeper = await openKeeper();
    await Promise.all(
      Array.from({ length: 1_000 }, () => acquireOn(keeper, freshKey("k1-many")).then(granted)),
    );
    const before = await rowVersions(db.sql, keeper.id);
    expect(before.leases).toHaveLength(1_000);
    // The heartbeat runs in a transaction of its own so that PostgreSQL's
    // count of the rows it updated is read exactly (not from the lagging
    // statistics of every backend): one keeper row, no lease row.
    // (The counts also hold the connection's earlier statements not yet
    // reported: the difference is the heartbeat's.)
    const counted = await db.sql.begin(async (tx) => {
      const updated = async () => {
        const [n] = await tx<{ keepers: number; leases: number }[]>`
          SELECT pg_stat_get_xact_tuples_updated('keepers'::regclass)::int AS keepers,
                 pg_stat_get_xact_tuples_updated('leases'::regclass)::int AS leases`;
        return n ?? { keepers: 0, leases: 0 };
      };
      const start = await updated();
      const beat = await createKeeperStore(tx as unknown as Sql).heartbeat(account, keeper.id);
      const end = await updated();
      return {
        held: beat.held,
        keepers: end.keepers - start.keepers,
        leases: end.leases - start.leases,
      };
    });
    expect(counted).toEqual({ held: true, keepers: 1, leases: 0 });
    const after = await rowVersions(db.sql, keeper.id);
    expect(after.leases).toEqual(before.leases);
    expect(after.keeper).not.toBe(before.keeper);
  });

  it("DESIGN §3: a heartbeat is a HOT update of the keeper's row, and renewals of a plain lease stay HOT beside the keeper index", async () => {
    const keeper = await openKeeper();
    granted(await acquireOn(keeper, freshKey("hot")));
    const plainKey = freshKey("hot-plain");
    const plain = granted(await acquireOn(undefined, plainKey));
    const counted = await db.sql.begin(async (tx) => {
      const counts = async () => {
        const [n] = await tx<
          { keepers: number; keepersHot: number; leases: number; leasesHot: number }[]
        >`
          SELECT pg_stat_get_xact_tuples_updated('keepers'::regclass)::int AS keepers,
                 pg_stat_get_xact_tuples_hot_updated('keepers'::regclass)::int AS keepers_hot,
                 pg_stat_get_xact_tuples_updated('leases'::regclass)::int AS leases,
                 pg_stat_get_xact_tuples_hot_updated('leases'::regclass)::int AS leases_hot`;
        return n ?? { keepers: 0, keepersHot: 0, leases: 0, leasesHot: 0 };
      };
      const start = await counts();
      const inTx = tx as unknown as Sql;
      expect((await createKeeperStore(inTx).heartbeat(account, keeper.id)).held).toBe(true);
      expect((await createLeaseStore(inTx).renew(plainKey, plain.runId, undefined)).held).toBe(
        true,
      );
      const end = await counts();
      return {
        keepers: end.keepers - start.keepers,
        keepersHot: end.keepersHot - start.keepersHot,
        leases: end.leases - start.leases,
        leasesHot: end.leasesHot - start.leasesHot,
      };
    });
    expect(counted).toEqual({ keepers: 1, keepersHot: 1, leases: 1, leasesHot: 1 });
  });

  it("K1, S4: once the keeper expires, none of its leases is held, renewed, released or reacquired by its run", async () => {
    const keeper = await openKeeper({ ttlMs: 1_000 });
    const key = freshKey("k1-expiry");
    const lease = granted(await acquireOn(keeper, key));
    expect(await store.checkFence(key, lease.fencingToken)).toEqual({
      current: true,
      highestToken: lease.fencingToken,
    });
    await untilKeeperOver(db.sql, keeper.id);

    expect(await store.get(key)).toBeUndefined();
    expect(
      (await store.list(account, 10_000, undefined)).leases.map((l) => l.sessionId),
    ).not.toContain(key.sessionId);
    expect(await store.checkFence(key, lease.fencingToken)).toEqual({
      current: false,
      highestToken: lease.fencingToken,
    });
    expect(await store.renew(key, lease.runId, undefined)).toEqual({
      held: false,
      cause: "expired",
    });
    const [kept] = await store.renewMany(
      [{ ...key, runId: lease.runId, ttlMs: undefined, lookupHandoff: false }],
      { wait: false },
    );
    expect(kept).toEqual({ outcome: "lost", cause: "expired" });
    expect(await store.release(key, lease.runId)).toBeUndefined();
    await expect(
      store.acquire({
        ...key,
        runId: lease.runId,
        ttlMs: 30_000,
        holder: "t",
        keeperId: keeper.id,
      }),
    ).rejects.toBeInstanceOf(LeaseNotHeldError);
    expect(await keepers.heartbeat(account, keeper.id)).toEqual({ held: false, cause: "expired" });
    await expect(acquireOn(keeper, freshKey("k1-expiry"))).rejects.toThrow(KeeperNotHeldError);

    // The reading the expiry tracker and Watch snapshots use says the same, with the keeper's deadline.
    const reading = await store.readScopes([key]);
    expect(reading.rows[0]?.valid).toBe(false);
    expect(reading.rows[0]?.expiresAtUs).toBe(keeper.expiresAtUs);
  });

  it("K1: a keeper opened through one store (instance) is re-attached and kept alive through another; its leases stay held", async () => {
    const first = createKeeperStore(db.connect(1));
    const second = createKeeperStore(db.connect(1));
    const keeper = await openKeeper({ ttlMs: 3_000, k: first });
    const key = freshKey("failover");
    const lease = granted(await acquireOn(keeper, key));
    const attached = await second.open({
      id: keeper.id,
      accountId: account,
      holder: "worker",
      ttlMs: 3_000,
      lockDelayMs: 0,
    });
    if (!attached.held) throw new Error(`re-attach failed: ${attached.cause}`);
    // On the database clock: half-way to the keeper's first deadline, one
    // heartbeat through the second instance; then past that deadline, the
    // lease is still held.
    const sql = db.sql;
    const atUs = (us: bigint) => sql`to_timestamp(${Number(us) / 1e6})`;
    await sql`SELECT pg_sleep_until(${atUs(keeper.expiresAtUs - 1_500_000n)})`;
    const beat = await second.heartbeat(account, keeper.id);
    if (!beat.held) throw new Error(`heartbeat failed: ${beat.cause}`);
    expect(beat.keeper.expiresAtUs).toBeGreaterThan(keeper.expiresAtUs);
    await sql`SELECT pg_sleep_until(${atUs(keeper.expiresAtUs)} + interval '1 millisecond')`;
    expect((await store.get(key))?.runId).toBe(lease.runId);
    expect((await store.renew(key, lease.runId, undefined)).held).toBe(true);
  });

  it("K1: re-attaching to a valid keeper renews it; to an expired one is refused", async () => {
    const keeper = await openKeeper({ ttlMs: 1_000 });
    const again = await keepers.open({
      id: keeper.id,
      accountId: account,
      holder: "worker",
      ttlMs: 1_000,
      lockDelayMs: 0,
    });
    if (!again.held) throw new Error("re-attach failed");
    expect(again.keeper.expiresAtUs).toBeGreaterThanOrEqual(keeper.expiresAtUs);
    const otherAccount = await keepers.open({
      id: keeper.id,
      accountId: "someone-else",
      holder: "x",
      ttlMs: 1_000,
      lockDelayMs: 0,
    });
    expect(otherAccount).toEqual({ held: false, cause: "not_found" });
    await untilKeeperOver(db.sql, keeper.id);
    expect(
      await keepers.open({
        id: keeper.id,
        accountId: account,
        holder: "w",
        ttlMs: 1_000,
        lockDelayMs: 0,
      }),
    ).toEqual({ held: false, cause: "expired" });
  });
});

describe("heartbeats, batched", () => {
  it("K1: heartbeats of 50 keepers at once share statements, each renewing its keeper", async () => {
    const batched = createKeeperStore(db.connect(2));
    const opened = await Promise.all(Array.from({ length: 50 }, () => openKeeper()));
    const before = batched.stats.heartbeat.statements;
    const beats = await Promise.all(opened.map((k) => batched.heartbeat(account, k.id)));
    for (const [i, beat] of beats.entries()) {
      if (!beat.held) throw new Error(`heartbeat ${i} failed: ${beat.cause}`);
      expect(beat.keeper.id).toBe(opened[i]?.id);
      expect(beat.keeper.expiresAtUs).toBeGreaterThan(opened[i]?.expiresAtUs ?? 0n);
    }
    expect(batched.stats.heartbeat.statements - before).toBeLessThan(50);
  });

  it("S8: a keeper's row held by a stuck transaction holds up only that keeper's heartbeat", async () => {
    const [stuck, a, b] = await Promise.all([openKeeper(), openKeeper(), openKeeper()]);
    if (!stuck || !a || !b) throw new Error("unreachable");
    const lock = await openTransaction(
      db,
      (tx) => tx`SELECT 1 FROM keepers WHERE id = ${stuck.id}::uuid FOR UPDATE`,
    );
    let stuckAnswered = false;
    const waiting = keepers.heartbeat(account, stuck.id).then((r) => {
      stuckAnswered = true;
      return r;
    });
    const others = await Promise.all([a, b].map((k) => keepers.heartbeat(account, k.id)));
    expect(others.map((r) => r.held)).toEqual([true, true]);
    expect(stuckAnswered).toBe(false);
    await lock.end();
    expect((await waiting).held).toBe(true);
  });
});

describe("S1–S6 on a keeper's leases", () => {
  it("S1, S2: two runs on two keepers racing for one key on independent connections: exactly one wins, 50 rounds", async () => {
    const a = createLeaseStore(db.connect(1));
    const b = createLeaseStore(db.connect(1));
    const ka = await openKeeper();
    const kb = await openKeeper();
    for (let round = 0; round < 50; round++) {
      const key = freshKey("race");
      const results = await Promise.all([acquireOn(ka, key, a), acquireOn(kb, key, b)]);
      expect(results.filter((r) => r.acquired)).toHaveLength(1);
    }
  });

  it("S3: a valid keeper's lease is not taken over; the refusal names it", async () => {
    const keeper = await openKeeper();
    const key = freshKey("s3");
    const lease = granted(await acquireOn(keeper, key));
    const other = await acquireOn(undefined, key);
    expect(other.acquired).toBe(false);
    if (other.acquired) throw new Error("unreachable");
    expect(other.current?.runId).toBe(lease.runId);
    expect(other.current?.expiresAtUs).toBe(keeper.expiresAtUs);
  });

  it("S5: another run's release ends nothing; the run's own release ends only that lease", async () => {
    const keeper = await openKeeper();
    const [k1, k2] = [freshKey("s5"), freshKey("s5")];
    const l1 = granted(await acquireOn(keeper, k1));
    const l2 = granted(await acquireOn(keeper, k2));
    expect(await store.release(k1, randomUUID())).toBeUndefined();
    const released = await store.release(k1, l1.runId);
    expect(released?.runId).toBe(l1.runId);
    expect(await store.get(k1)).toBeUndefined();
    expect((await store.get(k2))?.runId).toBe(l2.runId);
    // A clean release has no lock-delay: the key is free at once.
    granted(await acquireOn(undefined, k1));
  });

  it("S6: a takeover after the keeper expired draws a higher token, and the audit records the expiry at the keeper's deadline", async () => {
    const keeper = await openKeeper({ ttlMs: 1_000 });
    const key = freshKey("s6");
    const first = granted(await acquireOn(keeper, key));
    await untilKeeperOver(db.sql, keeper.id);
    const second = granted(await acquireOn(undefined, key));
    expect(second.fencingToken).toBeGreaterThan(first.fencingToken);
    const events = await db.sql<{ type: string; runId: string; atUs: bigint }[]>`
      SELECT type, run_id, (extract(epoch FROM at) * 1000000)::bigint AS at_us FROM lease_events
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} ORDER BY id`;
    expect(events.map((e) => [e.type, e.runId])).toEqual([
      ["acquired", first.runId],
      ["expired", first.runId],
      ["acquired", second.runId],
    ]);
    expect(events[1]?.atUs).toBe(keeper.expiresAtUs);
  });

  it("S4, S1: a heartbeat in flight when the keeper's deadline passes either wins or the takeover does, never both", async () => {
    const keeper = await openKeeper({ ttlMs: 1_000 });
    const key = freshKey("race-beat");
    const lease = granted(await acquireOn(keeper, key));
    // A heartbeat that read its clock before the deadline and holds the
    // keeper's row, uncommitted, across it. Its new deadline is far off, so
    // that the keeper it renews is still valid when the takeover decides.
    const beat = await openTransaction(db, async (tx) => {
      const rows = await tx`
        WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
        UPDATE keepers AS k SET expires_at = lease_clock.observed_at + interval '30 seconds'
        FROM lease_clock
        WHERE k.id = ${keeper.id}::uuid AND k.ended IS NULL AND k.expires_at > lease_clock.observed_at
        RETURNING k.id`;
      if (rows.length !== 1) throw new Error("the heartbeat did not match");
    });
    await untilKeeperOver(db.sql, keeper.id);
    const takeover = acquireOn(undefined, key, createLeaseStore(db.connect(1)));
    await waitFor(
      async () => {
        const [row] = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'`;
        return (row?.n ?? 0) > 0;
      },
      { what: "the takeover waiting on the keeper's row" },
    );
    await beat.end();
    const result = await takeover;
    // The heartbeat committed first: the keeper is valid again, so its lease
    // is not taken over (S1, S3).
    expect(result.acquired).toBe(false);
    expect((await store.get(key))?.runId).toBe(lease.runId);
    expect((await keepers.heartbeat(account, keeper.id)).held).toBe(true);
  });

  it("S4: a takeover marks the expired keeper first, so its late heartbeat fails", async () => {
    const keeper = await openKeeper({ ttlMs: 1_000 });
    const key = freshKey("mark");
    granted(await acquireOn(keeper, key));
    await untilKeeperOver(db.sql, keeper.id);
    granted(await acquireOn(undefined, key));
    const [row] = await db.sql<
      { ended: string }[]
    >`SELECT ended FROM keepers WHERE id = ${keeper.id}::uuid`;
    expect(row?.ended).toBe("expired");
    expect(await keepers.heartbeat(account, keeper.id)).toEqual({ held: false, cause: "expired" });
  });
});

describe("K2 lock-delay", () => {
  it("K2: after the keeper expires, its keys are not granted to another run before the lock-delay has passed on the database clock; the refusal says until when", async () => {
    const keeper = await openKeeper({ ttlMs: 1_000, lockDelayMs: 1_500 });
    const keys = [freshKey("k2"), freshKey("k2"), freshKey("k2")];
    const leases = [];
    for (const key of keys) leases.push(granted(await acquireOn(keeper, key)));
    await untilKeeperOver(db.sql, keeper.id);
    const until = keeper.expiresAtUs + 1_500_000n;
    // Together (one batched statement) and alone (the single-row one).
    const together = await Promise.all(keys.map((key) => acquireOn(undefined, key)));
    const alone = await acquireOn(undefined, keys[0] as SessionKey);
    for (const refused of [...together, alone]) {
      expect(refused).toEqual({ acquired: false, current: undefined, lockDelayUntilUs: until });
    }
    const [clock] = await db.sql<{ nowUs: bigint }[]>`
      SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now_us`;
    // The refusals came after the deadline and before the delay was over.
    expect(clock?.nowUs ?? 0n).toBeGreaterThan(keeper.expiresAtUs);
    expect(clock?.nowUs ?? 0n).toBeLessThan(until);
    for (const key of keys) {
      expect(await store.get(key)).toBeUndefined();
      expect(await store.lockDelayUntil(key)).toBe(until);
    }
    await untilKeeperOver(db.sql, keeper.id, 1);
    expect(await store.lockDelayUntil(keys[0] as SessionKey)).toBeUndefined();
    for (const [i, key] of keys.entries()) {
      const next = granted(await acquireOn(undefined, key));
      expect(next.acquiredAtUs).toBeGreaterThanOrEqual(until);
      expect(next.fencingToken).toBeGreaterThan(leases[i]?.fencingToken ?? 0n);
    }
  });

  it("K2: a clean close has no delay: the keys are granted at once, and every lease was released (audited)", async () => {
    const keeper = await openKeeper({ lockDelayMs: 60_000 });
    const keys = [freshKey("close"), freshKey("close")];
    for (const key of keys) granted(await acquireOn(keeper, key));
    const closed = await keepers.end(account, keeper.id, { ended: "closed" });
    expect(closed.ended).toBe(true);
    expect(closed.leases.map((l) => l.sessionId).sort()).toEqual(
      keys.map((k) => k.sessionId).sort(),
    );
    for (const key of keys) {
      expect(await store.get(key)).toBeUndefined();
      // A clean close has no lock-delay.
      expect(await store.lockDelayUntil(key)).toBeUndefined();
      granted(await acquireOn(undefined, key));
      const [ev] = await db.sql<{ n: number }[]>`
        SELECT count(*)::int AS n FROM lease_events
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} AND type = 'released'`;
      expect(ev?.n).toBe(1);
    }
    expect(await keepers.heartbeat(account, keeper.id)).toEqual({ held: false, cause: "closed" });
    await expect(acquireOn(keeper, freshKey("close"))).rejects.toThrow(/closed/);
  });
});

/** How a keeper is ended, and the audit row each of its open leases gets. */
const endings = [
  { how: { ended: "closed" as const }, event: "released" },
  { how: { ended: "revoked" as const, reason: "drain" }, event: "revoked" },
];

describe("close racing a grant", () => {
  it.each(endings)(
    "K1, S5: a grant on a keeper racing its end ($how.ended) on independent connections is refused, or granted and then ended by it (audited); never left held, 30 rounds",
    async ({ how, event }) => {
      const granter = createLeaseStore(db.connect(1));
      const closer = createKeeperStore(db.connect(1));
      for (let round = 0; round < 30; round++) {
        const keeper = await openKeeper();
        const key = freshKey("close-race");
        const [grant, closed] = await Promise.all([
          acquireOn(keeper, key, granter).catch((e: unknown) => e),
          closer.end(account, keeper.id, how),
        ]);
        expect(closed.ended).toBe(true);
        expect(await store.get(key)).toBeUndefined();
        if (grant instanceof Error) {
          expect(grant).toBeInstanceOf(KeeperNotHeldError);
          continue;
        }
        const lease = granted(grant as AcquireResult);
        expect(closed.leases.map((l) => l.runId)).toEqual([lease.runId]);
        const [ended] = await db.sql<{ n: number }[]>`
        SELECT count(*)::int AS n FROM lease_events
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} AND type = ${event}`;
        expect(ended?.n).toBe(1);
      }
    },
  );
});

/**
 * A real grant statement on `keeper`, held in flight: another transaction
 * has inserted `key`'s row (a tombstone) and not committed it, so the
 * grant's upsert waits on that row after `keeper_granting` has locked the
 * keeper's row. `finish` commits the tombstone, which the grant then takes
 * over, and answers the grant.
 */
async function grantHeldInFlight(keeper: KeeperRecord, key: SessionKey) {
  const blocker = await openTransaction(
    db,
    (tx) => tx`
      INSERT INTO leases (account_id, session_id, run_id, fencing_token, holder, ttl,
                          acquired_at, expires_at, ended)
      VALUES (${key.accountId}, ${key.sessionId}, gen_random_uuid(), nextval('lease_fencing_token'),
              'blocker', interval '1 second', clock_timestamp() - interval '1 minute',
              clock_timestamp() - interval '59 seconds', 'released')`,
  );
  const before = await lockWaiters();
  const grant = acquireOn(keeper, key, createLeaseStore(db.connect(1, { lockTimeoutMs: 20_000 })));
  let answered = false;
  void grant.then(
    () => {
      answered = true;
    },
    () => {
      answered = true;
    },
  );
  await untilOneMoreWaits(before, "the grant waiting on the key's row");
  // The setup is what it means to be: the grant holds the keeper's row.
  await expect(
    db.sql`SELECT 1 FROM keepers WHERE id = ${keeper.id}::uuid FOR UPDATE NOWAIT`,
  ).rejects.toMatchObject({ code: "55P03" });
  return {
    inFlight: () => !answered,
    finish: async () => {
      await blocker.end();
      return grant;
    },
  };
}

/** How many sessions of this database wait on a lock. */
async function lockWaiters(): Promise<number> {
  const [row] = await db.sql<{ n: number }[]>`
    SELECT count(*)::int AS n FROM pg_stat_activity
    WHERE datname = current_database() AND wait_event_type = 'Lock'`;
  return row?.n ?? 0;
}

/** Waits until one more session than `before` waits on a lock. */
async function untilOneMoreWaits(before: number, what: string): Promise<void> {
  await waitFor(async () => (await lockWaiters()) > before, { what });
}

describe("a grant in flight on a keeper", () => {
  it("K1, S8: a batched heartbeat renews the keeper at once while a grant statement on it is in flight", async () => {
    const keeper = await openKeeper();
    const key = freshKey("beat-grant");
    const held = await grantHeldInFlight(keeper, key);
    // lock_timeout 1 s: a heartbeat that waited for the grant would fail.
    const batched = createKeeperStore(db.connect(2));
    const beat = await batched.heartbeat(account, keeper.id);
    if (!beat.held) throw new Error(`heartbeat failed: ${beat.cause}`);
    expect(beat.keeper.expiresAtUs).toBeGreaterThan(keeper.expiresAtUs);
    expect(held.inFlight()).toBe(true);
    const lease = granted(await held.finish());
    // K1: the lease granted meanwhile has the renewed keeper's deadline.
    expect((await store.get(key))?.expiresAtUs).toBe(beat.keeper.expiresAtUs);
    expect(lease.keeperId).toBe(keeper.id);
  });

  it.each(endings)(
    "K1, S5: an end of the keeper ($how.ended) waits for a grant in flight on it, then ends its lease (audited); a later grant is refused",
    async ({ how, event }) => {
      const keeper = await openKeeper();
      const key = freshKey("end-grant");
      const held = await grantHeldInFlight(keeper, key);
      const closer = createKeeperStore(db.connect(1, { lockTimeoutMs: 20_000 }));
      const before = await lockWaiters();
      let endAnswered = false;
      const ending = closer.end(account, keeper.id, how).then((r) => {
        endAnswered = true;
        return r;
      });
      await untilOneMoreWaits(before, "the end waiting on the keeper's row");
      expect(endAnswered).toBe(false);
      const lease = granted(await held.finish());
      const ended = await ending;
      expect(ended.ended).toBe(true);
      expect(ended.leases.map((l) => l.runId)).toEqual([lease.runId]);
      expect(await store.get(key)).toBeUndefined();
      const [audited] = await db.sql<{ n: number }[]>`
      SELECT count(*)::int AS n FROM lease_events
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} AND type = ${event}
        AND run_id = ${lease.runId}::uuid`;
      expect(audited?.n).toBe(1);
      await expect(acquireOn(keeper, freshKey("end-grant"))).rejects.toBeInstanceOf(
        KeeperNotHeldError,
      );
    },
  );

  it("K1, K2: a takeover that marks the keeper expired waits for a grant in flight on it; that grant's lease then ends at the keeper's deadline", async () => {
    const keeper = await openKeeper();
    const first = freshKey("mark-grant");
    const firstLease = granted(await acquireOn(keeper, first));
    const key = freshKey("mark-grant");
    const held = await grantHeldInFlight(keeper, key);
    // A heartbeat (it does not wait for the grant) shortens the keeper's TTL.
    const beat = await keepers.heartbeat(account, keeper.id, 1_000);
    if (!beat.held) throw new Error(`heartbeat failed: ${beat.cause}`);
    await untilKeeperOver(db.sql, keeper.id);
    const before = await lockWaiters();
    let takeoverAnswered = false;
    const takeover = acquireOn(
      undefined,
      first,
      createLeaseStore(db.connect(1, { lockTimeoutMs: 20_000 })),
    ).then((r) => {
      takeoverAnswered = true;
      return r;
    });
    await untilOneMoreWaits(before, "the takeover waiting on the keeper's row");
    expect(takeoverAnswered).toBe(false);
    const lease = granted(await held.finish());
    const next = granted(await takeover);
    expect(next.fencingToken).toBeGreaterThan(firstLease.fencingToken);
    const [row] = await db.sql<{ ended: string }[]>`
      SELECT ended FROM keepers WHERE id = ${keeper.id}::uuid`;
    expect(row?.ended).toBe("expired");
    // The lease granted before the marking ends with its keeper (K1).
    expect(await store.get(key)).toBeUndefined();
    expect(lease.keeperId).toBe(keeper.id);
    expect(await keepers.heartbeat(account, keeper.id)).toEqual({ held: false, cause: "expired" });
  });
});

describe("Revoke", () => {
  it("a revoke of one lease ends only that lease; a revoke of the keeper ends them all, audited with the reason", async () => {
    const keeper = await openKeeper();
    const keys = [freshKey("rv"), freshKey("rv"), freshKey("rv")];
    for (const key of keys) granted(await acquireOn(keeper, key));
    const [one, ...rest] = keys as [SessionKey, ...SessionKey[]];
    expect((await store.revoke(one, "one"))?.sessionId).toBe(one.sessionId);
    expect(await store.get(one)).toBeUndefined();
    for (const key of rest) expect(await store.get(key)).toBeDefined();
    expect((await keepers.heartbeat(account, keeper.id)).held).toBe(true);

    const revoked = await keepers.end(account, keeper.id, { ended: "revoked", reason: "drain" });
    expect(revoked.leases.map((l) => l.sessionId).sort()).toEqual(
      rest.map((k) => k.sessionId).sort(),
    );
    for (const key of rest) {
      expect(await store.get(key)).toBeUndefined();
      const [ev] = await db.sql<{ reason: string }[]>`
        SELECT reason FROM lease_events
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} AND type = 'revoked'`;
      expect(ev?.reason).toBe("drain");
    }
    expect(await keepers.heartbeat(account, keeper.id)).toEqual({ held: false, cause: "revoked" });
  });
});

describe("limits and bad keepers", () => {
  it("a keeper of another account, or none, takes no lease", async () => {
    const foreign = await openKeeper({ accountId: "other-account" });
    const error = await acquireOn(foreign, freshKey("foreign")).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(KeeperNotHeldError);
    expect((error as KeeperNotHeldError).ended).toBe("not_found");
    const none = await store
      .acquire({
        ...freshKey("none"),
        runId: randomUUID(),
        ttlMs: 1_000,
        holder: "",
        keeperId: randomUUID(),
      })
      .catch((e: unknown) => e);
    expect((none as KeeperNotHeldError).ended).toBe("not_found");
  });

  it("leases per keeper: the grant past the limit is RESOURCE_EXHAUSTED naming it, also inside one batch", async () => {
    const limited = createLeaseStore(db.sql, { maxLeasesPerKeeper: 3 });
    const keeper = await openKeeper();
    const results = await Promise.allSettled(
      Array.from({ length: 5 }, () => acquireOn(keeper, freshKey("per-keeper"), limited)),
    );
    const ok = results.filter((r) => r.status === "fulfilled" && r.value.acquired);
    const refused = results.filter((r) => r.status === "rejected");
    expect(ok).toHaveLength(3);
    expect(refused).toHaveLength(2);
    for (const r of refused) {
      const reason = (r as PromiseRejectedResult).reason as ResourceExhaustedError;
      expect(reason).toBeInstanceOf(ResourceExhaustedError);
      expect(reason.limit).toBe(LimitName.leasesPerKeeper);
    }
  });

  it("keepers per account: the keeper past the limit is RESOURCE_EXHAUSTED naming it; a re-attach at the limit is not refused", async () => {
    const limited = createKeeperStore(db.sql, { maxKeepersPerAccount: 2 });
    const accountId = `limited-${randomUUID()}`;
    const first = await openKeeper({ accountId, k: limited });
    await openKeeper({ accountId, k: limited });
    const error = await openKeeper({ accountId, k: limited }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(ResourceExhaustedError);
    expect((error as ResourceExhaustedError).limit).toBe(LimitName.keepersPerAccount);
    const again = await limited.open({
      id: first.id,
      accountId,
      holder: "worker",
      ttlMs: 30_000,
      lockDelayMs: 0,
    });
    expect(again.held).toBe(true);
  });
});

describe("retention of keepers", () => {
  it("S6: a keeper over for longer than the horizon is deleted with its leases, which a close missed are audited; a recent or valid keeper is kept", async () => {
    const day = 86_400_000;
    const retention = createRetention(db.sql, {
      eventRetentionMs: 30 * day,
      tombstoneHorizonMs: day,
    });
    const expired = await openKeeper();
    const closed = await openKeeper();
    const recent = await openKeeper();
    const valid = await openKeeper();
    const keyOf = new Map<string, SessionKey>();
    const tokens = new Map<string, bigint>();
    for (const keeper of [expired, closed, recent, valid]) {
      const key = freshKey("ret");
      keyOf.set(keeper.id, key);
      tokens.set(keeper.id, granted(await acquireOn(keeper, key)).fencingToken);
    }
    // Moves a keeper's times into the past; `closed` ends it as a close
    // would, without the close's second statement (the one that ends its
    // leases): what a close that failed half-way leaves.
    const age = async (id: string, ageMs: number, ended: string | null) => {
      await db.sql`UPDATE leases SET acquired_at = clock_timestamp() - ${ageMs}::bigint * interval '1 ms' - interval '1 minute'
        WHERE keeper_id = ${id}::uuid`;
      await db.sql`UPDATE keepers SET ended = ${ended},
          created_at = clock_timestamp() - ${ageMs}::bigint * interval '1 ms' - interval '1 minute',
          expires_at = clock_timestamp() - ${ageMs}::bigint * interval '1 ms'
        WHERE id = ${id}::uuid`;
    };
    await age(expired.id, day + 60_000, null);
    await age(closed.id, day + 60_000, "closed");
    await age(recent.id, day - 60_000, null);

    await retention.collectTombstones();
    const keepersLeft = await db.sql<{ id: string }[]>`
      SELECT id FROM keepers WHERE id IN ${db.sql([expired.id, closed.id, recent.id, valid.id])}`;
    expect(keepersLeft.map((k) => k.id).sort()).toEqual([recent.id, valid.id].sort());
    const rowOf = async (id: string) => {
      const key = keyOf.get(id) as SessionKey;
      const [row] = await db.sql`SELECT 1 FROM leases
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
      return row !== undefined;
    };
    expect(await rowOf(expired.id)).toBe(false);
    expect(await rowOf(closed.id)).toBe(false);
    expect(await rowOf(recent.id)).toBe(true);
    expect(await store.get(keyOf.get(valid.id) as SessionKey)).toBeDefined();
    const closedKey = keyOf.get(closed.id) as SessionKey;
    const [released] = await db.sql<{ n: number }[]>`
      SELECT count(*)::int AS n FROM lease_events
      WHERE account_id = ${closedKey.accountId} AND session_id = ${closedKey.sessionId}
        AND type = 'released'`;
    expect(released?.n).toBe(1);
    // S6: a later grant of a collected key still draws a larger token.
    const again = granted(await acquireOn(undefined, keyOf.get(expired.id) as SessionKey));
    expect(again.fencingToken).toBeGreaterThan(tokens.get(expired.id) ?? 0n);
  });
});
