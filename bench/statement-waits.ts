// What the renewal statements are doing while a KeepAlive window runs, from
// pg_stat_activity sampled every `everyMs`: on CPU, or waiting (a WAL flush,
// a buffer lock, …), and the longest one seen still running. A tail of the
// round trip that the database shows here is the database's (a slow disk
// shows as IO:WalSync or LWLock:WALWrite and long statements); a tail it
// does not show is the server's, the network's or the load generator's.
//
// The sampler connects to the cluster's `postgres` database, so that its own
// statements are not counted with the benchmark database's.

import postgres from "postgres";

export interface StatementWaits {
  /** Samples taken, and those that found a renewal statement running. */
  samples: number;
  /** Share of the renewal statements seen, by wait event ("CPU": none). */
  shares: Record<string, number>;
  /** The longest time a renewal statement was seen running, ms (a lower bound). */
  longestMs: number;
}

/** Starts sampling; `stop` ends it and gives the summary. */
export function sampleRenewalWaits(
  databaseUrl: string,
  everyMs = 20,
): { stop(): Promise<StatementWaits> } {
  const url = new URL(databaseUrl);
  const database = decodeURIComponent(url.pathname.slice(1));
  url.pathname = "/postgres";
  const sql = postgres(url.toString(), { max: 1, onnotice: () => {} });
  const counts = new Map<string, number>();
  let samples = 0;
  let seen = 0;
  let longestMs = 0;
  let sampling = true;
  const loop = (async () => {
    while (sampling) {
      // The batch statement is the one that unnests `lookup_handoff`.
      const rows = await sql<{ wait: string; running_ms: number }[]>`
        SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') AS wait,
               (extract(epoch FROM clock_timestamp() - query_start) * 1000)::float8 AS running_ms
        FROM pg_stat_activity
        WHERE datname = ${database} AND state = 'active'
          AND query LIKE '%AS w(idx, account_id, session_id, run_id, ttl_ms, lookup_handoff)%'`;
      samples++;
      for (const row of rows) {
        seen++;
        counts.set(row.wait, (counts.get(row.wait) ?? 0) + 1);
        longestMs = Math.max(longestMs, row.running_ms);
      }
      await new Promise((r) => setTimeout(r, everyMs));
    }
  })();
  return {
    async stop() {
      sampling = false;
      await loop;
      await sql.end({ timeout: 1 });
      const shares: Record<string, number> = {};
      for (const [wait, n] of [...counts].sort((a, b) => b[1] - a[1])) {
        shares[wait] = Math.round((n / seen) * 1000) / 1000;
      }
      return { samples, shares, longestMs: Math.round(longestMs * 10) / 10 };
    },
  };
}

/** "78% CPU, 18% IO:WalSync, …; longest seen running 130 ms" */
export function describeWaits(w: StatementWaits): string {
  const parts = Object.entries(w.shares)
    .slice(0, 4)
    .map(([wait, share]) => `${Math.round(share * 100)}% ${wait}`);
  return `${parts.join(", ") || "none seen"}; longest seen running ${w.longestMs.toFixed(0)} ms (${w.samples} samples)`;
}
