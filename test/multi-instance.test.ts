// KeepAlive, Watch, waiting Acquire and RequestHandoff across two server
// instances running as separate OS processes on one database. The periodic
// re-check and the end-to-end check of the LISTEN connection are set to ten
// minutes so that nothing here can pass by them: every cross-instance effect
// must travel the notification path (or, for expiry, the deadline timer
// confirmed by the database).

import { randomUUID } from "node:crypto";
import { Code } from "@connectrpc/connect";
import postgres from "postgres";
import { beforeAll, describe, expect, it } from "vitest";
import {
  type AcquireResponse,
  EventType,
  KeepAliveRequestSchema,
  LossReason,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { frame, openRawCall } from "./support/raw-grpc.js";
import { grpcClient, type LeaseClient, type ServerProcess } from "./support/server.js";
import { answerFor, logLine, ms, openKeepAlive, openWatch } from "./support/streams.js";
import { waitFor, within } from "./support/wait.js";

const { db, spawnServer } = useTestDatabase();
let one: ServerProcess;
let two: ServerProcess;
let c1: LeaseClient;
let c2: LeaseClient;
const args = ["--recheck-interval", "10m", "--listen-check-interval", "10m"];

beforeAll(async () => {
  [one, two] = await Promise.all([spawnServer(args), spawnServer(args)]);
  c1 = grpcClient(one.url);
  c2 = grpcClient(two.url);
});

/** A series' value on an instance's /metrics (0 when absent). */
async function metricValue(baseUrl: string, series: string): Promise<number> {
  const text = await (await fetch(`${baseUrl}/metrics`)).text();
  const line = text.split("\n").find((l) => l.startsWith(`${series} `));
  return line === undefined ? 0 : Number(line.slice(series.length + 1));
}

const eventOf = (type: EventType) => (m: { kind: { case?: string; value?: unknown } }) =>
  m.kind.case === "event" && (m.kind.value as { type: EventType }).type === type;

describe("two server processes on one database", () => {
  it("S4, S6: a run acquires through instance 1 and keeps its lease alive through instance 2", async () => {
    const key = freshKey("cross-renew");
    const a = await c1.acquire({ key, ttl: ms(2_000), holder: "desktop" });
    expect(a.acquired).toBe(true);
    const runId = a.lease?.runId ?? "";
    const stream = openKeepAlive(c2);
    stream.send({ key, runId, ttl: ms(60_000) });
    const answer = await answerFor(stream, runId);
    expect(answer.result.case).toBe("lease");
    const lease = answer.result.case === "lease" ? answer.result.value : undefined;
    expect(lease?.fencingToken).toBe(a.lease?.fencingToken);
    expect(lease?.ttl?.seconds).toBe(60n);
    expect(lease?.expiresAt?.seconds).toBeGreaterThan(a.lease?.expiresAt?.seconds ?? 0n);
    const got = await c1.get({ key });
    expect(got.lease?.expiresAt).toEqual(lease?.expiresAt);
    stream.abort();
  });

  it("L1: a watcher on instance 2 sees a release made through instance 1", async () => {
    const key = freshKey("cross-watch");
    const a = await c1.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const watch = openWatch(c2, key);
    const first = await watch.reader.next();
    expect(first.kind.case).toBe("snapshot");
    const snapshot = first.kind.case === "snapshot" ? first.kind.value : undefined;
    expect(snapshot?.leases.map((l) => l.runId)).toEqual([a.lease?.runId]);

    await c1.release({ key, runId: a.lease?.runId ?? "" });
    const released = await watch.reader.next(eventOf(EventType.RELEASED));
    const event = released.kind.case === "event" ? released.kind.value : undefined;
    expect(event?.runId).toBe(a.lease?.runId);
    expect(event?.fencingToken).toBe(a.lease?.fencingToken);
    expect(event?.id).toBeGreaterThan(0n);

    const b = await c1.acquire({ key, ttl: ms(60_000), holder: "browser" });
    const acquired = await watch.reader.next(eventOf(EventType.ACQUIRED));
    const granted = acquired.kind.case === "event" ? acquired.kind.value : undefined;
    expect(granted?.fencingToken).toBe(b.lease?.fencingToken);
    expect(granted?.lease?.holder).toBe("browser");
    watch.abort();
  });

  it("L1: a waiter on instance 1 gets the lease as soon as it is released through instance 2", async () => {
    // An instance of its own that logs at debug level says when the
    // acquire has found the session held and started waiting.
    const waiterSide = await spawnServer(args, { LEASEHOLD_LOG_LEVEL: "debug" });
    try {
      const cw = grpcClient(waiterSide.url);
      const key = freshKey("cross-wait");
      const holder = await c2.acquire({ key, ttl: ms(60_000), holder: "desktop" });
      const blocked = logLine(
        waiterSide.child,
        new RegExp(`"sessionId":"${key.sessionId}".*acquire waiting`),
      );
      const waiting = cw.acquire({ key, ttl: ms(60_000), wait: ms(60_000), holder: "browser" });
      await blocked;
      await c2.release({ key, runId: holder.lease?.runId ?? "" });
      const won = await waiting;
      expect(won.acquired).toBe(true);
      expect(won.lease?.fencingToken).toBeGreaterThan(holder.lease?.fencingToken ?? 0n);
      // Woken by the release, not by the deadline: the grant is dated long
      // before the released lease would have expired (database time).
      expect(won.lease?.acquiredAt?.seconds).toBeLessThan(
        (holder.lease?.expiresAt?.seconds ?? 0n) - 30n,
      );
    } finally {
      await waiterSide.stop();
    }
  });

  it("S1, S2: waiters on both instances, one key: exactly one wins per release", async () => {
    const key = freshKey("cross-many");
    const first = await c1.acquire({ key, ttl: ms(60_000), holder: "h0" });
    expect(first.acquired).toBe(true);
    const results: (AcquireResponse | undefined)[] = [];
    const order: number[] = [];
    const onSettle: (() => void)[] = [];
    const clients = [c1, c2, c1, c2, c1, c2];
    clients.forEach((c, i) => {
      void c.acquire({ key, ttl: ms(60_000), wait: ms(60_000), holder: `w${i}` }).then((r) => {
        results[i] = r;
        order.push(i);
        for (const notify of onSettle.splice(0)) notify();
      });
    });
    const nth = async (n: number) => {
      while (order.length < n) {
        await within(new Promise<void>((r) => onSettle.push(r)), {
          what: `waiter number ${n} to be answered`,
        });
      }
      return order[n - 1] ?? -1;
    };
    let current = { runId: first.lease?.runId ?? "", token: first.lease?.fencingToken ?? 0n };
    for (let round = 0; round < clients.length; round++) {
      await c2.release({ key, runId: current.runId });
      const result = results[await nth(round + 1)];
      expect(result?.acquired).toBe(true);
      expect(result?.lease?.fencingToken).toBeGreaterThan(current.token);
      // The winner holds the session, so no other waiter can have won:
      // exactly one settled for this release.
      expect((await c1.get({ key })).lease?.runId).toBe(result?.lease?.runId);
      expect(order).toHaveLength(round + 1);
      current = { runId: result?.lease?.runId ?? "", token: result?.lease?.fencingToken ?? 0n };
    }
    expect(new Set(results.map((r) => r?.lease?.runId)).size).toBe(clients.length);
  });

  it("L1, S9: a watcher on instance 2 sees EXPIRED at the deadline, confirmed by the database", async () => {
    const key = freshKey("cross-expire");
    const watch = openWatch(c2, key);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    const a = await c1.acquire({ key, ttl: ms(400), holder: "desktop" });
    await watch.reader.next(eventOf(EventType.ACQUIRED));
    const expired = await watch.reader.next(eventOf(EventType.EXPIRED));
    const event = expired.kind.case === "event" ? expired.kind.value : undefined;
    expect(event?.fencingToken).toBe(a.lease?.fencingToken);
    expect(event?.at).toEqual(a.lease?.expiresAt);
    // When the event arrived the database agreed the lease was over.
    const got = await c2.get({ key });
    expect(got.held).toBe(false);
    watch.abort();
  });

  it("S3: a handoff request through instance 2 reaches the holder's stream on instance 1 and a watcher; the lease stays", async () => {
    const key = freshKey("cross-handoff");
    const a = await c1.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const runId = a.lease?.runId ?? "";
    const stream = openKeepAlive(c1);
    stream.send({ key, runId });
    expect((await answerFor(stream, runId)).result.case).toBe("lease");
    const watch = openWatch(c1, key);
    await watch.reader.next((m) => m.kind.case === "snapshot");

    const asked = await c2.requestHandoff({
      key,
      requesterHolder: "browser",
      reason: "continue on this device",
    });
    expect(asked.delivered).toBe(true);
    expect(asked.current?.runId).toBe(runId);

    const handoff = await stream.reader.next((m) => m.result.case === "handoffRequested");
    expect(handoff.runId).toBe(runId);
    expect(handoff.result.case === "handoffRequested" && handoff.result.value).toMatchObject({
      requesterHolder: "browser",
      reason: "continue on this device",
    });
    const seen = await watch.reader.next(eventOf(EventType.HANDOFF_REQUESTED));
    expect(seen.kind.case === "event" && seen.kind.value).toMatchObject({
      runId,
      requesterHolder: "browser",
      holder: "desktop",
    });
    const still = await c2.get({ key });
    expect(still.lease?.runId).toBe(runId);
    stream.send({ key, runId });
    expect(
      (await stream.reader.next((m) => m.result.case !== "handoffRequested")).result.case,
    ).toBe("lease");
    const rows = await db.sql<{ type: string; holder: string; reason: string }[]>`
      SELECT type, holder, reason FROM lease_events
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} ORDER BY id`;
    expect(rows.map((r) => r.type)).toEqual(["acquired", "handoff_requested"]);
    stream.abort();
    watch.abort();
  });

  it("RENEWED reaches a watcher that asked for renewals, across instances, and only that one", async () => {
    const key = freshKey("cross-renewed");
    const a = await c1.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const runId = a.lease?.runId ?? "";
    const withRenewals = openWatch(c2, key, true);
    const without = openWatch(c2, key, false);
    await withRenewals.reader.next((m) => m.kind.case === "snapshot");
    await without.reader.next((m) => m.kind.case === "snapshot");
    const stream = openKeepAlive(c1);
    // The interest announcement travels like a change; renew until it took.
    let renewed: Awaited<ReturnType<typeof withRenewals.reader.next>> | undefined;
    for (let i = 0; i < 50 && !renewed; i++) {
      stream.send({ key, runId });
      await answerFor(stream, runId);
      renewed = await withRenewals.reader
        .next(eventOf(EventType.RENEWED), 200)
        .catch(() => undefined);
    }
    expect(renewed?.kind.case === "event" && renewed.kind.value.lease?.runId).toBe(runId);
    await c1.release({ key, runId });
    const next = await without.reader.next((m) => m.kind.case === "event");
    expect(next.kind.case === "event" && next.kind.value.type).toBe(EventType.RELEASED);
    stream.abort();
    withRenewals.abort();
    without.abort();
  });

  it("a watcher gets a fresh snapshot after its instance's notification connection is cut", async () => {
    const key = freshKey("cross-relisten");
    const watch = openWatch(c2, key);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    await db.sql`
      SELECT pg_terminate_backend(pid) FROM pg_stat_activity
      WHERE application_name = 'leasehold-listen' AND datname = current_database()`;
    const again = await watch.reader.next((m) => m.kind.case === "snapshot");
    expect(again.kind.case).toBe("snapshot");
    // And changes flow again afterwards.
    const a = await c1.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const seen = await watch.reader.next(eventOf(EventType.ACQUIRED));
    expect(seen.kind.case === "event" && seen.kind.value.runId).toBe(a.lease?.runId);
    watch.abort();
  });

  it("L1: a LISTEN connection lost while the database refuses connections comes back once it accepts them: a fresh snapshot, then changes", async () => {
    const key = freshKey("cross-refused");
    const watch = openWatch(c2, key);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    // A database cannot refuse connections to itself: say it from another one.
    const adminUrl = new URL(db.url);
    const name = decodeURIComponent(adminUrl.pathname.slice(1));
    adminUrl.pathname = "/postgres";
    const admin = postgres(adminUrl.toString(), { max: 1, onnotice: () => {} });
    const failuresBefore = await metricValue(
      two.url,
      "leasehold_notification_listen_failures_total",
    );
    await admin.unsafe(`ALTER DATABASE "${name}" ALLOW_CONNECTIONS false`);
    try {
      await admin`
        SELECT pg_terminate_backend(pid) FROM pg_stat_activity
        WHERE application_name = 'leasehold-listen' AND datname = ${name}`;
      // The instance tried to LISTEN again and was refused: the moment a
      // one-shot re-listen would have given up for good.
      await waitFor(
        async () =>
          (await metricValue(two.url, "leasehold_notification_listen_failures_total")) >
          failuresBefore,
        { what: "instance two to be refused a LISTEN connection", intervalMs: 50 },
      );
      expect(await metricValue(two.url, "leasehold_notification_listening")).toBe(0);
    } finally {
      await admin.unsafe(`ALTER DATABASE "${name}" ALLOW_CONNECTIONS true`);
      await admin.end();
    }
    const again = await watch.reader.next((m) => m.kind.case === "snapshot");
    expect(again.kind.case).toBe("snapshot");
    expect(await metricValue(two.url, "leasehold_notification_listening")).toBe(1);
    const a = await c1.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const seen = await watch.reader.next(eventOf(EventType.ACQUIRED));
    expect(seen.kind.case === "event" && seen.kind.value.runId).toBe(a.lease?.runId);
    watch.abort();
  });
});

describe("an instance dies", () => {
  it("L1, S1: killing the instance that carries a KeepAlive stream loses no lease when the client continues on the other one within the TTL", async () => {
    const doomed = await spawnServer(args);
    const cd = grpcClient(doomed.url);
    const key = freshKey("kill");
    const a = await cd.acquire({ key, ttl: ms(3_000), holder: "desktop" });
    const runId = a.lease?.runId ?? "";
    const stream = openKeepAlive(cd);
    stream.send({ key, runId });
    expect((await answerFor(stream, runId)).result.case).toBe("lease");

    await doomed.kill();
    await stream.reader.finished;
    expect(stream.reader.error).toBeDefined();

    const moved = openKeepAlive(c2);
    moved.send({ key, runId });
    const answer = await answerFor(moved, runId);
    expect(answer.result.case).toBe("lease");
    expect(answer.result.case === "lease" && answer.result.value.fencingToken).toBe(
      a.lease?.fencingToken,
    );
    const got = await c1.get({ key });
    expect(got.lease?.runId).toBe(runId);
    moved.abort();
  });

  it("S4: a KeepAlive renewal for a run whose instance died and whose TTL passed is answered lost(expired)", async () => {
    const key = freshKey("kill-late");
    const a = await c1.acquire({ key, ttl: ms(300), holder: "desktop" });
    const runId = a.lease?.runId ?? "";
    await db.sql`
      SELECT pg_sleep_until(expires_at + interval '1 millisecond') FROM leases
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    const stream = openKeepAlive(c2);
    stream.send({ key, runId });
    const answer = await answerFor(stream, runId);
    expect(answer.result.case === "lost" && answer.result.value.reason).toBe(LossReason.EXPIRED);
    stream.abort();
  });
});

describe("a client that stops reading", () => {
  it("does not stall other streams; its own stream ends with RESOURCE_EXHAUSTED", async () => {
    const stalledKey = freshKey("stall");
    const a = await c1.acquire({ key: stalledKey, ttl: ms(60_000), holder: "stalled" });
    const stalledRun = a.lease?.runId ?? "";
    // Its own connection; it sends renewals and reads nothing, so HTTP/2
    // flow control stops the server's writes to it.
    const stalled = openRawCall(one.url, "/leasehold.v1.LeaseService/KeepAlive");
    const request = frame(KeepAliveRequestSchema, { key: stalledKey, runId: stalledRun });
    const sent = 20_000;
    for (let i = 0; i < sent; i++) stalled.send(request);

    // Meanwhile another client keeps renewing through the same instance.
    const key = freshKey("unstalled");
    const b = await c1.acquire({ key, ttl: ms(60_000), holder: "reader" });
    const runId = b.lease?.runId ?? "";
    const healthy = openKeepAlive(c1);
    for (let i = 0; i < 20; i++) {
      healthy.send({ key, runId });
      expect((await answerFor(healthy, runId, 5_000)).result.case).toBe("lease");
    }
    healthy.abort();

    // Now read the stalled stream: it was ended rather than left to grow.
    stalled.read();
    const ended = await stalled.ended;
    expect(ended.status).toBe(Code.ResourceExhausted);
    expect(stalled.frames.length).toBeLessThan(sent);
    stalled.close();
    // Ending the stream released nothing.
    expect((await c1.get({ key: stalledKey })).lease?.runId).toBe(stalledRun);
  });
});

describe("loss reasons", () => {
  it("S4, S5: renewals of runs that lost their lease are answered lost with the reason", async () => {
    const stream = openKeepAlive(c2);
    const renew = async (key: { accountId: string; sessionId: string }, runId: string) => {
      stream.send({ key, runId });
      return answerFor(stream, runId);
    };
    const reasonOf = (m: Awaited<ReturnType<typeof renew>>) =>
      m.result.case === "lost" ? m.result.value.reason : m.result.case;

    const released = freshKey("lost-released");
    const r = await c1.acquire({ key: released, ttl: ms(60_000) });
    await c1.release({ key: released, runId: r.lease?.runId ?? "" });
    expect(reasonOf(await renew(released, r.lease?.runId ?? ""))).toBe(LossReason.RELEASED);

    const taken = freshKey("lost-taken");
    const t = await c1.acquire({ key: taken, ttl: ms(200) });
    await db.sql`
      SELECT pg_sleep_until(expires_at + interval '1 millisecond') FROM leases
      WHERE account_id = ${taken.accountId} AND session_id = ${taken.sessionId}`;
    expect((await c1.acquire({ key: taken, ttl: ms(60_000) })).acquired).toBe(true);
    expect(reasonOf(await renew(taken, t.lease?.runId ?? ""))).toBe(LossReason.TAKEN_OVER);

    const missing = freshKey("lost-missing");
    expect(reasonOf(await renew(missing, randomUUID()))).toBe(LossReason.NOT_FOUND);
    stream.abort();
  });
});
