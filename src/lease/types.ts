// The lease domain's types: what a session key, a lease and the answers of
// the lease store are, and the LeaseStore interface every layer programs
// against. No I/O here: the PostgreSQL implementation is db/lease-store.ts,
// the decorators (publishing, quota, metrics) wrap the interface.

import type { LossCause, NotHeldCause } from "../protocol/errors.js";

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
  /** The keeper the lease was acquired on (K1); absent for a lease of its own. */
  keeperId?: string;
}

/** The lease a grant replaced because it had run past its deadline. */
export interface ExpiredLease {
  runId: string;
  fencingToken: bigint;
  holder: string;
  expiresAtUs: bigint;
  /** Its 'expired' row in lease_events. */
  eventId: bigint;
}

export type AcquireResult =
  | {
      acquired: true;
      lease: LeaseRecord;
      retried: boolean;
      /** The 'acquired' row in lease_events; 0n for an idempotent retry. */
      eventId: bigint;
      /** Set when this grant took over a lease that had expired unreleased. */
      expired: ExpiredLease | undefined;
    }
  | {
      acquired: false;
      current: LeaseRecord | undefined;
      /**
       * K2: no valid lease holds the key, but it is not granted before this
       * database time (µs since the epoch): the lock-delay of the expired
       * keeper whose lease it was.
       */
      lockDelayUntilUs?: bigint;
    };

/** A lease ended by release or revoke, with its row in lease_events. */
export interface EndedLease extends LeaseRecord {
  eventId: bigint;
}

/** One grant as it was answered: its token and deadline. */
export interface GrantVersion {
  fencingToken: bigint;
  expiresAtUs: bigint;
}

export interface RenewItem extends SessionKey {
  runId: string;
  /** A new TTL; the lease keeps its TTL when undefined. */
  ttlMs: number | undefined;
  /** Also return the newest handoff request recorded for the renewed lease. */
  lookupHandoff: boolean;
}

/** A handoff request recorded in lease_events for one grant. */
export interface HandoffRecord {
  requesterHolder: string;
  reason: string;
  atUs: bigint;
  eventId: bigint;
}

export type RenewManyResult =
  | { outcome: "renewed"; lease: LeaseRecord; handoff: HandoffRecord | undefined }
  | { outcome: "lost"; cause: LossCause }
  /** Still held, but its row was locked by another transaction: not decided. */
  | { outcome: "busy" };

/** One watch scope: a session, or every session of an account (sessionId ""). */
export interface Scope {
  accountId: string;
  sessionId: string;
}

/** The stored row of a session, valid or not, read at `observedAtUs`. */
export interface SessionRow extends LeaseRecord {
  valid: boolean;
  ended: "released" | "revoked" | null;
  /** For an ended row: its 'released' or 'revoked' row in lease_events. */
  endEventId: bigint | null;
  endReason: string | null;
}

export interface ScopeReading {
  rows: SessionRow[];
  /** The database clock when the rows were read, microseconds since the epoch. */
  observedAtUs: bigint;
  /** With `skipWritten`: keys whose rows a transaction was writing, left out of `rows`. */
  written?: SessionKey[];
}

export interface HandoffResult {
  /** The valid lease that was asked to finish; undefined when nobody held it. */
  lease: LeaseRecord | undefined;
  eventId: bigint;
  atUs: bigint;
}

export type RenewResult =
  | { held: true; lease: LeaseRecord }
  /** Not held; unary Renew tells `never_held` from `taken_over`. */
  | { held: false; cause: NotHeldCause };

export interface AcquireInput extends SessionKey {
  runId: string;
  ttlMs: number;
  holder: string;
  /**
   * The keeper to acquire the lease on (K1): the lease then lives as long as
   * that keeper, and `ttlMs` is not used. Undefined: a lease of its own.
   */
  keeperId?: string;
}

/** A keeper (K1, K2; docs/keepers.md): one heartbeat keeps every lease acquired on it. */
export interface KeeperRecord {
  id: string;
  accountId: string;
  holder: string;
  ttlMs: bigint;
  lockDelayMs: bigint;
  /** Database times in microseconds since the epoch. */
  createdAtUs: bigint;
  expiresAtUs: bigint;
  /** Time left, computed by the database at the statement's clock reading. */
  remainingUs: bigint;
}

/** Why a keeper no longer keeps its leases. */
export type KeeperEnd = "expired" | "closed" | "revoked" | "not_found";

export type KeeperResult = { held: true; keeper: KeeperRecord } | { held: false; cause: KeeperEnd };

export interface OpenKeeperInput {
  /** A UUID: a new keeper, or (re-attach) a valid keeper of the same account, which is renewed. */
  id: string;
  accountId: string;
  holder: string;
  ttlMs: number;
  lockDelayMs: number;
}

/** The keepers (src/server/db/keeper-store.ts). */
export interface KeeperStore {
  /** Opens the keeper, or re-attaches to it while it is valid (a heartbeat). */
  open(input: OpenKeeperInput): Promise<KeeperResult>;
  /** Renews the keeper, and so every lease on it, with one row written (K1). */
  heartbeat(accountId: string, id: string): Promise<KeeperResult>;
  /**
   * Ends the keeper: `closed` by its holder (its leases released), `revoked`
   * by an admin (its leases revoked, audited with the reason). No lock-delay
   * follows either (K2). The ended leases, one audit row each.
   */
  end(
    accountId: string,
    id: string,
    how: { ended: "closed" } | { ended: "revoked"; reason: string },
  ): Promise<{ ended: boolean; cause?: KeeperEnd; leases: EndedLease[] }>;
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
  /**
   * Renews many leases in one statement (the KeepAlive batch). Results are in
   * input order. With `wait` false, rows locked by other transactions are
   * skipped and answered `busy` instead of holding up the whole batch (S8).
   */
  renewMany(items: readonly RenewItem[], options: { wait: boolean }): Promise<RenewManyResult[]>;
  /**
   * Ends runId's valid lease, keeping a tombstone (S5). Undefined when not
   * held. With `grant`, only while the lease is still that grant with that
   * deadline: a clean-up release of an answer nobody took must not end the
   * lease once the same run renewed or re-acquired it elsewhere.
   */
  release(key: SessionKey, runId: string, grant?: GrantVersion): Promise<EndedLease | undefined>;
  /** Ends the valid lease of any run, audited with the reason. */
  revoke(key: SessionKey, reason: string): Promise<EndedLease | undefined>;
  /** Records a handoff request for the valid lease, which it leaves untouched (S3). */
  requestHandoff(key: SessionKey, requesterHolder: string, reason: string): Promise<HandoffResult>;
  /**
   * Every stored row (valid or tombstone) of the given scopes, in one reading.
   * With `skipWritten`, a key's row that a transaction is writing is left out
   * of `rows` and named in `written` (never waited for); the others are read
   * in their latest committed version. A renewal reads its clock and then
   * locks the row, so one that beat the deadline can commit after it: a
   * reading that decides an expiry must not judge the version it replaces.
   */
  readScopes(scopes: readonly Scope[], options?: { skipWritten?: boolean }): Promise<ScopeReading>;
  /** The valid lease of the key, if any. */
  get(key: SessionKey): Promise<LeaseRecord | undefined>;
  /**
   * K2: when the key holds no valid lease but is not granted to another run
   * before a known database instant (the lock-delay of the expired keeper
   * its lease was on), that instant in µs since the epoch; else undefined.
   * Reads only.
   */
  lockDelayUntil(key: SessionKey): Promise<bigint | undefined>;
  /** Valid leases of an account, by session_id, after `after`. */
  list(accountId: string, limit: number, after: string | undefined): Promise<ListPage>;
  /** Whether `token` belongs to the key's valid lease, and the highest token granted. */
  checkFence(key: SessionKey, token: bigint): Promise<FenceState>;
}

/** The audit trail (lease_events), as History reads it. */
export type EventType = "acquired" | "released" | "expired" | "revoked" | "handoff_requested";

export interface EventRecord {
  id: bigint;
  accountId: string;
  sessionId: string;
  type: EventType;
  runId: string | null;
  fencingToken: bigint | null;
  /** The run's holder label; for handoff_requested, the requester's. */
  holder: string | null;
  reason: string | null;
  /** Database time of the event, in microseconds since the epoch. */
  atUs: bigint;
}

export interface EventPage {
  events: EventRecord[];
  /** The id to continue before, when there may be more. */
  nextBefore: bigint | undefined;
}

export interface EventStore {
  /** Events of `key` with id below `before` (all when undefined), newest first. */
  history(key: SessionKey, limit: number, before: bigint | undefined): Promise<EventPage>;
}

/** Counts of valid leases, for the `leases held` gauge. */
export interface LeaseCounts {
  /** Valid leases of every account (a scan of the table). */
  heldTotal(): Promise<number>;
}
