// Graceful shutdown (DESIGN §8): health turns NOT_SERVING, open streams end
// with UNAVAILABLE so clients move to another instance, a call already
// inside the database finishes, leases stay, and the pool closes. Also for
// `leasehold serve` on SIGTERM, which exits with status 0.

import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { describe, expect, it } from "vitest";
import {
  Health,
  HealthCheckResponse_ServingStatus as Status,
} from "../src/gen/grpc/health/v1/health_pb.js";
import { seconds } from "./support/calls.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey, lockLeaseRow } from "./support/leases.js";
import { grpcClient } from "./support/server.js";
import { waitFor } from "./support/wait.js";

// Each test closes its own server, the event under test; the fixture's
// teardown closes them again only if a test failed before it could.
const { db, startServer, spawnServer } = useTestDatabase();

/** Statuses of a health Watch until the stream ends, and how it ended. */
function watchHealth(url: string) {
  const statuses: Status[] = [];
  let first!: () => void;
  const started = new Promise<void>((resolve) => {
    first = resolve;
  });
  const ended = (async () => {
    try {
      const health = createClient(Health, createGrpcTransport({ baseUrl: url }));
      for await (const m of health.watch({ service: "" })) {
        statuses.push(m.status);
        first();
      }
      return undefined;
    } catch (error) {
      return ConnectError.from(error);
    }
  })();
  return { statuses, started, ended };
}

describe("graceful shutdown", () => {
  it("S1: NOT_SERVING, streams end UNAVAILABLE, an in-flight acquire completes, the lease stays", async () => {
    const server = await startServer(["--lock-timeout", "10s"]);
    const client = grpcClient(server.url);
    const kept = freshKey("kept");
    const a = await client.acquire({ key: kept, ttl: seconds(600) });
    const watch = watchHealth(server.url);
    await watch.started;

    // An acquire that waits inside the database on a row lock we hold.
    const busy = freshKey("busy");
    await client
      .acquire({ key: busy, ttl: seconds(600) })
      .then((r) => client.release({ key: busy, runId: r.lease?.runId ?? "" }));
    const lock = await lockLeaseRow(db, busy);
    const inFlight = client.acquire({ key: busy, ttl: seconds(60) });
    await waitFor(
      async () =>
        (
          await db.sql`SELECT 1 FROM pg_stat_activity
            WHERE datname = current_database() AND application_name = 'leasehold'
              AND wait_event_type = 'Lock'`
        ).length > 0,
      { what: "the server's statement to block on the test's row lock" },
    );

    const closing = server.close();
    const ended = await watch.ended;
    expect(watch.statuses).toEqual([Status.SERVING, Status.NOT_SERVING]);
    expect(ended?.code).toBe(Code.Unavailable);
    expect(ended?.rawMessage).toMatch(/shutting down/);

    await lock.end();
    const done = await inFlight;
    expect(done.acquired).toBe(true);
    await closing;

    // Leases outlive the server; its pool is closed.
    const [row] = await db.sql`SELECT run_id FROM leases
      WHERE account_id = ${kept.accountId} AND session_id = ${kept.sessionId}
        AND expires_at > clock_timestamp()`;
    expect(row?.runId).toBe(a.lease?.runId);
    await expect(server.sql`SELECT 1`).rejects.toThrow();
    await expect(fetch(`${server.url}/metrics`)).rejects.toThrow();
  });

  it("`leasehold serve` on SIGTERM ends streams with UNAVAILABLE and exits with status 0", async () => {
    const proc = await spawnServer();
    const watch = watchHealth(proc.url);
    await watch.started;
    const exited = new Promise<number | null>((resolve) => proc.child.once("exit", resolve));
    proc.child.kill("SIGTERM");
    const ended = await watch.ended;
    expect(ended?.code).toBe(Code.Unavailable);
    expect(await exited).toBe(0);
  });
});
