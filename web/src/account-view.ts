// What the page knows about one account's sessions, built from List, the
// Watch snapshot and Watch events. No DOM here. Times are the page's
// monotonic clock (performance.now()): a lease's local deadline is the
// moment its answer arrived plus the `remaining` the database computed, so
// a wrong wall clock on this device never shows a wrong countdown.

import { type Event, EventType, type Lease } from "../../src/gen/leasehold/v1/lease_pb.js";
import { durationMs, timestampDate } from "./durations.js";

export interface HeldSession {
  lease: Lease;
  /** performance.now() at which the lease runs out unless renewed. */
  deadline: number;
}

/** One change of a session, newest first in `transitions`. */
export interface Transition {
  type: EventType;
  sessionId: string;
  runId: string;
  holder: string;
  fencingToken: bigint;
  requesterHolder: string;
  reason: string;
  /** Database time of the change. */
  at: Date | undefined;
  /** Position in the audit trail; 0 for a change it does not record. */
  id: bigint;
}

export interface HandoffRequest {
  sessionId: string;
  requesterHolder: string;
  reason: string;
  at: Date | undefined;
}

const keptTransitions = 50;

export class AccountView {
  /** Valid leases by session id. */
  readonly sessions = new Map<string, HeldSession>();
  /** Recent changes (renewals left out), newest first. */
  readonly transitions: Transition[] = [];
  /** Goes up with every change of `transitions`, so a renderer can tell. */
  transitionsVersion = 0;
  /** The latest handoff request addressed to each run, by run id. */
  readonly handoffs = new Map<string, HandoffRequest>();

  /** Replaces every session with an authoritative list (List or a Watch snapshot). */
  replace(leases: readonly Lease[], now: number): void {
    this.sessions.clear();
    for (const lease of leases) this.upsert(lease, now);
    for (const runId of this.handoffs.keys()) {
      if (!this.holdsAny(runId)) this.handoffs.delete(runId);
    }
    // Which listed grants have since run out (ranOutUnrecorded) depends on
    // the sessions held.
    this.transitionsVersion += 1;
  }

  /**
   * Whether a listed grant has run out with nothing recorded after it: the
   * audit trail writes a lease's EXPIRED only when its session is next
   * acquired, so a session that expired and was never touched again has its
   * ACQUIRED as last event. Such a grant is shown as ended. (An expiry
   * while the page watches arrives as EXPIRED at the deadline.)
   */
  ranOutUnrecorded(t: Transition): boolean {
    if (t.type !== EventType.ACQUIRED) return false;
    if (this.sessions.get(t.sessionId)?.lease.runId === t.runId) return false;
    for (const newer of this.transitions) {
      if (newer === t) return true;
      if (newer.sessionId === t.sessionId && newer.type !== EventType.HANDOFF_REQUESTED) {
        return false;
      }
    }
    return false;
  }

  /**
   * Records a lease seen in an answer. A lease with a smaller fencing token
   * than the one already shown is an older grant arriving late (tokens
   * follow grant order, S6), so it is ignored.
   */
  upsert(lease: Lease, now: number): void {
    const sessionId = lease.key?.sessionId ?? "";
    const shown = this.sessions.get(sessionId);
    if (shown && shown.lease.fencingToken > lease.fencingToken) return;
    this.sessions.set(sessionId, { lease, deadline: now + durationMs(lease.remaining) });
  }

  apply(event: Event, now: number): void {
    const sessionId = event.key?.sessionId ?? "";
    switch (event.type) {
      case EventType.ACQUIRED:
      case EventType.RENEWED:
        if (event.lease) this.upsert(event.lease, now);
        break;
      case EventType.RELEASED:
      case EventType.EXPIRED:
      case EventType.REVOKED:
        // Only the run that ended leaves: an end of an older run that
        // arrives after a newer grant must not hide the newer one.
        if (this.sessions.get(sessionId)?.lease.runId === event.runId) {
          this.sessions.delete(sessionId);
        }
        this.handoffs.delete(event.runId);
        break;
      case EventType.HANDOFF_REQUESTED:
        this.handoffs.set(event.runId, {
          sessionId,
          requesterHolder: event.requesterHolder,
          reason: event.reason,
          at: timestampDate(event.at),
        });
        break;
      default:
        break;
    }
    if (event.type !== EventType.RENEWED && !this.shown(event)) {
      this.transitions.unshift(transitionOf(event));
      this.transitions.length = Math.min(this.transitions.length, keptTransitions);
      this.transitionsVersion += 1;
    }
  }

  /**
   * Adds a session's audit trail (History, newest first) to the recent
   * changes, so a page that opens late still shows how the session got
   * where it is. Events already shown (by their audit id) are skipped; the
   * list stays newest first by database time and keeps the newest 50.
   */
  addHistory(events: readonly Event[]): void {
    const added = events
      .filter((e) => e.type !== EventType.RENEWED && !this.shown(e))
      .map(transitionOf);
    if (added.length === 0) return;
    const merged = [...this.transitions, ...added].sort(
      (a, b) => (b.at?.getTime() ?? 0) - (a.at?.getTime() ?? 0) || Number(b.id - a.id),
    );
    this.transitions.splice(0, this.transitions.length, ...merged.slice(0, keptTransitions));
    this.transitionsVersion += 1;
  }

  /**
   * Whether the change is listed already. Changes in the audit trail have
   * an id; an EXPIRED sent at the deadline has none yet (its row is written
   * later, with the same time), so without ids the change itself is compared.
   */
  private shown(event: Event): boolean {
    const at = timestampDate(event.at)?.getTime();
    return this.transitions.some((t) =>
      event.id > 0n && t.id > 0n
        ? t.id === event.id
        : t.type === event.type &&
          t.runId === event.runId &&
          t.fencingToken === event.fencingToken &&
          t.at?.getTime() === at,
    );
  }

  /**
   * The lease that holds a session by the local countdown. Past its local
   * deadline a lease is no longer shown as holding, even before the server's
   * EXPIRED arrives: an Acquire then gets the authoritative answer.
   */
  holder(sessionId: string, now: number): HeldSession | undefined {
    const held = this.sessions.get(sessionId);
    return held && held.deadline > now ? held : undefined;
  }

  private holdsAny(runId: string): boolean {
    for (const held of this.sessions.values()) if (held.lease.runId === runId) return true;
    return false;
  }
}

function transitionOf(event: Event): Transition {
  return {
    type: event.type,
    sessionId: event.key?.sessionId ?? "",
    runId: event.runId,
    holder: event.holder,
    fencingToken: event.fencingToken,
    requesterHolder: event.requesterHolder,
    reason: event.reason,
    at: timestampDate(event.at),
    id: event.id,
  };
}
