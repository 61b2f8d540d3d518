// `leasehold run` and `leasehold watch` as real processes against a real
// server: the child command holds the lease, is stopped when the lease is
// lost (L2), and the watcher prints changes made by another client.

import { describe, expect, it } from "vitest";
import { createLeaseClient, durationFromMs } from "../src/client/index.js";
import { freePort } from "../src/postgres/embedded-postgres.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { runCli, startCli } from "./support/cli.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";

const { db, server, library: client, startServer } = useTestServer();

async function storedLease(key: { accountId: string; sessionId: string }) {
  const [row] = await db.sql<{ fencingToken: bigint; runId: string; ended: string | null }[]>`
    SELECT fencing_token, run_id::text, ended FROM leases
    WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  return row;
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** `leasehold run` on the test server, for one session. */
const runOn = (key: { accountId: string; sessionId: string }) => [
  ...["run", "--server", server.url],
  ...["--account", key.accountId, "--session", key.sessionId],
];

describe("leasehold run", () => {
  it("S6: CMD runs holding the lease with its token and run id, the lease is released when it ends, and its exit code passes through", async () => {
    const key = freshKey("run");
    const result = await runCli([
      ...runOn(key),
      "--ttl",
      "5s",
      "--",
      process.execPath,
      "-e",
      "console.log('token=' + process.env.LEASEHOLD_FENCING_TOKEN + ' run=' + process.env.LEASEHOLD_RUN_ID); process.exit(7)",
    ]);
    expect(result.code).toBe(7);
    const row = await storedLease(key);
    expect(result.stdout).toBe(`token=${row?.fencingToken} run=${row?.runId}\n`);
    expect(row?.ended).toBe("released");
  });

  it("L2: when the lease is lost, CMD gets SIGTERM, then SIGKILL after the grace; run exits with CMD's code", async () => {
    const key = freshKey("lost");
    const run = startCli([
      ...runOn(key),
      "--ttl",
      "2s",
      "--grace",
      "300ms",
      "--",
      process.execPath,
      "-e",
      // Ignores SIGTERM, so only SIGKILL can stop it.
      `process.on("SIGTERM", () => console.log("got SIGTERM"));
       console.log("ready " + process.pid);
       setInterval(() => {}, 1000);`,
    ]);
    const ready = await run.line(/^ready \d+$/);
    const pid = Number(ready.split(" ")[1]);
    expect(isAlive(pid)).toBe(true);

    await createLeaseStore(db.sql).revoke(key, "operator says stop");
    const result = await run.exited;
    expect(result.stdout).toContain("got SIGTERM");
    expect(result.stderr).toMatch(/lease on .* lost: .*revoked.*stopping/);
    expect(result.stderr).toMatch(/did not exit within 300ms of SIGTERM; sending SIGKILL/);
    expect(result.code).toBe(137);
    expect(isAlive(pid)).toBe(false);
    expect((await storedLease(key))?.ended).toBe("revoked");
  });

  it("S3: when the session is held elsewhere it says by whom, does not run CMD, and exits 75", async () => {
    const key = freshKey("held");
    const held = await client.acquire({ key, ttl: durationFromMs(30_000), holder: "desktop" });
    const result = await runCli([
      ...runOn(key),
      "--",
      process.execPath,
      "-e",
      "console.log('should not run')",
    ]);
    expect(result.code).toBe(75);
    expect(result.stdout).toBe("");
    expect(result.stderr).toContain(
      `is held by "desktop" (run ${held.lease?.runId}, token ${held.lease?.fencingToken})`,
    );
  });
});

describe("leasehold watch", () => {
  it("L1: prints the snapshot, then transitions made by another client", async () => {
    const key = freshKey("watched");
    const watch = startCli(["watch", "--server", server.url, "--account", key.accountId]);
    try {
      await watch.line(/SNAPSHOT/);
      const grant = await client.acquire({ key, ttl: durationFromMs(30_000), holder: "browser" });
      const runId = grant.lease?.runId ?? "";
      const acquired = await watch.line(new RegExp(`ACQUIRED .*${key.sessionId}`));
      expect(acquired).toContain(`run ${runId}`);
      expect(acquired).toContain('holder "browser"');
      await client.release({ key, runId });
      const released = await watch.line(new RegExp(`RELEASED .*${key.sessionId}`));
      expect(released).toContain(`run ${runId}`);
    } finally {
      watch.child.kill("SIGINT");
    }
    const result = await watch.exited;
    expect(result.code).toBe(0);
  });

  it("L1: when its server restarts, watch says so and watches again: a fresh snapshot, then changes", async () => {
    const port = await freePort();
    const listen = ["--listen", `127.0.0.1:${port}`];
    let restarting = await startServer(listen);
    const key = freshKey("rewatched");
    const watch = startCli([
      ...["watch", "--server", restarting.url],
      ...["--account", key.accountId, "--session", key.sessionId],
    ]);
    try {
      await watch.line(/SNAPSHOT/);
      const before = watch.lines.length;
      await restarting.close();
      restarting = await startServer(listen);
      await watch.line(/SNAPSHOT/, before);
      const other = createLeaseClient({ baseUrl: restarting.url });
      const grant = await other.acquire({ key, ttl: durationFromMs(30_000), holder: "desktop" });
      other.close();
      const acquired = await watch.line(new RegExp(`ACQUIRED .*${key.sessionId}`), before);
      expect(acquired).toContain(`run ${grant.lease?.runId}`);
    } finally {
      watch.child.kill("SIGINT");
      await restarting.close();
    }
    const result = await watch.exited;
    expect(result.code).toBe(0);
    expect(result.stderr).toMatch(/leasehold watch: stream lost \(.*\); watching again in \d/);
  });
});

describe("leasehold run --keeper", () => {
  it("K1: with --lock-delay, CMD holds the lease on a keeper of its own (its lock-delay set), released and the keeper closed when CMD ends", async () => {
    const key = freshKey("keeper");
    const result = await runCli([
      ...runOn(key),
      ...["--ttl", "3s", "--lock-delay", "5s"],
      "--",
      process.execPath,
      "-e",
      "console.log('token=' + process.env.LEASEHOLD_FENCING_TOKEN); process.exit(3)",
    ]);
    expect(result.code).toBe(3);
    const [row] = await db.sql<
      {
        fencingToken: bigint;
        ended: string | null;
        keeperEnded: string | null;
        lockDelayMs: number;
      }[]
    >`
      SELECT l.fencing_token, l.ended, k.ended AS keeper_ended,
        (extract(epoch FROM k.lock_delay) * 1000)::int AS lock_delay_ms
      FROM leases l JOIN keepers k ON k.id = l.keeper_id
      WHERE l.account_id = ${key.accountId} AND l.session_id = ${key.sessionId}`;
    expect(result.stdout).toBe(`token=${row?.fencingToken}\n`);
    expect(row?.ended).toBe("released");
    expect(row?.keeperEnded).toBe("closed");
    expect(row?.lockDelayMs).toBe(5_000);
  });

  it("K2: a session in a lock-delay is refused with exit 75, saying until when", async () => {
    const key = freshKey("delayed");
    const gone = createLeaseClient({ baseUrl: server.url });
    const keeper = await gone.openKeeper({
      accountId: key.accountId,
      ttlMs: 1_000,
      lockDelayMs: 10_000,
    });
    expect((await keeper.acquire({ key })).acquired).toBe(true);
    // Its process cut off: the keeper expires, then the lock-delay runs.
    gone.close();
    await db.sql`
      SELECT pg_sleep_until(expires_at + interval '50 milliseconds')
      FROM keepers WHERE id = ${keeper.id}::uuid`;
    const result = await runCli([...runOn(key), "--keeper", "--", process.execPath, "-e", ""]);
    expect(result.code).toBe(75);
    expect(result.stderr).toMatch(/is in its lock-delay until \d{4}-\d\d-\d\dT/);
  });
});
