// The pool across a database outage: postgres.js delays reopening a failed
// connection by a count of failures shared by the whole pool, which by its
// own curve reaches 20 s after seven failures. A statement that lands on
// such a connection once the database is back would wait that out, past
// the deadline of the lease it renews. The pool caps the delay
// (reconnectDelaySeconds); these tests hold it to that.

import { randomBytes } from "node:crypto";
import { setImmediate as nextTurn } from "node:timers/promises";
import { describe, expect, it } from "vitest";
import { openDatabase, reconnectDelaySeconds } from "../src/postgres/pool.js";
import { openThroughProxy } from "./support/db.js";
import { useTestDatabase } from "./support/fixture.js";

const { db } = useTestDatabase();

/** The statement's own outcome, or a rejection naming the bound it ran past. */
function decidedWithin<T>(statement: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const bound = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`not decided within ${ms} ms`)), ms);
  });
  return Promise.race([statement, bound]).finally(() => clearTimeout(timer));
}

describe("reconnecting after a database outage", () => {
  it("waits at most 0.5 s before reopening a connection, however many have failed", () => {
    for (let failures = 0; failures <= 64; failures++) {
      for (let draw = 0; draw < 20; draw++) {
        const delay = reconnectDelaySeconds(failures);
        expect(delay, `${failures} failures`).toBeGreaterThanOrEqual(0);
        expect(delay, `${failures} failures`).toBeLessThanOrEqual(0.5);
      }
    }
    // The first retries stay quick: a blip costs tens of milliseconds.
    expect(reconnectDelaySeconds(1)).toBeLessThanOrEqual(0.03);
  });

  it("statements during an outage fail, and the first after it is answered, each within 2 s (not the driver's 20 s backoff)", async () => {
    const { proxy, sql } = await openThroughProxy(db.url, "leasehold-test-outage");
    try {
      await sql`SELECT 1`;
      // Every connection reset and every new one refused: each statement
      // opens a connection that fails, and the pool's failure count climbs
      // past the point where the driver's own curve waits 10–20 s.
      proxy.drop();
      for (let i = 0; i < 12; i++) {
        const outcome = await decidedWithin(sql`SELECT 1`, 2_000).then(
          () => "answered",
          (error: Error) => error.message,
        );
        expect(outcome, `statement ${i + 1} in the outage`).not.toMatch(/not decided|answered/);
      }
      proxy.pass();
      const [row] = await decidedWithin(sql<{ one: number }[]>`SELECT 1 AS one`, 2_000);
      expect(row?.one).toBe(1);
    } finally {
      await sql.end({ timeout: 1 });
      await proxy.close();
    }
  });

  // postgres.js reads the array types on every new connection, before the
  // first statement it was opened for. Its reader's promise had no handler:
  // when that read failed (the connection closed under it, as at a
  // failover, or refused with an error), the statement waiting for the
  // connection got the error, and the process died of an unhandled
  // rejection besides (a fault-suite client, nine minutes into an HA soak,
  // of CONNECTION_CLOSED). A role that may not read pg_type makes that read
  // fail on every connection, deterministically.
  it("a connection whose type read fails fails its statement, and leaves no unhandled rejection", async () => {
    const role = `leasehold_no_types_${randomBytes(4).toString("hex")}`;
    await db.sql.unsafe(`CREATE ROLE ${role} LOGIN PASSWORD 'no-types'`);
    await db.sql.unsafe(`REVOKE SELECT ON pg_catalog.pg_type FROM PUBLIC`);
    const url = new URL(db.url);
    url.username = role;
    url.password = "no-types";
    const unhandled: unknown[] = [];
    const onUnhandled = (reason: unknown) => unhandled.push(reason);
    process.on("unhandledRejection", onUnhandled);
    const sql = openDatabase({
      url: url.toString(),
      maxConnections: 1,
      statementTimeoutMs: 5_000,
      lockTimeoutMs: 1_000,
      idleInTransactionTimeoutMs: 5_000,
      applicationName: "leasehold-test-type-read",
    });
    try {
      const outcome = await sql`SELECT 1`.then(
        () => "answered",
        (error: { code?: string }) => error.code,
      );
      // insufficient_privilege, from the type read, reported to the statement.
      expect(outcome).toBe("42501");
      // Rejections are reported as unhandled after the microtask queue drains.
      for (let i = 0; i < 5; i++) await nextTurn();
      expect(unhandled).toEqual([]);
    } finally {
      process.off("unhandledRejection", onUnhandled);
      await sql.end({ timeout: 1 });
      await db.sql.unsafe(`GRANT SELECT ON pg_catalog.pg_type TO PUBLIC`);
    }
  });
});
