// An expiry is reported only when the lease really ran out (S9). A renewal
// reads the database clock and then locks the row; one decided before the
// deadline may commit after it. The expiry tracker's reading at the deadline
// must wait for that commit instead of reporting, from the row's old
// version, an end that never happened: watchers were told EXPIRED while the
// holder kept renewing, and the lease lived on with no event saying so.
// Made deterministic with the renewal's UPDATE in a transaction left open
// across the deadline. The reading skips a row being written and looks again
// soon, rather than wait for it: one stuck writer must not hold up the
// expiries of other keys (S8).

import { describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { openTransaction } from "./support/db.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey, untilExpired } from "./support/leases.js";
import { ms, openWatch } from "./support/streams.js";

const { db, client } = useTestServer();

describe("the expiry tracker and a renewal that commits after the deadline it beat", () => {
  it("S9, S8: no EXPIRED is reported for a lease whose renewal, decided in time, commits late; other keys' expiries are not held up", async () => {
    const key = freshKey("late-commit");
    const other = freshKey("expires");
    const watch = openWatch(client, key);
    const otherWatch = openWatch(client, other);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    await otherWatch.reader.next((m) => m.kind.case === "snapshot");
    const a = await client.acquire({ key, ttl: ms(1_000) });
    const runId = a.lease?.runId ?? "";
    // Acquired after it: its deadline comes later, so the tracker has read
    // the first key's row by the time it reports this one's expiry.
    await client.acquire({ key: other, ttl: ms(1_000) });
    await watch.reader.next((m) => m.kind.case === "event");
    await otherWatch.reader.next((m) => m.kind.case === "event");

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

    // Both deadlines pass (as committed). The other key's expiry is reported
    // while the first key's row is still being written: its reading neither
    // waited for that row nor judged it from its old version.
    await untilExpired(db.sql, other);
    await otherWatch.reader.next(
      (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
    );
    const reportedExpired = watch.reader.received.some(
      (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
    );
    expect(reportedExpired).toBe(false);
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
    otherWatch.abort();
  });
  it("S9, L1: a key whose row was being written at its deadline is judged again once the writer is done: EXPIRED comes then", async () => {
    const key = freshKey("judged-again");
    const other = freshKey("expires-too");
    const watch = openWatch(client, key);
    const otherWatch = openWatch(client, other);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    await otherWatch.reader.next((m) => m.kind.case === "snapshot");
    const a = await client.acquire({ key, ttl: ms(1_000) });
    await client.acquire({ key: other, ttl: ms(1_000) });
    await watch.reader.next((m) => m.kind.case === "event");
    await otherWatch.reader.next((m) => m.kind.case === "event");
    // A writer that holds the row across the deadline and changes nothing
    // that matters: the lease does run out.
    const writer = await openTransaction(db, async (tx) => {
      await tx`UPDATE leases SET holder = holder
               WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    });
    await untilExpired(db.sql, other);
    await otherWatch.reader.next(
      (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
    );
    // Read and skipped while the writer holds it: not reported yet.
    expect(
      watch.reader.received.some(
        (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
      ),
    ).toBe(false);
    await writer.end();
    const expired = await watch.reader.next(
      (m) => m.kind.case === "event" && m.kind.value.type === EventType.EXPIRED,
    );
    expect(expired.kind.case === "event" && expired.kind.value.runId).toBe(a.lease?.runId);
    watch.abort();
    otherWatch.abort();
  });
});
