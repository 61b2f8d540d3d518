// The client library's keepers (docs/client.md, docs/keepers.md) against real
// servers and PostgreSQL, through a real TCP proxy that stalls or cuts the
// connection. K1: one heartbeat keeps every lease on the keeper (one keeper
// row written, no lease row); L2: when heartbeats stall, every run on the
// keeper aborts before the database deadline (read from the keeper's own
// expires_at and the database clock); a cut stream re-attaches to the same
// keeper on another instance and keeps every lease; K2's lock-delay is
// visible to a refused acquire and to Get; a keeper's loss ends every run on
// it at once.

import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { once } from "node:events";
import path from "node:path";
import { describe, expect, it } from "vitest";
import {
  type ClientEvent,
  type Keeper,
  type LeaseContext,
  LeaseLostError,
  NotAcquiredError,
} from "../src/client/index.js";
import { defaultLimits } from "../src/lease/limits.js";
import { createKeeperStore } from "../src/server/db/keeper-store.js";
import { useTestServer } from "./support/fixture.js";
import { repoRoot } from "./support/server.js";
import { startTcpProxy, type TcpProxy } from "./support/tcp-proxy.js";

const {
  db,
  server,
  libraryClient: client,
  defer,
  startServer,
} = useTestServer({
  overrides: { limits: { ...defaultLimits, minTtlMs: 50 } },
});

const account = (name: string) => `acct-${name}-${randomUUID().slice(0, 8)}`;

async function proxyTo(url: string): Promise<TcpProxy> {
  const proxy = await startTcpProxy(url);
  defer(() => proxy.close());
  return proxy;
}

/** Resolves once `signal` has aborted (at once if it already has). */
function aborted(signal: AbortSignal): Promise<unknown> {
  return signal.aborted ? Promise.resolve() : once(signal, "abort");
}

/** Milliseconds until the keeper's deadline, on the database clock. */
async function keeperLeftMs(id: string): Promise<number> {
  const [row] = await db.sql<{ leftMs: number }[]>`
    SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8 AS left_ms
    FROM keepers WHERE id = ${id}::uuid`;
  if (!row) throw new Error("no keeper row");
  return row.leftMs;
}

/** Waits on the database clock until `ms` past the keeper's deadline as it is now. */
async function untilPastKeeperDeadline(id: string, ms: number): Promise<void> {
  await db.sql`
    SELECT pg_sleep_until(expires_at + ${ms}::int * interval '1 millisecond')
    FROM keepers WHERE id = ${id}::uuid`;
}

/** The stored leases of an account: run, token, row version, whether valid now. */
async function storedLeases(accountId: string) {
  return db.sql<
    { sessionId: string; runId: string; token: bigint; xmin: string; ended: string | null }[]
  >`
    SELECT session_id, run_id::text, fencing_token AS token, xmin::text, ended
    FROM leases WHERE account_id = ${accountId} ORDER BY session_id`;
}

/** A promise and its resolve, for work that waits for the test. */
function gate() {
  let open!: () => void;
  const opened = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { open, opened };
}

/**
 * Holds `sessions` on `keeper` with runExclusive; each run tells `held` its
 * context, then waits until `release` opens or its signal aborts, and
 * resolves with what its signal said and the database time left then.
 */
function holdAll(keeper: Keeper, accountId: string, sessions: string[], release: Promise<void>) {
  const contexts: LeaseContext[] = [];
  const allHeld = gate();
  const runs = sessions.map((sessionId) =>
    keeper.runExclusive({ accountId, sessionId }, async (ctx) => {
      contexts.push(ctx);
      if (contexts.length === sessions.length) allHeld.open();
      await Promise.race([release, aborted(ctx.signal)]);
      const leftMs = ctx.signal.aborted ? await keeperLeftMs(keeper.id) : undefined;
      return { reason: ctx.signal.reason as unknown, leftMs, token: ctx.fencingToken };
    }),
  );
  return { contexts, held: allHeld.opened, runs: Promise.all(runs) };
}

describe("keepers in the client library", () => {
  it("K1: one heartbeat keeps every lease on the keeper (its row written, no lease row); close releases them all", async () => {
    const accountId = account("k1");
    const keeper = await client().openKeeper({ accountId, ttlMs: 1_500, holder: "worker-7" });
    const sessions = Array.from({ length: 20 }, (_, i) => `s${String(i).padStart(2, "0")}`);
    const done = gate();
    const hold = holdAll(keeper, accountId, sessions, done.opened);
    await hold.held;
    const before = await storedLeases(accountId);
    expect(before).toHaveLength(20);
    const [{ xmin: keeperBefore } = { xmin: "" }] = await db.sql<{ xmin: string }[]>`
      SELECT xmin::text FROM keepers WHERE id = ${keeper.id}::uuid`;
    // Past the deadline the open gave: only heartbeats can have kept them.
    await untilPastKeeperDeadline(keeper.id, 100);
    const after = await storedLeases(accountId);
    expect(after.map((l) => [l.runId, l.token, l.xmin, l.ended])).toEqual(
      before.map((l) => [l.runId, l.token, l.xmin, null]),
    );
    const [keeperAfter] = await db.sql<{ xmin: string; valid: boolean }[]>`
      SELECT xmin::text, expires_at > clock_timestamp() AS valid FROM keepers WHERE id = ${keeper.id}::uuid`;
    expect(keeperAfter?.valid).toBe(true);
    expect(keeperAfter?.xmin).not.toBe(keeperBefore);
    for (const ctx of hold.contexts) expect(ctx.signal.aborted).toBe(false);

    // close: every run aborts with `released` first, then every lease ends released.
    await keeper.close();
    const results = await hold.runs;
    for (const r of results) {
      expect(r.reason).toBeInstanceOf(LeaseLostError);
      expect((r.reason as LeaseLostError).lossReason).toBe("released");
    }
    const closed = await storedLeases(accountId);
    expect(closed.map((l) => l.ended)).toEqual(sessions.map(() => "released"));
    expect((keeper.signal.reason as LeaseLostError).lossReason).toBe("released");
  });

  it("K1: runs that end release their own lease on the stream; the keeper and its other leases go on", async () => {
    const accountId = account("own");
    const c = client();
    const keeper = await c.openKeeper({ accountId, ttlMs: 2_000 });
    defer(() => keeper.close());
    const first = await c.runExclusive(
      { accountId, sessionId: "a" },
      (ctx) => ({ token: ctx.fencingToken, keeperId: ctx.lease.keeperId }),
      { keeper },
    );
    expect(first.keeperId).toBe(keeper.id);
    const [row] = await storedLeases(accountId);
    expect(row?.ended).toBe("released");
    const second = await keeper.runExclusive(
      { accountId, sessionId: "a" },
      (ctx) => ctx.fencingToken,
    );
    expect(second).toBeGreaterThan(first.token);
    expect(keeper.signal.aborted).toBe(false);
    await expect(
      c.runExclusive({ accountId, sessionId: "b" }, () => 1, { keeper, ttlMs: 5_000 } as never),
    ).rejects.toThrow(/ttlMs is the keeper's/);
  });

  it("L2: a stalled heartbeat stops every lease on the keeper before the database deadline", async () => {
    const proxy = await proxyTo(server.url);
    const accountId = account("stall");
    const keeper = await client({ baseUrl: proxy.url }).openKeeper({
      accountId,
      ttlMs: 2_000,
      safetyMarginMs: 800,
    });
    const hold = holdAll(keeper, accountId, ["a", "b", "c", "d", "e"], new Promise(() => {}));
    await hold.held;
    proxy.stall();
    const results = await hold.runs;
    for (const r of results) {
      expect(r.reason).toBeInstanceOf(LeaseLostError);
      expect((r.reason as LeaseLostError).lossReason).toBe("deadline");
      // Every run stopped while the keeper was still valid on the database clock.
      expect(r.leftMs).toBeGreaterThan(0);
    }
    expect((keeper.signal.reason as LeaseLostError).lossReason).toBe("deadline");
  });

  it("re-attach: a cut stream re-attaches to the same keeper on another instance; every lease is kept", async () => {
    const other = await startServer();
    const proxy = await proxyTo(server.url);
    const accountId = account("reattach");
    const events: ClientEvent[] = [];
    const reopened = gate();
    const keeper = await client({
      baseUrls: [proxy.url, other.url],
      reconnectBackoff: { initialMs: 10, maxMs: 50 },
      onEvent: (event) => {
        events.push(event);
        if (event.type === "keeper-open" && event.baseUrl === other.url) reopened.open();
      },
    }).openKeeper({ accountId, ttlMs: 1_500 });
    defer(() => keeper.close());
    const done = gate();
    const hold = holdAll(keeper, accountId, ["a", "b", "c", "d", "e"], done.opened);
    await hold.held;
    const before = await storedLeases(accountId);
    proxy.drop();
    await reopened.opened;
    expect(events.filter((e) => e.type === "keeper-open").map((e) => e.baseUrl)).toEqual([
      proxy.url,
      other.url,
    ]);
    // Past the deadline the last heartbeat before the cut gave.
    await untilPastKeeperDeadline(keeper.id, 100);
    const after = await storedLeases(accountId);
    expect(after.map((l) => [l.runId, l.token, l.ended])).toEqual(
      before.map((l) => [l.runId, l.token, null]),
    );
    expect(await keeperLeftMs(keeper.id)).toBeGreaterThan(0);
    for (const ctx of hold.contexts) expect(ctx.signal.aborted).toBe(false);
    // An acquire after the re-attach goes over the new stream, on the same keeper.
    const extra = await keeper.acquire({ key: { accountId, sessionId: "f" } });
    expect(extra.lease?.keeperId).toBe(keeper.id);
    done.open();
    const results = await hold.runs;
    expect(results.map((r) => r.token)).toEqual([...hold.contexts].map((ctx) => ctx.fencingToken));
  });

  it("K2: lock-delay visible: a refused acquire and Get say until when", async () => {
    const accountId = account("lockdelay");
    const key = { accountId, sessionId: "a" };
    const gone = client();
    const first = await gone.openKeeper({ accountId, ttlMs: 300, lockDelayMs: 5_000 });
    const granted = await first.acquire({ key });
    expect(granted.acquired).toBe(true);
    // The process holding it is cut off: its keeper expires, then the delay runs.
    gone.close();
    await untilPastKeeperDeadline(first.id, 50);
    const [row] = await db.sql<{ until: Date }[]>`
      SELECT expires_at + lock_delay AS until FROM keepers WHERE id = ${first.id}::uuid`;

    const c = client();
    const keeper = await c.openKeeper({ accountId, ttlMs: 2_000 });
    defer(() => keeper.close());
    const refused = await keeper
      .runExclusive(key, () => "ran")
      .then(
        () => undefined,
        (e: unknown) => e,
      );
    expect(refused).toBeInstanceOf(NotAcquiredError);
    expect((refused as NotAcquiredError).current).toBeUndefined();
    expect((refused as NotAcquiredError).lockDelayUntil?.getTime()).toBe(row?.until.getTime());
    expect((refused as NotAcquiredError).message).toMatch(/lock-delay until/);
    const got = await keeper.get(key);
    expect(got.held).toBe(false);
    expect(got.lockDelayUntil).toBeDefined();
  });

  it("K1: the keeper revoked ends every lease on it at once", async () => {
    const accountId = account("revoke");
    const keeper = await client().openKeeper({ accountId, ttlMs: 1_500 });
    const hold = holdAll(keeper, accountId, ["a", "b", "c"], new Promise(() => {}));
    await hold.held;
    const ended = await createKeeperStore(db.sql).end(accountId, keeper.id, {
      ended: "revoked",
      reason: "test",
    });
    expect(ended.ended).toBe(true);
    const results = await hold.runs;
    for (const r of results) {
      expect((r.reason as LeaseLostError).lossReason).toBe("revoked");
    }
    expect((keeper.signal.reason as LeaseLostError).lossReason).toBe("revoked");
  });

  it("examples/typescript/keeper.ts: a keeper holds several leases, each run works and releases, the keeper closes", async () => {
    const accountId = account("example");
    const child = spawn(
      process.execPath,
      [
        ...["--import", "tsx", path.join(repoRoot, "examples/typescript/keeper.ts")],
        ...["--server", server.url, "--account", accountId],
        ...["--sessions", "s1,s2,s3", "--ttl", "3000", "--work", "200"],
      ],
      { cwd: repoRoot, stdio: ["ignore", "pipe", "inherit"] },
    );
    let stdout = "";
    child.stdout.on("data", (chunk: Buffer) => {
      stdout += chunk.toString();
    });
    const [code] = (await once(child, "exit")) as [number | null];
    expect(code).toBe(0);
    const events = stdout
      .trim()
      .split("\n")
      .map((line) => JSON.parse(line) as { event: string; sessionId?: string; keeperId?: string });
    expect(events[0]?.event).toBe("keeper-open");
    expect(events.at(-1)).toEqual({ event: "keeper-closed", keeperId: events[0]?.keeperId });
    for (const sessionId of ["s1", "s2", "s3"]) {
      expect(events.filter((e) => e.sessionId === sessionId).map((e) => e.event)).toEqual([
        "held",
        "done",
      ]);
    }
    const rows = await storedLeases(accountId);
    expect(rows.map((l) => l.ended)).toEqual(["released", "released", "released"]);
  });
});
