// An expiry is reported only when the lease really ran out (S9). A renewal
// reads the database clock and then locks the row; one decided before the
// deadline may commit after it. The expiry tracker's reading at the deadline
// must wait for that commit instead of reporting, from the row's old
// version, an end that never happened: watchers were told EXPIRED while the
// holder kept renewing, and the lease lived on with no event saying so.
// Made deterministic with the renewal's UPDATE in a transaction left open
// across the deadline.

import { describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { openTransaction } from "./support/db.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey, untilExpired } from "./support/leases.js";
import { ms, openWatch } from "./support/streams.js";
import { waitFor } from "./support/wait.js";

const { db, client } = useTestServer();

describe("the expiry tracker and a renewal that commits after the deadline it beat", () => {
  it("S9: no EXPIRED is reported for a lease whose renewal, decided in time, commits late", async () => {
    const key = freshKey("late-commit");
    const watch = openWatch(client, key);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    const a = await client.acquire({ key, ttl: ms(1_000) });
    const runId = a.lease?.runId ?? "";
    await watch.reader.next((m) => m.kind.case === "event");

    // The renewal: decided by the database clock before the deadline, its
    // commit held back.
    let renewed = 0;
    const renewal = await openTransaction(db, async (tx) => {
      const rows = await tx`
        UPDATE leases SET expires_at = expires_at + interval '60 seconds'
        WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
          AND run_id = ${runId} AND ended IS NULL AND expires_at > clock_timestamp()
        RETURNING 1`;
      renewed = rows.length;
    });
    expect(renewed).toBe(1);

    // Past the old deadline (as committed), the tracker reads the row: it
    // either reports EXPIRED from the old version or waits on the row lock.
    await untilExpired(db.sql, key);
    const waitingOnLock = async () =>
      (
        await db.sql`SELECT count(*)::int AS n FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'`
      )[0]?.n > 0;
    const reportedExpired = () =>
      watch.reader.received.some(
        (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
      );
    await waitFor(async () => reportedExpired() || (await waitingOnLock()), {
      what: "the expiry tracker's reading of the lapsed deadline",
    });
    expect(reportedExpired()).toBe(false);
    await renewal.end();

    // The lease lives on; a revoke ends it, and the watcher's events up to
    // that REVOKED show no expiry before it.
    expect((await client.get({ key })).lease?.runId).toBe(runId);
    expect((await client.revoke({ key, reason: "test over" })).revoked).toBe(true);
    await watch.reader.next(
      (m) => m.kind.case === "event" && m.kind.value.type === EventType.REVOKED,
    );
    const types = watch.reader.received.flatMap((m) =>
      m.kind.case === "event" ? [m.kind.value.type] : [],
    );
    expect(types).toEqual([EventType.ACQUIRED, EventType.REVOKED]);
    watch.abort();
  });
});
