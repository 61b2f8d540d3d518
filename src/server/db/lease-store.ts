// All lease SQL (DESIGN §3). Every statement reads the database clock once,
// in a materialized `lease_clock` CTE, and decides with that instant (S9).
// Statements run in autocommit: no transaction spans a holder's work.

import type { LossCause } from "../../protocol/errors.js";
import type {
  AcquireInput,
  AcquireResult,
  EndedLease,
  FenceState,
  LeaseRecord,
  LeaseStore,
  RenewManyResult,
  SessionKey,
  SessionRow,
} from "../lease/types.js";
import { classifyDatabaseError } from "./database-errors.js";
import type { Sql } from "./pool.js";

interface RenewManyRow extends LeaseRecord {
  idx: number;
  renewed: boolean;
  currentExists: boolean;
  currentRunId: string | null;
  currentEnded: string | null;
  currentValid: boolean;
  handoffRequester: string | null;
  handoffReason: string | null;
  handoffAtUs: bigint | null;
  handoffEventId: bigint | null;
}

function pickLease(row: LeaseRecord): LeaseRecord {
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
  };
}

interface AcquireExtras {
  retried: boolean;
  eventId: bigint;
  expiredEventId: bigint | null;
  expiredRunId: string | null;
  expiredFencingToken: bigint | null;
  expiredHolder: string | null;
  expiredExpiresAtUs: bigint | null;
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

    renewMany: (items, options) =>
      run(async () => {
        if (items.length === 0) return [];
        // Renewals of every KeepAlive stream of this instance, one statement
        // per tick (DESIGN §3), so throughput is not bound by commit latency.
        // S4 exactly as in `renew`: key + run_id + not expired, at one clock
        // reading. Rows are locked in key order, and with SKIP LOCKED a row
        // held by another transaction (a stuck one, S8) is left out instead
        // of stalling the batch; the caller retries it alone, with waiting.
        const rows = await sql<RenewManyRow[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          wanted AS MATERIALIZED (
            SELECT * FROM unnest(
              ${items.map((_, i) => i)}::int[],
              ${items.map((i) => i.accountId)}::text[],
              ${items.map((i) => i.sessionId)}::text[],
              ${items.map((i) => i.runId)}::uuid[],
              ${items.map((i) => (i.ttlMs === undefined ? null : i.ttlMs))}::bigint[],
              ${items.map((i) => (i.lookupHandoff ? 1 : 0))}::int[]
            ) AS w(idx, account_id, session_id, run_id, ttl_ms, lookup_handoff)
          ),
          -- LATERAL keeps every lookup an index probe by primary key, and
          -- the update a TID scan: a join would let the planner hash the
          -- whole table for each batch (35 ms per statement at 50,000 rows).
          locked AS MATERIALIZED (
            SELECT w.idx, w.ttl_ms, held.ctid AS row_id
            FROM (SELECT * FROM wanted ORDER BY account_id, session_id) w
            CROSS JOIN LATERAL (
              SELECT l.ctid FROM leases l
              WHERE l.account_id = w.account_id AND l.session_id = w.session_id
                AND l.run_id = w.run_id
                AND l.expires_at > (SELECT observed_at FROM lease_clock)
              FOR UPDATE ${options.wait ? sql`` : sql`SKIP LOCKED`}
            ) held
          ),
          renewed AS (
            -- The locked row versions, by ctid: stable while the lock is held.
            -- A row changed by a transaction that committed after this
            -- statement began is not seen here and is answered busy.
            UPDATE leases AS held SET
              ttl = coalesce(k.ttl_ms * interval '1 millisecond', held.ttl),
              expires_at = lease_clock.observed_at
                + coalesce(k.ttl_ms * interval '1 millisecond', held.ttl)
            FROM locked k, lease_clock
            WHERE held.ctid = ANY (ARRAY(SELECT row_id FROM locked))
              AND held.ctid = k.row_id AND held.expires_at > lease_clock.observed_at
            RETURNING k.idx, held.*
          )
          SELECT w.idx, r.idx IS NOT NULL AS renewed,
                 ${leaseColumns("r")},
                 cur.account_id IS NOT NULL AS current_exists,
                 cur.run_id AS current_run_id,
                 cur.ended AS current_ended,
                 coalesce(cur.expires_at > lease_clock.observed_at, false) AS current_valid,
                 h.holder AS handoff_requester, h.reason AS handoff_reason,
                 h.at_us AS handoff_at_us, h.id AS handoff_event_id
          FROM wanted w
          CROSS JOIN lease_clock
          LEFT JOIN renewed r ON r.idx = w.idx
          -- Read at the statement's snapshot: explains a renewal that did
          -- not happen; it decides nothing.
          LEFT JOIN LATERAL (
            SELECT c.account_id, c.run_id, c.ended, c.expires_at FROM leases c
            WHERE r.idx IS NULL AND c.account_id = w.account_id AND c.session_id = w.session_id
            OFFSET 0 -- keeps it a per-row probe, skipped for renewed rows
          ) cur ON true
          LEFT JOIN LATERAL (
            SELECT e.id, e.holder, e.reason, (extract(epoch FROM e.at) * 1000000)::bigint AS at_us
            FROM lease_events e
            WHERE w.lookup_handoff = 1 AND r.idx IS NOT NULL
              AND e.account_id = w.account_id AND e.session_id = w.session_id
              AND e.type = 'handoff_requested' AND e.fencing_token = r.fencing_token
            ORDER BY e.id DESC
            LIMIT 1
          ) h ON true
          ORDER BY w.idx`;
        return rows.map((row, i): RenewManyResult => {
          const item = items[i];
          if (row.renewed) {
            const handoff =
              row.handoffEventId === null
                ? undefined
                : {
                    requesterHolder: row.handoffRequester ?? "",
                    reason: row.handoffReason ?? "",
                    atUs: row.handoffAtUs ?? 0n,
                    eventId: row.handoffEventId,
                  };
            return { outcome: "renewed", lease: pickLease(row), handoff };
          }
          if (!row.currentExists) return { outcome: "lost", cause: "not_found" };
          if (row.currentRunId !== item?.runId) return { outcome: "lost", cause: "taken_over" };
          if (row.currentEnded === "released") return { outcome: "lost", cause: "released" };
          if (row.currentEnded === "revoked") return { outcome: "lost", cause: "revoked" };
          if (!row.currentValid) return { outcome: "lost", cause: "expired" };
          return { outcome: "busy" };
        });
      }),

    requestHandoff: (key, requesterHolder, reason) =>
      run(async () => {
        // S3: only reads the lease and appends to the audit trail; a handoff
        // request never ends or changes a lease. In lease_events the row's
        // `holder` is the requester (who acted); the asked lease's holder is
        // on its 'acquired' row, found by fencing_token.
        const rows = await sql<(LeaseRecord & { eventId: bigint; atUs: bigint })[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          asked AS (
            SELECT leases.* FROM leases, lease_clock
            WHERE leases.account_id = ${key.accountId} AND leases.session_id = ${key.sessionId}
              AND leases.expires_at > lease_clock.observed_at
          ),
          recorded AS (
            INSERT INTO lease_events
              (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
            SELECT account_id, session_id, 'handoff_requested', run_id, fencing_token,
                   ${requesterHolder}, ${reason}, observed_at
            FROM asked, lease_clock
            RETURNING id, at
          )
          SELECT ${leaseColumns("asked")}, recorded.id AS event_id,
                 (extract(epoch FROM recorded.at) * 1000000)::bigint AS at_us
          FROM asked, recorded, lease_clock`;
        const row = rows[0];
        if (!row) return { lease: undefined, eventId: 0n, atUs: 0n };
        const { eventId, atUs, ...lease } = row;
        return { lease, eventId, atUs };
      }),

    readScopes: (scopes) =>
      run(async () => {
        const keys = scopes.filter((s) => s.sessionId !== "");
        const accounts = [
          ...new Set(scopes.filter((s) => s.sessionId === "").map((s) => s.accountId)),
        ];
        // Exact keys and whole accounts are matched separately so that a
        // key scope reads one index entry, not its account's whole range.
        const rows = await sql<(Partial<SessionRow> & { observedAtUs: bigint })[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          matched AS (
            SELECT l.* FROM leases l
            JOIN unnest(${keys.map((k) => k.accountId)}::text[],
                        ${keys.map((k) => k.sessionId)}::text[]) AS w(account_id, session_id)
              ON l.account_id = w.account_id AND l.session_id = w.session_id
            UNION
            SELECT l.* FROM leases l
            WHERE l.account_id = ANY(${accounts}::text[])
          )
          SELECT (extract(epoch FROM lease_clock.observed_at) * 1000000)::bigint AS observed_at_us,
                 found.*
          FROM lease_clock
          LEFT JOIN LATERAL (
            SELECT ${leaseColumns("l")},
                   l.expires_at > lease_clock.observed_at AS valid,
                   l.ended, ev.id AS end_event_id, ev.reason AS end_reason
            FROM matched l
            LEFT JOIN LATERAL (
              SELECT e.id, e.reason FROM lease_events e
              WHERE l.ended IS NOT NULL AND l.expires_at <= lease_clock.observed_at
                AND e.account_id = l.account_id AND e.session_id = l.session_id
                AND e.type = l.ended AND e.fencing_token = l.fencing_token
              ORDER BY e.id DESC
              LIMIT 1
            ) ev ON true
          ) found ON true
          ORDER BY found.account_id, found.session_id`;
        const observedAtUs = rows[0]?.observedAtUs ?? 0n;
        const found: SessionRow[] = [];
        for (const { observedAtUs: _, ...row } of rows) {
          if (row.accountId !== undefined && row.accountId !== null) found.push(row as SessionRow);
        }
        return { rows: found, observedAtUs };
      }),

    release: (key, runId) =>
      run(async () => {
        // S5: key + run_id + still valid. Tombstone, not DELETE (S6).
        const rows = await sql<EndedLease[]>`
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
            RETURNING id
          )
          SELECT ${leaseColumns("ended")}, audit.id AS event_id FROM ended, audit, lease_clock`;
        return rows[0];
      }),

    revoke: (key, reason) =>
      run(async () => {
        const rows = await sql<EndedLease[]>`
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
            RETURNING id
          )
          SELECT ${leaseColumns("ended")}, audit.id AS event_id FROM ended, audit, lease_clock`;
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
    const rows = await sql<(LeaseRecord & AcquireExtras)[]>`
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
          RETURNING id, type
        )
        SELECT ${leaseColumns("granted")},
               granted.acquired_at < lease_clock.observed_at AS retried,
               coalesce((SELECT id FROM audit WHERE type = 'acquired'), 0) AS event_id,
               (SELECT id FROM audit WHERE type = 'expired') AS expired_event_id,
               granted.previous_run_id AS expired_run_id,
               granted.previous_fencing_token AS expired_fencing_token,
               granted.previous_holder AS expired_holder,
               (extract(epoch FROM granted.previous_expires_at) * 1000000)::bigint
                 AS expired_expires_at_us
        FROM granted, lease_clock`;
    const granted = rows[0];
    if (granted) {
      const {
        retried,
        eventId,
        expiredEventId,
        expiredRunId,
        expiredFencingToken,
        expiredHolder,
        expiredExpiresAtUs,
        ...lease
      } = granted;
      // The audit wrote an 'expired' row exactly when this grant replaced an
      // unreleased lease past its deadline; watchers get the same event.
      const expired =
        expiredEventId !== null &&
        expiredRunId !== null &&
        expiredFencingToken !== null &&
        expiredExpiresAtUs !== null
          ? {
              runId: expiredRunId,
              fencingToken: expiredFencingToken,
              holder: expiredHolder ?? "",
              expiresAtUs: expiredExpiresAtUs,
              eventId: expiredEventId,
            }
          : undefined;
      return { acquired: true, lease, retried, eventId, expired };
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
