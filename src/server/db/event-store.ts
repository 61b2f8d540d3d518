// Reading the audit trail (lease_events, DESIGN §2) for History: one
// session's events, newest first, paged by event id on the
// (account_id, session_id, id) index.

import type { Sql } from "./pool.js";
import { classifyDatabaseError } from "../lease/errors.js";
import type { SessionKey } from "./lease-store.js";

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

export function createEventStore(sql: Sql): EventStore {
  return {
    history: async (key, limit, before) => {
      try {
        const rows = await sql<EventRecord[]>`
          SELECT id, account_id, session_id, type, run_id, fencing_token, holder, reason,
                 (extract(epoch FROM at) * 1000000)::bigint AS at_us
          FROM lease_events
          WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
            AND id < ${before ?? 9_223_372_036_854_775_807n}
          ORDER BY id DESC
          LIMIT ${limit + 1}`;
        const more = rows.length > limit;
        const events = more ? rows.slice(0, limit) : [...rows];
        return { events, nextBefore: more ? events.at(-1)?.id : undefined };
      } catch (error) {
        throw classifyDatabaseError(error);
      }
    },
  };
}
