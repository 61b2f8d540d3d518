// A committed change of one session, as every server instance passes it to
// its watchers, waiters and KeepAlive streams. Made only from the answer of a
// statement that has committed (or, for `expired`, from a database reading
// that confirmed the deadline passed): a change is never a guess.

import type { LeaseRecord, SessionKey } from "./types.js";

export type ChangeType =
  | "acquired"
  | "released"
  | "expired"
  | "revoked"
  | "handoff_requested"
  | "renewed";

export interface LeaseChange {
  type: ChangeType;
  accountId: string;
  sessionId: string;
  /** The run the change is about (for handoff_requested: the run asked to finish). */
  runId: string;
  fencingToken: bigint;
  /** The holder label of that run's lease. */
  holder: string;
  /** Database time of the change, in microseconds since the epoch. */
  atUs: bigint;
  /** The lease after the change, for acquired and renewed. */
  lease: LeaseRecord | undefined;
  /** Revoke reason or handoff reason. */
  reason: string;
  /** Who asked, for handoff_requested. */
  requesterHolder: string;
  /** Position in lease_events; 0n for changes the audit trail does not record. */
  eventId: bigint;
}

export function keyString(key: SessionKey): string {
  // Ids cannot contain a space (validation.ts), so the space separates them.
  return `${key.accountId} ${key.sessionId}`;
}

/** One run's lease as a map key: its session key and run id. */
export function runKey(key: SessionKey, runId: string): string {
  return `${key.accountId} ${key.sessionId} ${runId}`;
}

export function changeFromLease(
  type: ChangeType,
  lease: LeaseRecord,
  extra: { atUs?: bigint; eventId?: bigint; reason?: string; requesterHolder?: string } = {},
): LeaseChange {
  const carriesLease = type === "acquired" || type === "renewed";
  return {
    type,
    accountId: lease.accountId,
    sessionId: lease.sessionId,
    runId: lease.runId,
    fencingToken: lease.fencingToken,
    holder: lease.holder,
    atUs: extra.atUs ?? (carriesLease ? lease.expiresAtUs - lease.remainingUs : lease.expiresAtUs),
    lease: carriesLease ? lease : undefined,
    reason: extra.reason ?? "",
    requesterHolder: extra.requesterHolder ?? "",
    eventId: extra.eventId ?? 0n,
  };
}

/** True when the change ends the lease it names. */
export function endsLease(type: ChangeType): boolean {
  return type === "released" || type === "expired" || type === "revoked";
}
