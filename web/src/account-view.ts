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
  /** The latest handoff request addressed to each run, by run id. */
  readonly handoffs = new Map<string, HandoffRequest>();

  /** Replaces every session with an authoritative list (List or a Watch snapshot). */
  replace(leases: readonly Lease[], now: number): void {
    this.sessions.clear();
    for (const lease of leases) this.upsert(lease, now);
    for (const runId of this.handoffs.keys()) {
      if (!this.holdsAny(runId)) this.handoffs.delete(runId);
    }
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
    if (event.type !== EventType.RENEWED) {
      this.transitions.unshift({
        type: event.type,
        sessionId,
        runId: event.runId,
        holder: event.holder,
        fencingToken: event.fencingToken,
        requesterHolder: event.requesterHolder,
        reason: event.reason,
        at: timestampDate(event.at),
      });
      this.transitions.length = Math.min(this.transitions.length, keptTransitions);
    }
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
