// All lease SQL (DESIGN §3). Every statement reads the database clock once,
// in a materialized `lease_clock` CTE, and decides with that instant (S9).
// Statements run in autocommit: no transaction spans a holder's work.

import type { Sql } from "./db.js";
import { classifyDatabaseError, type LossCause } from "./errors.js";

export interface SessionKey {
  accountId: string;
  sessionId: string;
}

/** A lease as stored, with database times in microseconds since the epoch. */
export interface LeaseRecord {
  accountId: string;
  sessionId: string;
  runId: string;
  fencingToken: bigint;
  holder: string;
  ttlMs: bigint;
  acquiredAtUs: bigint;
  expiresAtUs: bigint;
  /** expires_at minus the statement's clock reading, never negative. */
  remainingUs: bigint;
}

export type AcquireResult =
  | { acquired: true; lease: LeaseRecord; retried: boolean }
  | { acquired: false; current: LeaseRecord | undefined };

export type RenewResult = { held: true; lease: LeaseRecord } | { held: false; cause: LossCause };

export interface AcquireInput extends SessionKey {
  runId: string;
  ttlMs: number;
  holder: string;
}

export interface ListPage {
  leases: LeaseRecord[];
  /** The session_id to continue after, when there may be more. */
  nextAfter: string | undefined;
}

/** What a resource asks in live mode (CheckFence). */
export interface FenceState {
  /** The token is the one of the key's valid lease. */
  current: boolean;
  /** The highest token ever granted for the key; 0 when none is on record. */
  highestToken: bigint;
}

export interface LeaseStore {
  /** Grants the key to runId if it is free or already runId's (S2, S3, S6). */
  acquire(input: AcquireInput): Promise<AcquireResult>;
  /** Extends runId's valid lease (S4); otherwise names why it is not held. */
  renew(key: SessionKey, runId: string, ttlMs: number | undefined): Promise<RenewResult>;
  /** Ends runId's valid lease, keeping a tombstone (S5). False when not held. */
  release(key: SessionKey, runId: string): Promise<LeaseRecord | undefined>;
  /** Ends the valid lease of any run, audited with the reason. */
  revoke(key: SessionKey, reason: string): Promise<LeaseRecord | undefined>;
  /** The valid lease of the key, if any. */
  get(key: SessionKey): Promise<LeaseRecord | undefined>;
  /** Valid leases of an account, by session_id, after `after`. */
  list(accountId: string, limit: number, after: string | undefined): Promise<ListPage>;
  /** Whether `token` belongs to the key's valid lease, and the highest token granted. */
  checkFence(key: SessionKey, token: bigint): Promise<FenceState>;
}

/** Creates the store over a postgres.js pool built by `openDatabase`. */
export function createLeaseStore(sql: Sql): LeaseStore {
  // Columns of a lease as LeaseRecord wants them, relative to a clock reading.
  const leaseColumns = (t: string) => sql`
    ${sql(t)}.account_id, ${sql(t)}.session_id, ${sql(t)}.run_id, ${sql(t)}.fencing_token,
    ${sql(t)}.holder,
    (extract(epoch FROM ${sql(t)}.ttl) * 1000)::bigint AS ttl_ms,
    (extract(epoch FROM ${sql(t)}.acquired_at) * 1000000)::bigint AS acquired_at_us,
    (extract(epoch FROM ${sql(t)}.expires_at) * 1000000)::bigint AS expires_at_us,
    (extract(epoch FROM greatest(${sql(t)}.expires_at - lease_clock.observed_at, interval '0'))
      * 1000000)::bigint AS remaining_us`;

  const run = async <T>(statement: () => Promise<T>): Promise<T> => {
    try {
      return await statement();
    } catch (error) {
      throw classifyDatabaseError(error);
    }
  };

  return {
    acquire: (input) =>
      run(async () => {
        // When the blocking lease ends between the UPSERT and the read of
        // `current`, the key is free: try again rather than answer "not
        // acquired" with nobody to name. Bounded: a key that keeps changing
        // hands answers not acquired.
        for (let attempt = 0; ; attempt++) {
          const result = await acquireOnce(input);
          if (result.acquired || result.current || attempt === 2) return result;
        }
      }),

    renew: (key, runId, ttlMs) =>
      run(async () => {
        // S4: key + run_id + not expired. A late renewal of an expired run
        // matches nothing, even when nobody has taken the session over.
        const newTtl = ttlMs === undefined ? null : ttlMs;
        const rows = await sql<LeaseRecord[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          renewed AS (
            UPDATE leases AS held SET
              ttl = coalesce(${newTtl}::bigint * interval '1 millisecond', held.ttl),
              expires_at = lease_clock.observed_at
                + coalesce(${newTtl}::bigint * interval '1 millisecond', held.ttl)
            FROM lease_clock
            WHERE held.account_id = ${key.accountId} AND held.session_id = ${key.sessionId}
              AND held.run_id = ${runId}::uuid AND held.expires_at > lease_clock.observed_at
            RETURNING held.*
          )
          SELECT ${leaseColumns("renewed")} FROM renewed, lease_clock`;
        const lease = rows[0];
        if (lease) return { held: true, lease };
        return { held: false, cause: await lossCause(key, runId) };
      }),

    release: (key, runId) =>
      run(async () => {
        // S5: key + run_id + still valid. Tombstone, not DELETE (S6).
        const rows = await sql<LeaseRecord[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          ended AS (
            -- S1, S6: a statement that waited on the row lock may find a lease
            -- granted after its clock reading; ending it before it began would
            -- put this grant's interval out of order with the next one's.
            UPDATE leases AS held
            SET expires_at = greatest(lease_clock.observed_at, held.acquired_at), ended = 'released'
            FROM lease_clock
            WHERE held.account_id = ${key.accountId} AND held.session_id = ${key.sessionId}
              AND held.run_id = ${runId}::uuid AND held.expires_at > lease_clock.observed_at
            RETURNING held.*
          ),
          audit AS (
            INSERT INTO lease_events (account_id, session_id, type, run_id, fencing_token, holder, at)
            SELECT account_id, session_id, 'released', run_id, fencing_token, holder, expires_at
            FROM ended
          )
          SELECT ${leaseColumns("ended")} FROM ended, lease_clock`;
        return rows[0];
      }),

    revoke: (key, reason) =>
      run(async () => {
        const rows = await sql<LeaseRecord[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          ended AS (
            -- S1, S6: a statement that waited on the row lock may find a lease
            -- granted after its clock reading; ending it before it began would
            -- put this grant's interval out of order with the next one's.
            UPDATE leases AS held
            SET expires_at = greatest(lease_clock.observed_at, held.acquired_at), ended = 'revoked'
            FROM lease_clock
            WHERE held.account_id = ${key.accountId} AND held.session_id = ${key.sessionId}
              AND held.expires_at > lease_clock.observed_at
            RETURNING held.*
          ),
          audit AS (
            INSERT INTO lease_events
              (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
            SELECT account_id, session_id, 'revoked', run_id, fencing_token, holder, ${reason},
                   expires_at
            FROM ended
          )
          SELECT ${leaseColumns("ended")} FROM ended, lease_clock`;
        return rows[0];
      }),

    get: (key) => run(() => getValid(key)),

    list: (accountId, limit, after) =>
      run(async () => {
        const rows = await sql<LeaseRecord[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
          SELECT ${leaseColumns("leases")}
          FROM leases, lease_clock
          WHERE leases.account_id = ${accountId}
            AND leases.session_id > ${after ?? ""}
            AND leases.expires_at > lease_clock.observed_at
          ORDER BY leases.session_id
          LIMIT ${limit + 1}`;
        const more = rows.length > limit;
        const leases = more ? rows.slice(0, limit) : [...rows];
        return { leases, nextAfter: more ? leases.at(-1)?.sessionId : undefined };
      }),

    checkFence: (key, token) =>
      run(async () => {
        // S6 makes the key's one row (valid lease or tombstone) carry the
        // newest grant, whose token is the highest ever granted for the key.
        // S9: validity is decided with the database clock, read once.
        const rows = await sql<FenceState[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
          SELECT leases.fencing_token AS highest_token,
                 (leases.fencing_token = ${token}
                  AND leases.expires_at > lease_clock.observed_at) AS current
          FROM leases, lease_clock
          WHERE leases.account_id = ${key.accountId} AND leases.session_id = ${key.sessionId}`;
        return rows[0] ?? { current: false, highestToken: 0n };
      }),
  };

  async function acquireOnce(input: AcquireInput): Promise<AcquireResult> {
    const ttl = input.ttlMs;
    // S2: one conditional UPSERT; the primary key decides between racers.
    // S3: DO UPDATE applies only to an expired/ended row, or to the same
    //     run re-acquiring (an idempotent retry that keeps its token).
    // S6: a takeover draws its token inside DO UPDATE SET, i.e. under the
    //     row lock, so tokens follow grant order. Tombstones make every
    //     re-acquire take this path.
    // S9: observed_at is read once; a statement that waited on the row
    //     lock decides with the earlier instant and counts the deadline
    //     from it: both err on the safe side.
    const rows = await sql<(LeaseRecord & { retried: boolean })[]>`
        WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
        granted AS (
          INSERT INTO leases AS held
            (account_id, session_id, run_id, fencing_token, holder, ttl, acquired_at, expires_at)
          SELECT ${input.accountId}, ${input.sessionId}, ${input.runId}::uuid,
                 nextval('lease_fencing_token'), ${input.holder},
                 ${ttl}::bigint * interval '1 millisecond', observed_at,
                 observed_at + ${ttl}::bigint * interval '1 millisecond'
          FROM lease_clock
          ON CONFLICT (account_id, session_id) DO UPDATE SET
            run_id = EXCLUDED.run_id,
            fencing_token = CASE
              WHEN held.run_id = EXCLUDED.run_id AND held.expires_at > EXCLUDED.acquired_at
              THEN held.fencing_token
              ELSE nextval('lease_fencing_token') END,
            acquired_at = CASE
              WHEN held.run_id = EXCLUDED.run_id AND held.expires_at > EXCLUDED.acquired_at
              THEN held.acquired_at
              ELSE EXCLUDED.acquired_at END,
            holder = EXCLUDED.holder,
            ttl = EXCLUDED.ttl,
            expires_at = EXCLUDED.expires_at,
            ended = NULL,
            -- Read by this statement's audit insert below: RETURNING sees
            -- only the new row.
            previous_run_id = held.run_id,
            previous_fencing_token = held.fencing_token,
            previous_holder = held.holder,
            previous_ended = held.ended,
            previous_expires_at = held.expires_at
          WHERE held.expires_at <= EXCLUDED.acquired_at
             OR held.run_id = EXCLUDED.run_id
          RETURNING held.*
        ),
        audit AS (
          INSERT INTO lease_events (account_id, session_id, type, run_id, fencing_token, holder, at)
          SELECT g.account_id, g.session_id, 'expired', g.previous_run_id,
                 g.previous_fencing_token, g.previous_holder, g.previous_expires_at
          FROM granted g
          WHERE g.previous_fencing_token IS DISTINCT FROM g.fencing_token
            AND g.previous_run_id IS NOT NULL AND g.previous_ended IS NULL
          UNION ALL
          SELECT g.account_id, g.session_id, 'acquired', g.run_id, g.fencing_token, g.holder,
                 g.acquired_at
          FROM granted g
          WHERE g.previous_fencing_token IS DISTINCT FROM g.fencing_token
        )
        SELECT ${leaseColumns("granted")},
               granted.acquired_at < lease_clock.observed_at AS retried
        FROM granted, lease_clock`;
    const granted = rows[0];
    if (granted) {
      const { retried, ...lease } = granted;
      return { acquired: true, lease, retried };
    }
    return { acquired: false, current: await getValid(input) };
  }

  async function getValid(key: SessionKey): Promise<LeaseRecord | undefined> {
    const rows = await sql<LeaseRecord[]>`
      WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
      SELECT ${leaseColumns("leases")}
      FROM leases, lease_clock
      WHERE leases.account_id = ${key.accountId} AND leases.session_id = ${key.sessionId}
        AND leases.expires_at > lease_clock.observed_at`;
    return rows[0];
  }

  // Only explains a renewal that already failed; it decides nothing.
  async function lossCause(key: SessionKey, runId: string): Promise<LossCause> {
    const rows = await sql<{ runId: string; ended: string | null }[]>`
      SELECT run_id, ended FROM leases
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    const row = rows[0];
    if (!row) return "not_found";
    if (row.runId !== runId) return "taken_over";
    if (row.ended === "released") return "released";
    if (row.ended === "revoked") return "revoked";
    return "expired";
  }
}
