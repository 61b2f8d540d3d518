// Reading the audit trail (lease_events, DESIGN §2) for History: one
// session's events, newest first, paged by event id on the
// (account_id, session_id, id) index.

import type { EventRecord, EventStore } from "../../lease/types.js";
import { classifyDatabaseError } from "../../postgres/database-errors.js";
import type { Sql } from "../../postgres/pool.js";

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
