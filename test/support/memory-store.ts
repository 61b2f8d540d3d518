// An in-memory LeaseStore: a test double for unit tests of what sits above
// the store (waiters, hubs, the expiry tracker, the renewal batcher). It
// follows the rules of db/lease-store.ts — conditional acquire, the same
// run's retry keeping its token, tokens from one counter in grant order,
// tombstones, the renewal guard and its loss causes, the audit rows — on a
// "database clock" the test controls. test/memory-store.test.ts runs the
// same scenarios against it and against PostgreSQL, so it cannot drift.
//
// It is no substitute for the database where the database is the point:
// concurrency between connections, lock timeouts, SQL. Ordering of text is
// by code unit (PostgreSQL's "C" collation); use ASCII ids of one shape.

import { endedLeaseNotReacquired } from "../../src/lease/errors.js";
import { keyString } from "../../src/lease/lease-change.js";
import type {
  AcquireResult,
  EndedLease,
  EventType,
  LeaseRecord,
  LeaseStore,
  RenewManyResult,
  Scope,
  SessionKey,
  SessionRow,
} from "../../src/lease/types.js";
import type { LossCause } from "../../src/protocol/errors.js";

/** The "database clock" of a memory store, in microseconds since the epoch. */
export interface Clock {
  nowUs(): bigint;
}

/** A clock that moves only when the test says so. */
export interface ManualClock extends Clock {
  advance(ms: number): void;
  /** Moves to `us`; a clock never goes back, so an earlier instant is ignored. */
  advanceTo(us: bigint): void;
}

export function manualClock(startUs = 1_700_000_000_000_000n): ManualClock {
  let now = startUs;
  return {
    nowUs: () => now,
    advance: (ms) => {
      now += BigInt(Math.round(ms * 1000));
    },
    advanceTo: (us) => {
      if (us > now) now = us;
    },
  };
}

/**
 * The clock the server's own code reads (performance.timeOrigin + now()),
 * so that it moves with vitest's fake timers, `skewMs` ahead of it: the
 * database's clock is never the server's.
 */
export function timerClock(skewMs = 0): Clock {
  return {
    nowUs: () => BigInt(Math.round((performance.timeOrigin + performance.now() + skewMs) * 1000)),
  };
}

/** One row of lease_events. */
export interface MemoryEvent {
  id: bigint;
  accountId: string;
  sessionId: string;
  type: EventType;
  runId: string;
  fencingToken: bigint;
  holder: string;
  reason: string | null;
  atUs: bigint;
}

interface Row extends Omit<LeaseRecord, "remainingUs"> {
  ended: "released" | "revoked" | null;
}

export interface MemoryStore extends LeaseStore {
  readonly clock: Clock;
  /** The audit trail, oldest first. */
  readonly events: readonly MemoryEvent[];
  /**
   * Another transaction takes the key's row lock until the returned function
   * is called: writes of the row wait for it, and renewMany without `wait`
   * answers the row `busy` (SKIP LOCKED).
   */
  lockRow(key: SessionKey): () => void;
}

export function createMemoryStore(options: { clock?: Clock } = {}): MemoryStore {
  const clock = options.clock ?? manualClock();
  const rows = new Map<string, Row>();
  const events: MemoryEvent[] = [];
  const locks = new Map<string, Promise<void>>();
  // Sequences: lease_fencing_token and lease_events' identity.
  let lastToken = 0n;
  let lastEventId = 0n;
  const nextToken = () => {
    lastToken += 1n;
    return lastToken;
  };

  const valid = (row: Row, now: bigint) => row.expiresAtUs > now;

  function record(row: Row, now: bigint): LeaseRecord {
    const { ended: _, ...lease } = row;
    const remaining = row.expiresAtUs - now;
    return { ...lease, remainingUs: remaining > 0n ? remaining : 0n };
  }

  function audit(
    row: Pick<Row, "accountId" | "sessionId" | "runId" | "fencingToken" | "holder">,
    type: EventType,
    atUs: bigint,
    reason: string | null = null,
    holder = row.holder,
  ): MemoryEvent {
    lastEventId += 1n;
    const event: MemoryEvent = {
      id: lastEventId,
      accountId: row.accountId,
      sessionId: row.sessionId,
      type,
      runId: row.runId,
      fencingToken: row.fencingToken,
      holder,
      reason,
      atUs,
    };
    events.push(event);
    return event;
  }

  // A write waits for the row lock another transaction holds, as an UPDATE does.
  async function rowLock(key: SessionKey): Promise<void> {
    for (;;) {
      const held = locks.get(keyString(key));
      if (!held) return;
      await held;
    }
  }

  function lossCause(key: SessionKey, runId: string): LossCause {
    const row = rows.get(keyString(key));
    if (!row) return "not_found";
    if (row.runId !== runId) return "taken_over";
    if (row.ended) return row.ended;
    return "expired";
  }

  function renewRow(row: Row, ttlMs: number | undefined, now: bigint) {
    if (ttlMs !== undefined) row.ttlMs = BigInt(ttlMs);
    row.expiresAtUs = now + row.ttlMs * 1000n;
  }

  function newestHandoff(row: Row) {
    for (let i = events.length - 1; i >= 0; i--) {
      const e = events[i] as MemoryEvent;
      if (
        e.type === "handoff_requested" &&
        e.accountId === row.accountId &&
        e.sessionId === row.sessionId &&
        e.fencingToken === row.fencingToken
      ) {
        return { requesterHolder: e.holder, reason: e.reason ?? "", atUs: e.atUs, eventId: e.id };
      }
    }
    return undefined;
  }

  function end(row: Row, how: "released" | "revoked", now: bigint, reason: string | null) {
    // As in SQL: never before the last grant or renewal's clock reading.
    const lastReading = row.expiresAtUs - row.ttlMs * 1000n;
    row.expiresAtUs = now > lastReading ? now : lastReading;
    row.ended = how;
    const event = audit(row, how, row.expiresAtUs, reason);
    return { ...record(row, now), eventId: event.id } satisfies EndedLease;
  }

  return {
    clock,
    events,
    lockRow(key) {
      const k = keyString(key);
      if (locks.has(k)) throw new Error(`the row of ${k} is already locked`);
      let unlock!: () => void;
      locks.set(
        k,
        new Promise<void>((resolve) => {
          unlock = resolve;
        }),
      );
      return () => {
        locks.delete(k);
        unlock();
      };
    },

    async acquire(input) {
      await rowLock(input);
      const now = clock.nowUs();
      const k = keyString(input);
      const held = rows.get(k);
      const ttlMs = BigInt(input.ttlMs);
      // Also after another run held the key in between: the audit trail
      // keeps the run's grant, and its latest end says how it ended.
      if (!held || held.runId !== input.runId) {
        const mine = events.filter(
          (e) =>
            e.accountId === input.accountId &&
            e.sessionId === input.sessionId &&
            e.runId === input.runId,
        );
        if (mine.some((e) => e.type === "acquired")) {
          const last = mine.findLast(
            (e) => e.type === "released" || e.type === "revoked" || e.type === "expired",
          );
          throw endedLeaseNotReacquired(
            input.runId,
            (last?.type as "released" | "revoked" | "expired" | undefined) ?? "expired",
          );
        }
      }
      if (held && valid(held, now) && held.runId !== input.runId) {
        return { acquired: false, current: record(held, now) } satisfies AcquireResult;
      }
      // As in SQL (S4): the same run's ended lease is never granted again.
      if (held && held.runId === input.runId && (held.ended !== null || !valid(held, now))) {
        throw endedLeaseNotReacquired(input.runId, held.ended ?? "expired");
      }
      // The same run re-acquiring its valid lease: an idempotent retry.
      const same = held && held.runId === input.runId && valid(held, now) ? held : undefined;
      const previous = held ? { ...held } : undefined;
      const row: Row = {
        accountId: input.accountId,
        sessionId: input.sessionId,
        runId: input.runId,
        fencingToken: same ? same.fencingToken : nextToken(),
        holder: input.holder,
        ttlMs,
        acquiredAtUs: same ? same.acquiredAtUs : now,
        expiresAtUs: now + ttlMs * 1000n,
        ended: null,
      };
      rows.set(k, row);
      let expired: (AcquireResult & { acquired: true })["expired"];
      let eventId = 0n;
      if (!same) {
        if (previous && previous.ended === null) {
          const e = audit(previous, "expired", previous.expiresAtUs);
          expired = {
            runId: previous.runId,
            fencingToken: previous.fencingToken,
            holder: previous.holder,
            expiresAtUs: previous.expiresAtUs,
            eventId: e.id,
          };
        }
        eventId = audit(row, "acquired", row.acquiredAtUs).id;
      }
      return {
        acquired: true,
        lease: record(row, now),
        retried: row.acquiredAtUs < now,
        eventId,
        expired,
      };
    },

    async renew(key, runId, ttlMs) {
      await rowLock(key);
      const now = clock.nowUs();
      const row = rows.get(keyString(key));
      if (!row || row.runId !== runId || !valid(row, now)) {
        const cause = lossCause(key, runId);
        const grantedBefore = events.some(
          (e) =>
            e.type === "acquired" &&
            e.runId === runId &&
            e.accountId === key.accountId &&
            e.sessionId === key.sessionId,
        );
        // As in SQL: unary Renew tells a run that never held the session.
        return {
          held: false,
          cause: cause === "taken_over" && !grantedBefore ? "never_held" : cause,
        };
      }
      renewRow(row, ttlMs, now);
      return { held: true, lease: record(row, now) };
    },

    async renewMany(items, options) {
      if (options.wait) for (const item of items) await rowLock(item);
      // One statement, one clock reading.
      const now = clock.nowUs();
      return items.map((item): RenewManyResult => {
        const k = keyString(item);
        const row = rows.get(k);
        if (!row || row.runId !== item.runId || !valid(row, now)) {
          return { outcome: "lost", cause: lossCause(item, item.runId) };
        }
        if (locks.has(k)) return { outcome: "busy" };
        renewRow(row, item.ttlMs, now);
        const handoff = item.lookupHandoff ? newestHandoff(row) : undefined;
        return { outcome: "renewed", lease: record(row, now), handoff };
      });
    },

    async release(key, runId, grant) {
      await rowLock(key);
      const now = clock.nowUs();
      const row = rows.get(keyString(key));
      if (!row || row.runId !== runId || !valid(row, now)) return undefined;
      if (
        grant &&
        (row.fencingToken !== grant.fencingToken || row.expiresAtUs !== grant.expiresAtUs)
      ) {
        return undefined;
      }
      return end(row, "released", now, null);
    },

    async revoke(key, reason) {
      await rowLock(key);
      const now = clock.nowUs();
      const row = rows.get(keyString(key));
      if (!row || !valid(row, now)) return undefined;
      return end(row, "revoked", now, reason);
    },

    async requestHandoff(key, requesterHolder, reason) {
      const now = clock.nowUs();
      const row = rows.get(keyString(key));
      if (!row || !valid(row, now)) return { lease: undefined, eventId: 0n, atUs: 0n };
      const event = audit(row, "handoff_requested", now, reason, requesterHolder);
      return { lease: record(row, now), eventId: event.id, atUs: now };
    },

    async readScopes(scopes: readonly Scope[]) {
      const now = clock.nowUs();
      const matched = [...rows.values()].filter((row) =>
        scopes.some(
          (s) =>
            s.accountId === row.accountId && (s.sessionId === "" || s.sessionId === row.sessionId),
        ),
      );
      matched.sort((a, b) =>
        a.accountId === b.accountId
          ? compare(a.sessionId, b.sessionId)
          : compare(a.accountId, b.accountId),
      );
      const found = matched.map((row): SessionRow => {
        const endEvent =
          row.ended !== null && row.expiresAtUs <= now
            ? events.findLast(
                (e) =>
                  e.accountId === row.accountId &&
                  e.sessionId === row.sessionId &&
                  e.type === row.ended &&
                  e.fencingToken === row.fencingToken,
              )
            : undefined;
        return {
          ...record(row, now),
          valid: valid(row, now),
          ended: row.ended,
          endEventId: endEvent?.id ?? null,
          endReason: endEvent?.reason ?? null,
        };
      });
      return { rows: found, observedAtUs: now };
    },

    async get(key) {
      const now = clock.nowUs();
      const row = rows.get(keyString(key));
      return row && valid(row, now) ? record(row, now) : undefined;
    },

    // Keepers live in PostgreSQL only: no lease here is on a keeper, so no
    // key is ever lock-delayed.
    async lockDelayUntil() {
      return undefined;
    },

    async list(accountId, limit, after) {
      const now = clock.nowUs();
      const page = [...rows.values()]
        .filter(
          (row) =>
            row.accountId === accountId &&
            compare(row.sessionId, after ?? "") > 0 &&
            valid(row, now),
        )
        .sort((a, b) => compare(a.sessionId, b.sessionId))
        .slice(0, limit + 1)
        .map((row) => record(row, now));
      const more = page.length > limit;
      const leases = more ? page.slice(0, limit) : page;
      return { leases, nextAfter: more ? leases.at(-1)?.sessionId : undefined };
    },

    async checkFence(key, token) {
      const now = clock.nowUs();
      const row = rows.get(keyString(key));
      if (!row) return { current: false, highestToken: 0n };
      return {
        current: row.fencingToken === token && valid(row, now),
        highestToken: row.fencingToken,
      };
    },
  };
}

function compare(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}
