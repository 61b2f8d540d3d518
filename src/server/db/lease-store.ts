// The lease store on PostgreSQL (DESIGN §3): the LeaseStore of src/lease/types.ts.
// Every statement reads the database clock once, in a materialized
// `lease_clock` CTE, and decides with that instant (S9). Statements run in
// autocommit: no transaction spans a holder's work.
//
// Acquire, Release, Renew and Get are group-committed (group-commit.ts):
// concurrent calls of one kind share one multi-row statement, so a busy
// server commits a few statements where it would otherwise commit one per
// call; a call alone gets a lighter single-row statement. Each row of a batch
// is decided exactly as it would be alone (the statements are in
// acquire-statement.ts, end-statement.ts, renew-statement.ts). A row another
// transaction holds is left out (SKIP LOCKED, or NOWAIT for one row) and
// decided alone, waiting on its lock up to lock_timeout, outside the batch
// (S8); a batch that fails on a lock (a new key inserted, uncommitted, by a
// stuck transaction; a deadlock) is decided row by row the same way, so only
// the stuck key fails.

import {
  DatabaseUnavailableError,
  endedLeaseNotReacquired,
  KeeperNotHeldError,
  ResourceExhaustedError,
} from "../../lease/errors.js";
import type {
  AcquireInput,
  AcquireResult,
  EndedLease,
  FenceState,
  LeaseRecord,
  LeaseStore,
  RenewItem,
  RenewManyResult,
  RenewResult,
  SessionKey,
  SessionRow,
} from "../../lease/types.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";
import type { Sql } from "../../postgres/pool.js";
import { LimitName } from "../../protocol/errors.js";
import { acquireMany, acquireOne } from "./acquire-statement.js";
import { type EndItem, type EndOutcome, endMany, endOne } from "./end-statement.js";
import { createGroupCommit, type GroupCommitStats } from "./group-commit.js";
import { keeperEnd } from "./keeper-store.js";
import { keeperValid, leaseColumns, leaseOf } from "./lease-columns.js";
import { renewMany, renewOne } from "./renew-statement.js";
import type { StatementTracer } from "./statement-tracer.js";

export interface LeaseStoreOptions {
  /** Valid leases one account may hold at once; 0 (the default) means no quota. */
  maxLeasesPerAccount?: number;
  /** Open leases one keeper may hold at once; 0 (the default) means no limit. */
  maxLeasesPerKeeper?: number;
  /** Rows per group-committed statement. */
  maxBatch?: number;
  /** Group-committed statements of one kind in flight at once. */
  maxInFlight?: number;
  /**
   * A statement unanswered this long fails with UNAVAILABLE (0: never).
   * statement_timeout bounds a statement the server runs; this bounds one
   * whose connection went quiet (a partitioned or failed-over database),
   * which would otherwise hold its batch slot, and every call queued behind
   * it, until TCP gives up.
   */
  unansweredAfterMs?: number;
  /** Traces each group-committed statement, linked to the calls it decides (unset: tracing off). */
  tracer?: StatementTracer;
}

/** The statements and rows of each group-committed kind, for tests and benchmarks. */
export interface LeaseStoreStats {
  acquire: GroupCommitStats;
  release: GroupCommitStats;
  renew: GroupCommitStats;
  get: GroupCommitStats;
}

// A row that stays locked through this many waiting attempts is reported as
// the database being unable to decide.
const maxAttempts = 3;

const keyOf = (k: SessionKey) => `${k.accountId} ${k.sessionId}`;

/** A statement failed on a row lock (lock_timeout, deadlock). */
function lockConflict(error: unknown): boolean {
  return (
    error instanceof DatabaseUnavailableError &&
    (error.sqlState === "55P03" || error.sqlState === "40P01")
  );
}

/** Creates the store over a postgres.js pool built by `openDatabase`. */
export function createLeaseStore(
  sql: Sql,
  options: LeaseStoreOptions = {},
): LeaseStore & { readonly stats: LeaseStoreStats } {
  const maxLeasesPerAccount = options.maxLeasesPerAccount ?? 0;
  const maxBatch = options.maxBatch ?? 500;
  const maxInFlight = options.maxInFlight ?? 1;
  const maxLeasesPerKeeper = options.maxLeasesPerKeeper ?? 0;
  const quota = { maxLeasesPerAccount, maxLeasesPerKeeper };
  const tracer = options.tracer;

  const unansweredAfterMs = options.unansweredAfterMs ?? 0;
  const unanswered = () =>
    new DatabaseUnavailableError(
      `the database did not answer within ${unansweredAfterMs} ms; whether the change was made is unknown: retry (with the same run_id a retry is idempotent)`,
    );

  const run = async <T>(statement: () => Promise<T>): Promise<T> => {
    let timer: NodeJS.Timeout | undefined;
    try {
      const answer = statement();
      if (unansweredAfterMs <= 0) return await answer;
      // The statement goes on if it is still running; its late outcome, if
      // any, is dropped (a change it made is what a retry finds).
      answer.catch(() => {});
      return await Promise.race([
        answer,
        new Promise<never>((_, reject) => {
          timer = setTimeout(() => reject(unanswered()), unansweredAfterMs);
        }),
      ]);
    } catch (error) {
      throw classifyDatabaseError(error);
    } finally {
      clearTimeout(timer);
    }
  };

  /**
   * One statement for a group-committed batch: the single-row form for one
   * call (lighter), the multi-row form for more. Neither waits on a row lock
   * another transaction holds: such a row comes back `busy`. A batch that
   * failed on a lock anyway (a new key inserted, uncommitted, by a stuck
   * transaction; a deadlock) comes back `busy` whole. Busy rows are then
   * decided one by one, waiting on their locks, outside the batch, so the
   * calls queued behind it are not held up (S8).
   */
  const batch =
    <I, R>(
      one: (item: I) => Promise<R | { outcome: "busy" }>,
      many: (items: readonly I[]) => Promise<(R | { outcome: "busy" })[]>,
    ) =>
    async (items: readonly I[]): Promise<(R | { outcome: "busy" })[]> => {
      try {
        return await run(async () =>
          items.length === 1 ? [await one(items[0] as I)] : await many(items),
        );
      } catch (error) {
        if (!lockConflict(error)) throw error;
        return items.map(() => ({ outcome: "busy" as const }));
      }
    };

  const acquireBatch = createGroupCommit({
    run: batch(
      (item: AcquireInput) => acquireOne(sql, item, { wait: false, ...quota }),
      (items) => acquireMany(sql, items, { wait: false, ...quota }),
    ),
    keyOf,
    maxBatch,
    maxInFlight,
    tracer,
    operation: "acquire",
  });
  const releaseBatch = createGroupCommit({
    run: batch(
      (item: EndItem) => endOne(sql, item, { wait: false }),
      (items) => endMany(sql, items, { wait: false }),
    ),
    keyOf,
    maxBatch,
    maxInFlight,
    tracer,
    operation: "release",
  });
  const renewBatch = createGroupCommit({
    run: batch(
      (item: RenewItem) => renewOne(sql, item, { wait: false }),
      (items) => renewMany(sql, items, { wait: false }),
    ),
    keyOf,
    maxBatch,
    maxInFlight,
    tracer,
    operation: "renew",
  });
  const getBatch = createGroupCommit<SessionKey, LeaseRecord | undefined>({
    run: (keys) => run(() => getMany(sql, keys)),
    keyOf,
    maxBatch,
    maxInFlight,
    // Gets of one key waiting together share one reading of it.
    shareByKey: true,
    tracer,
    operation: "get",
  });

  const stillLocked = () =>
    new DatabaseUnavailableError(
      "the session's lease row stayed locked by other transactions; retry",
    );

  return {
    stats: {
      acquire: acquireBatch.stats,
      release: releaseBatch.stats,
      renew: renewBatch.stats,
      get: getBatch.stats,
    },

    async acquire(input): Promise<AcquireResult> {
      let outcome = await acquireBatch.submit(input);
      for (let attempt = 1; ; attempt++) {
        switch (outcome.outcome) {
          case "granted":
            return {
              acquired: true,
              lease: outcome.lease,
              retried: outcome.retried,
              eventId: outcome.eventId,
              expired: outcome.expired,
            };
          case "held":
            return { acquired: false, current: outcome.current };
          case "delayed":
            return { acquired: false, current: undefined, lockDelayUntilUs: outcome.untilUs };
          case "ended":
            throw endedLeaseNotReacquired(input.runId, outcome.cause);
          case "quota":
            throw new ResourceExhaustedError(
              `the account holds ${maxLeasesPerAccount} leases, the most its quota (--max-leases-per-account) allows: release one first`,
              LimitName.leasesPerAccount,
              maxLeasesPerAccount,
            );
          case "keeper":
            throw new KeeperNotHeldError(
              input.keeperId ?? "",
              await run(() => keeperEnd(sql, input.accountId, input.keeperId ?? "")),
            );
          case "keeper_full":
            throw new ResourceExhaustedError(
              `keeper ${input.keeperId} holds ${maxLeasesPerKeeper} leases, the most --max-leases-per-keeper allows: release one first, or open another keeper`,
              LimitName.leasesPerKeeper,
              maxLeasesPerKeeper,
            );
          case "refused": {
            // Refused by a valid lease that RETURNING could not show: read it.
            // When it ended meanwhile, the key is free: decide it again.
            const current = await run(() => getOne(sql, input));
            if (current || attempt >= maxAttempts) return { acquired: false, current };
            break;
          }
          case "busy":
            if (attempt >= maxAttempts) throw stillLocked();
            break;
          case "unknown":
            // A concurrent grant inserted the key after the batch's snapshot.
            if (attempt >= maxAttempts) return { acquired: false, current: undefined };
            break;
        }
        outcome = await run(() => acquireOne(sql, input, { wait: true, ...quota }));
      }
    },

    async renew(key, runId, ttlMs): Promise<RenewResult> {
      const item: RenewItem = { ...key, runId, ttlMs, lookupHandoff: false };
      let result = await renewBatch.submit(item);
      for (let attempt = 1; result.outcome === "busy"; attempt++) {
        if (attempt >= maxAttempts) throw stillLocked();
        result = await run(() => renewOne(sql, item, { wait: true }));
      }
      if (result.outcome === "renewed") return { held: true, lease: result.lease };
      if (result.cause !== "taken_over") return { held: false, cause: result.cause };
      // Another run's lease: say whether this run ever held the session
      // (the audit trail keeps its grant) or never did.
      const [held] = await run(
        () => sql<{ found: boolean }[]>`
          SELECT EXISTS (
            SELECT 1 FROM lease_events
            WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
              AND type = 'acquired' AND run_id = ${runId}::uuid
          ) AS found`,
      );
      return { held: false, cause: held?.found ? "taken_over" : "never_held" };
    },

    // Waiting (the batcher's retry of a locked row): row by row, by key, so
    // that a renewal that waited re-checks its guard on the version it
    // locked and decides; the batched form updates by ctid and, after a
    // wait, could only answer busy again.
    renewMany: (items, opts) =>
      run(async () => {
        if (!opts.wait) return renewMany(sql, items, opts);
        const results: RenewManyResult[] = [];
        for (const item of items) results.push(await renewOne(sql, item, opts));
        return results;
      }),

    async release(key, runId, grant): Promise<EndedLease | undefined> {
      const item: EndItem = {
        accountId: key.accountId,
        sessionId: key.sessionId,
        runId,
        ended: "released",
        reason: undefined,
        grant,
      };
      return endResult(await releaseBatch.submit(item), item);
    },

    async revoke(key, reason): Promise<EndedLease | undefined> {
      const item: EndItem = { ...key, runId: undefined, ended: "revoked", reason };
      return endResult(await run(() => endOne(sql, item, { wait: true })), item);
    },

    get: (key) => getBatch.submit(key),

    lockDelayUntil: (key) =>
      run(async () => {
        // K2: an open lease on a keeper that expired (marked or not), its
        // delay not over. A read: the marking is left to the takeover.
        const [row] = await sql<{ untilUs: bigint }[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
          SELECT (extract(epoch FROM k.expires_at + k.lock_delay) * 1000000)::bigint AS until_us
          FROM leases l
          JOIN keepers k ON k.id = l.keeper_id
          CROSS JOIN lease_clock c
          WHERE l.account_id = ${key.accountId} AND l.session_id = ${key.sessionId}
            AND l.ended IS NULL AND l.expires_at = 'infinity'
            AND (k.ended = 'expired' OR (k.ended IS NULL AND k.expires_at <= c.observed_at))
            AND k.expires_at + k.lock_delay > c.observed_at`;
        return row?.untilUs;
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
              AND ${keeperValid(sql, "leases", sql`lease_clock.observed_at`)}
          ),
          recorded AS (
            INSERT INTO lease_events
              (account_id, session_id, type, run_id, fencing_token, holder, reason, at)
            SELECT account_id, session_id, 'handoff_requested', run_id, fencing_token,
                   ${requesterHolder}, ${reason}, observed_at
            FROM asked, lease_clock
            RETURNING id, at
          )
          SELECT ${leaseColumns(sql, "asked")}, recorded.id AS event_id,
                 (extract(epoch FROM recorded.at) * 1000000)::bigint AS at_us
          FROM asked, recorded, lease_clock`;
        const row = rows[0];
        if (!row) return { lease: undefined, eventId: 0n, atUs: 0n };
        const { eventId, atUs, ...lease } = row;
        return { lease, eventId, atUs };
      }),

    readScopes: (scopes, options) =>
      run(async () => {
        const keys = scopes.filter((s) => s.sessionId !== "");
        const accounts = [
          ...new Set(scopes.filter((s) => s.sessionId === "").map((s) => s.accountId)),
        ];
        // Exact keys and whole accounts are matched separately so that a
        // key scope reads one index entry, not its account's whole range.
        const keyed = () => sql`
          SELECT l.* FROM leases l
          JOIN unnest(${keys.map((k) => k.accountId)}::text[],
                      ${keys.map((k) => k.sessionId)}::text[]) AS w(account_id, session_id)
            ON l.account_id = w.account_id AND l.session_id = w.session_id`;
        const accountWide = sql`
          SELECT l.* FROM leases l WHERE l.account_id = ANY(${accounts}::text[])`;
        // skipWritten: a key's row is read under FOR SHARE SKIP LOCKED, which
        // gives its latest committed version; a row a transaction is writing
        // is skipped (never waited for: one stuck writer must not hold up the
        // other keys) and named in `written`. Keepers: a lease on a keeper
        // is renewed by its keeper's heartbeat, which writes the keeper's row,
        // not the lease's; while that row is being written the lease counts
        // as written too (a keeper row that no longer exists does not).
        const skipWritten = options?.skipWritten === true;
        const matched = skipWritten
          ? sql`keyed_rows AS (${keyed()} FOR SHARE OF l SKIP LOCKED),
                keeper_written AS (
                  SELECT r.account_id, r.session_id FROM keyed_rows r
                  WHERE r.keeper_id IS NOT NULL AND r.ended IS NULL AND r.expires_at = 'infinity'
                    AND EXISTS (SELECT 1 FROM keepers kp WHERE kp.id = r.keeper_id)
                    AND NOT EXISTS (SELECT 1 FROM keepers kp WHERE kp.id = r.keeper_id
                                    FOR SHARE SKIP LOCKED)
                ),
                keyed AS (
                  SELECT * FROM keyed_rows r
                  WHERE NOT EXISTS (SELECT 1 FROM keeper_written w
                                    WHERE w.account_id = r.account_id AND w.session_id = r.session_id)
                ),
                written AS (
                  SELECT p.account_id, p.session_id FROM (${keyed()}) p
                  WHERE NOT EXISTS (SELECT 1 FROM keyed k
                                    WHERE k.account_id = p.account_id AND k.session_id = p.session_id)
                ),
                matched AS (SELECT * FROM keyed UNION ${accountWide})`
          : sql`matched AS (${keyed()} UNION ${accountWide})`;
        const rows = await sql<
          (Partial<SessionRow> & { observedAtUs: bigint; writtenKeys: [string, string][] | null })[]
        >`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at),
          ${matched}
          SELECT (extract(epoch FROM lease_clock.observed_at) * 1000000)::bigint AS observed_at_us,
                 ${
                   skipWritten
                     ? sql`(SELECT json_agg(json_build_array(account_id, session_id)) FROM written)`
                     : sql`NULL::json`
                 } AS written_keys,
                 found.*
          FROM lease_clock
          LEFT JOIN LATERAL (
            SELECT ${leaseColumns(sql, "l")},
                   l.expires_at > lease_clock.observed_at
                     AND ${keeperValid(sql, "l", sql`lease_clock.observed_at`)} AS valid,
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
        const written = (rows[0]?.writtenKeys ?? []).map(([accountId, sessionId]) => ({
          accountId,
          sessionId,
        }));
        const found: SessionRow[] = [];
        for (const { observedAtUs: _, writtenKeys: __, ...row } of rows) {
          if (row.accountId !== undefined && row.accountId !== null) found.push(row as SessionRow);
        }
        return { rows: found, observedAtUs, written };
      }),

    list: (accountId, limit, after) =>
      run(async () => {
        const rows = await sql<LeaseRecord[]>`
          WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
          SELECT ${leaseColumns(sql, "leases")}
          FROM leases, lease_clock
          WHERE leases.account_id = ${accountId}
            AND leases.session_id > ${after ?? ""}
            AND leases.expires_at > lease_clock.observed_at
            AND ${keeperValid(sql, "leases", sql`lease_clock.observed_at`)}
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
                  AND leases.expires_at > lease_clock.observed_at
                  AND ${keeperValid(sql, "leases", sql`lease_clock.observed_at`)}) AS current
          FROM leases, lease_clock
          WHERE leases.account_id = ${key.accountId} AND leases.session_id = ${key.sessionId}`;
        return rows[0] ?? { current: false, highestToken: 0n };
      }),
  };

  /** The answer of an end statement; a row still busy is decided alone, waiting on its lock. */
  async function endResult(first: EndOutcome, item: EndItem): Promise<EndedLease | undefined> {
    let outcome = first;
    for (let attempt = 1; outcome.outcome === "busy"; attempt++) {
      if (attempt >= maxAttempts) throw stillLocked();
      outcome = await run(() => endOne(sql, item, { wait: true }));
    }
    return outcome.outcome === "ended" ? outcome.lease : undefined;
  }
}

/** The valid lease of each key, if any, in input order. */
async function getMany(
  sql: Sql,
  keys: readonly SessionKey[],
): Promise<(LeaseRecord | undefined)[]> {
  if (keys.length === 1) return [await getOne(sql, keys[0] as SessionKey)];
  const rows = await sql<(Record<string, unknown> & { found: boolean })[]>`
    WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
    SELECT w.idx, l.account_id IS NOT NULL AS found, ${leaseColumns(sql, "l")}
    FROM unnest(
      ${keys.map((_, i) => i)}::int[],
      ${keys.map((k) => k.accountId)}::text[],
      ${keys.map((k) => k.sessionId)}::text[]
    ) AS w(idx, account_id, session_id)
    CROSS JOIN lease_clock
    LEFT JOIN LATERAL (
      SELECT * FROM leases
      WHERE leases.account_id = w.account_id AND leases.session_id = w.session_id
        AND leases.expires_at > lease_clock.observed_at
        AND ${keeperValid(sql, "leases", sql`lease_clock.observed_at`)}
    ) l ON true
    ORDER BY w.idx`;
  return rows.map((row) => (row.found ? leaseOf(row) : undefined));
}

/** The valid lease of the key, if any. */
async function getOne(sql: Sql, key: SessionKey): Promise<LeaseRecord | undefined> {
  const rows = await sql<LeaseRecord[]>`
    WITH lease_clock AS MATERIALIZED (SELECT clock_timestamp() AS observed_at)
    SELECT ${leaseColumns(sql, "leases")}
    FROM leases, lease_clock
    WHERE leases.account_id = ${key.accountId} AND leases.session_id = ${key.sessionId}
      AND leases.expires_at > lease_clock.observed_at
      AND ${keeperValid(sql, "leases", sql`lease_clock.observed_at`)}`;
  return rows[0];
}
