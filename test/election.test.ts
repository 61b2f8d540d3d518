// Leader election (E1) against real servers and PostgreSQL: campaign,
// resign, proclaim, observe and the callbacks, through real sockets and a
// TCP proxy that stalls or drops the leader's or a candidate's connection.

import { randomUUID } from "node:crypto";
import { once } from "node:events";
import { createClient } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import {
  CanceledError,
  campaign,
  createEndpoint,
  type ElectionChange,
  fencingInterceptor,
  type Leadership,
  type LeaseClient,
  LeaseLostError,
  leader,
  observe,
  runElection,
  StaleFencingTokenError,
  type StopReason,
  toLeaseholdError,
  UnavailableError,
} from "../src/client/index.js";
import { GuardedStoreService } from "../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { useTestServer } from "./support/fixture.js";
import { startTcpProxy, type TcpProxy } from "./support/tcp-proxy.js";
import { waitFor, within } from "./support/wait.js";

const {
  db,
  server,
  libraryClient: client,
  defer,
  spawnServer,
  startGuardedServer,
} = useTestServer();

const accountId = "acme";
const election = (prefix: string) => ({ accountId, election: `${prefix}-${randomUUID()}` });

async function proxyTo(url: string): Promise<TcpProxy> {
  const proxy = await startTcpProxy(url);
  defer(() => proxy.close());
  return proxy;
}

function aborted(signal: AbortSignal): Promise<unknown> {
  return signal.aborted ? Promise.resolve() : once(signal, "abort");
}

/** The database clock now, in µs since the epoch. */
async function databaseNowUs(): Promise<bigint> {
  const [row] = await db.sql<{ us: bigint }[]>`
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us`;
  return row?.us ?? 0n;
}

const micros = (t: { seconds: bigint; nanos: number } | undefined) =>
  (t?.seconds ?? 0n) * 1_000_000n + BigInt(Math.floor((t?.nanos ?? 0) / 1000));

const waiting = () => server.streaming.waiters.stats.waiting;

describe("campaign", () => {
  it("E1, S1, S6: three candidates, one leader at a time, terms strictly increasing", async () => {
    const e = election("three");
    const leading = new Set<string>();
    const overlaps: string[] = [];
    const terms: bigint[] = [];
    const candidates = ["a", "b", "c"].map((name) => ({ name, c: client() }));
    const wins = candidates.map(({ name, c }) =>
      campaign(c, {
        ...e,
        value: name,
        ttlMs: 5_000,
        onStartedLeading: (term) => {
          if (leading.size > 0) overlaps.push(`${name} started while ${[...leading]} led`);
          leading.add(name);
          terms.push(term);
        },
        onStoppedLeading: () => leading.delete(name),
      }),
    );
    const order: Leadership[] = [];
    const pending = new Map(wins.map((p, i) => [i, p.then((l) => [i, l] as const)]));
    for (let round = 0; round < 3; round += 1) {
      const [index, leadership] = await within(Promise.race(pending.values()), {
        what: `leader number ${round + 1}`,
      });
      pending.delete(index);
      order.push(leadership);
      expect(await leader(candidates[0]?.c ?? client(), e)).toMatchObject({
        value: leadership.value,
        term: leadership.term,
        runId: leadership.runId,
      });
      if (round < 2) await waitFor(() => waiting() >= 2 - round, { what: "the others waiting" });
      await leadership.resign();
    }
    expect(overlaps).toEqual([]);
    expect(terms).toEqual(order.map((l) => l.term));
    expect(terms[0]).toBeLessThan(terms[1] ?? 0n);
    expect(terms[1]).toBeLessThan(terms[2] ?? 0n);
    expect(new Set(order.map((l) => l.value)).size).toBe(3);
    expect(await leader(client(), e)).toBeUndefined();
  });

  it("E1: candidates waiting on one instance lead in their arrival order (waiters.ts: one FIFO per key)", async () => {
    const e = election("fifo");
    const first = await campaign(client(), { ...e, value: "first", ttlMs: 60_000 });
    const names = ["b", "c", "d"];
    const wins: Promise<Leadership>[] = [];
    for (const [i, name] of names.entries()) {
      wins.push(campaign(client(), { ...e, value: name, ttlMs: 60_000 }));
      await waitFor(() => waiting() >= i + 1, { what: `${name} waiting` });
    }
    await first.resign();
    const order: string[] = [];
    for (const win of wins) {
      const leadership = await within(win, { what: "the next in line to lead", timeoutMs: 5_000 });
      order.push(leadership.value);
      await leadership.resign();
    }
    expect(order).toEqual(names);
  });

  it("E1: resign hands over at once to the waiting candidate", async () => {
    const e = election("resign");
    const first = await campaign(client(), { ...e, value: "first", ttlMs: 60_000 });
    const next = campaign(client(), { ...e, value: "second", ttlMs: 60_000 });
    await waitFor(() => waiting() >= 1, { what: "the second candidate waiting" });
    await first.resign();
    expect(first.signal.aborted).toBe(true);
    const second = await within(next, { what: "the second candidate to lead", timeoutMs: 5_000 });
    expect(second.term).toBeGreaterThan(first.term);
    // Granted long before the first term's 60 s deadline: by the release.
    expect(micros(second.lease.acquiredAt)).toBeLessThan(
      micros(first.lease.expiresAt) - 50_000_000n,
    );
    await second.resign();
  });

  it("E1: proclaim changes the value in the same term; refused once leadership is over", async () => {
    const e = election("proclaim");
    const c = client();
    const leadership = await campaign(c, { ...e, value: "v1", ttlMs: 10_000 });
    await leadership.proclaim("v2");
    expect(leadership.value).toBe("v2");
    expect(await leader(c, e)).toMatchObject({ value: "v2", term: leadership.term });
    await leadership.resign();
    await expect(leadership.proclaim("v3")).rejects.toBeInstanceOf(LeaseLostError);
    expect(await leader(c, e)).toBeUndefined();
    await expect(campaign(c, { ...e, value: "x".repeat(65) })).rejects.toMatchObject({
      field: "value",
    });
  });

  it("E1, L2, S7: the leader's stream stalled stops leading before the next one starts; the new term passes the fence, which then refuses the old term", async () => {
    const guarded = await startGuardedServer(["--lease-url", server.url]);
    const endpoint = createEndpoint(guarded.url, { interceptors: [fencingInterceptor()] });
    defer(() => endpoint.close());
    const store = createClient(GuardedStoreService, endpoint.transport);
    const text = (s: string) => new TextEncoder().encode(s);
    const e = election("stall");
    const key = { accountId, sessionId: e.election };
    const proxy = await proxyTo(server.url);
    const old = await campaign(client({ baseUrl: proxy.url }), {
      ...e,
      value: "old",
      ttlMs: 2_000,
      safetyMarginMs: 600,
    });
    await store.put(
      { key, name: "doc", value: text("old"), fencingToken: old.term },
      old.callOptions(),
    );
    const next = campaign(client(), { ...e, value: "new", ttlMs: 5_000 });
    await waitFor(() => waiting() >= 1, { what: "the next candidate waiting" });
    proxy.stall();
    await aborted(old.signal);
    const stoppedBeforeUs = await databaseNowUs();
    const why = await old.ended;
    expect(why.kind).toBe("lost");
    expect((old.signal.reason as LeaseLostError).lossReason).toBe("deadline");
    const successor = await within(next, { what: "the successor to lead" });
    // L2 on the database clock: the old leader had stopped (its signal
    // aborted before the reading above) before the successor was granted.
    expect(stoppedBeforeUs).toBeLessThan(micros(successor.lease.acquiredAt));
    expect(successor.term).toBeGreaterThan(old.term);
    await store.put(
      { key, name: "doc", value: text("new"), fencingToken: successor.term },
      successor.callOptions(),
    );
    const late = await store
      .put({ key, name: "doc", value: text("old again"), fencingToken: old.term })
      .catch((error: unknown) => toLeaseholdError(error));
    expect(late).toBeInstanceOf(StaleFencingTokenError);
    expect(() => old.headers()).toThrow(LeaseLostError);
    const doc = await store.get({ key, name: "doc" });
    expect(new TextDecoder().decode(doc.value)).toBe("new");
    proxy.pass();
    await successor.resign();
  });

  it("E1: a waiting candidate whose connection is lost aborts and leaves no candidate behind", async () => {
    const e = election("lost-waiter");
    const key = { accountId, sessionId: e.election };
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const proxy = await proxyTo(server.url);
    const stopped: bigint[] = [];
    const lost = campaign(client({ baseUrl: proxy.url }), {
      ...e,
      value: "lost",
      ttlMs: 60_000,
      onStoppedLeading: (term) => stopped.push(term),
    }).catch((error: unknown) => error);
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting" });
    proxy.drop();
    expect(await within(lost, { what: "the campaign to fail" })).toBeInstanceOf(UnavailableError);
    // The server dropped the waiter with its call.
    await waitFor(() => waiting() === 0, { what: "no waiter left on the server" });
    // The next candidate is granted at once when the leader resigns.
    const third = campaign(client(), { ...e, value: "third", ttlMs: 60_000 });
    await waitFor(() => waiting() >= 1, { what: "the third candidate waiting" });
    await holder.resign();
    const won = await within(third, { what: "the third candidate to lead", timeoutMs: 5_000 });
    expect(won.value).toBe("third");
    const grants = await db.sql<{ holder: string }[]>`
      SELECT holder FROM lease_events
      WHERE account_id = ${accountId} AND session_id = ${key.sessionId} AND type = 'acquired'
      ORDER BY id`;
    expect(grants.map((g) => g.holder)).toEqual(["holder", "third"]);
    expect(stopped).toEqual([]);
    await won.resign();
  });

  it("E1: a campaign cancelled while waiting rejects with CanceledError and leaves no waiter", async () => {
    const e = election("cancel-waiting");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const cancel = new AbortController();
    const waiter = campaign(
      client(),
      { ...e, value: "waiter", ttlMs: 60_000 },
      { signal: cancel.signal },
    ).catch((error: unknown) => error);
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting" });
    cancel.abort();
    expect(await waiter).toBeInstanceOf(CanceledError);
    await waitFor(() => waiting() === 0, { what: "no waiter left on the server" });
    await holder.resign();
    expect(await leader(client(), e)).toBeUndefined();
  });

  it("E1, L2: a waited grant whose answer arrives after its lease expired is no term: the campaign goes on with a new run and leads", async () => {
    const e = election("late-expired");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const proxy = await proxyTo(server.url);
    const pending = campaign(client({ baseUrl: proxy.url }), { ...e, value: "late", ttlMs: 1_000 });
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting" });
    // Its grant is made while the answer is held on the way back, and
    // expires on the database clock before the answer arrives.
    proxy.stall();
    await holder.resign();
    const grant = async () => {
      const [row] = await db.sql<{ runId: string; fencingToken: bigint }[]>`
        SELECT run_id, fencing_token FROM leases
        WHERE account_id = ${e.accountId} AND session_id = ${e.election}
          AND run_id <> ${holder.runId}::uuid`;
      return row;
    };
    await waitFor(async () => (await grant()) !== undefined, { what: "the held-back grant" });
    const late = await grant();
    await db.sql`
      SELECT pg_sleep_until(expires_at + interval '50 milliseconds') FROM leases
      WHERE account_id = ${e.accountId} AND session_id = ${e.election}`;
    proxy.pass();
    const won = await within(pending, { what: "the campaign to lead", timeoutMs: 10_000 });
    expect(won.runId).not.toBe(late?.runId);
    expect(won.term).toBeGreaterThan(late?.fencingToken ?? 0n);
    await won.resign();
  });

  it("E1: a campaign whose timeout passes is not acquired and names the leader", async () => {
    const e = election("timeout");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const error = await campaign(client(), { ...e, value: "late", timeoutMs: 300 }).catch(
      (failure: unknown) => failure,
    );
    expect(error).toMatchObject({ name: "NotAcquiredError" });
    expect((error as { current?: { holder: string } }).current?.holder).toBe("holder");
    await waitFor(() => waiting() === 0, { what: "no waiter left on the server" });
    await holder.resign();
  });
});

describe("onStoppedLeading", () => {
  async function endedBy(
    end: (leadership: Leadership, cancel: AbortController) => Promise<unknown> | unknown,
  ): Promise<{ calls: [bigint, StopReason][]; term: bigint; left: unknown }> {
    const e = election("stopped");
    const calls: [bigint, StopReason][] = [];
    const started: bigint[] = [];
    const cancel = new AbortController();
    const leadership = await campaign(
      client(),
      {
        ...e,
        value: "me",
        ttlMs: 5_000,
        onStartedLeading: (term) => started.push(term),
        onStoppedLeading: (term, reason) => calls.push([term, reason]),
      },
      { signal: cancel.signal },
    );
    expect(started).toEqual([leadership.term]);
    await end(leadership, cancel);
    await leadership.ended;
    // Whatever comes after, no second call.
    await leadership.resign();
    cancel.abort();
    return { calls, term: leadership.term, left: await leader(client(), e) };
  }

  it("E1: exactly once per term when it resigns", async () => {
    const { calls, term, left } = await endedBy((l) => l.resign());
    expect(left).toBeUndefined();
    expect(calls).toEqual([[term, { kind: "resigned" }]]);
  });

  it("E1: exactly once per term when it is revoked (lost, revoked)", async () => {
    const { calls, term } = await endedBy((l) =>
      createLeaseStore(db.sql).revoke(l.key, "an operator ended it"),
    );
    expect(calls.length).toBe(1);
    expect(calls[0]?.[0]).toBe(term);
    expect(calls[0]?.[1].kind).toBe("lost");
    const reason = calls[0]?.[1];
    expect(reason?.kind === "lost" && reason.cause.lossReason).toBe("revoked");
  });

  it("E1: exactly once per term when its caller cancels (and the lease is released)", async () => {
    const { calls, term, left } = await endedBy((_, cancel) =>
      cancel.abort(new Error("shutting down")),
    );
    expect(left).toBeUndefined();
    expect(calls.length).toBe(1);
    expect(calls[0]?.[0]).toBe(term);
    expect(calls[0]?.[1].kind).toBe("cancelled");
  });

  it("E1, L2: exactly once per term when it is lost (its stream stalled past the local deadline)", async () => {
    const proxy = await proxyTo(server.url);
    const e = election("stopped-stall");
    const calls: [bigint, StopReason][] = [];
    const leadership = await campaign(client({ baseUrl: proxy.url }), {
      ...e,
      value: "me",
      ttlMs: 1_500,
      safetyMarginMs: 500,
      onStoppedLeading: (term, reason) => calls.push([term, reason]),
    });
    proxy.stall();
    await leadership.ended;
    await leadership.resign();
    proxy.pass();
    expect(calls.length).toBe(1);
    expect(calls[0]?.[0]).toBe(leadership.term);
    const reason = calls[0]?.[1];
    expect(reason?.kind === "lost" && reason.cause.lossReason).toBe("deadline");
  });

  it("E1: runElection runs lead per term, calls the callbacks once per term, and campaigns again", async () => {
    const e = election("run");
    const c = client();
    const stop = new AbortController();
    const started: bigint[] = [];
    const stopped: bigint[] = [];
    const leaders: bigint[] = [];
    let terms = 0;
    await runElection(
      c,
      {
        ...e,
        value: "me",
        ttlMs: 5_000,
        onStartedLeading: (term) => started.push(term),
        onStoppedLeading: (term) => stopped.push(term),
        onNewLeader: (l) => leaders.push(l.term),
      },
      async (leadership) => {
        terms += 1;
        expect(leadership.signal.aborted).toBe(false);
        if (terms === 2) stop.abort();
      },
      { signal: stop.signal },
    );
    expect(terms).toBe(2);
    expect(started.length).toBe(2);
    expect(stopped).toEqual(started);
    expect(started[0]).toBeLessThan(started[1] ?? 0n);
    expect(await leader(c, e)).toBeUndefined();
  });
});

describe("campaign on a keeper", () => {
  it("E1, K1: the leader's lease is on the keeper, proclaim keeps the term there, and the keeper's stall ends the term once", async () => {
    const e = election("keeper-leader");
    const proxy = await proxyTo(server.url);
    const c = client({ baseUrl: proxy.url });
    const keeper = await c.openKeeper({ accountId, ttlMs: 2_000 });
    const stopped: [bigint, StopReason][] = [];
    const leadership = await campaign(c, {
      ...e,
      value: "on-keeper",
      keeper,
      onStoppedLeading: (term, reason) => stopped.push([term, reason]),
    });
    const [row] = await db.sql<{ keeperId: string | null }[]>`
      SELECT keeper_id::text FROM leases
      WHERE account_id = ${accountId} AND session_id = ${e.election}`;
    expect(row?.keeperId).toBe(keeper.id);
    await leadership.proclaim("on-keeper-2");
    expect(await leader(client(), e)).toMatchObject({
      value: "on-keeper-2",
      term: leadership.term,
    });
    proxy.stall();
    const why = await leadership.ended;
    expect(why.kind).toBe("lost");
    expect(keeper.signal.aborted).toBe(true);
    await leadership.resign();
    proxy.pass();
    expect(stopped.length).toBe(1);
    expect(stopped[0]?.[0]).toBe(leadership.term);
  });

  it("E1: a waiting candidate whose keeper is lost aborts and leaves no candidate behind", async () => {
    const e = election("keeper-waiter");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const proxy = await proxyTo(server.url);
    const c = client({ baseUrl: proxy.url });
    const keeper = await c.openKeeper({ accountId, ttlMs: 1_500 });
    const lost = campaign(c, { ...e, value: "lost", keeper }).catch((error: unknown) => error);
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting on its keeper" });
    proxy.drop();
    expect(await within(lost, { what: "the campaign to fail" })).toBeInstanceOf(LeaseLostError);
    await waitFor(() => waiting() === 0, { what: "no waiter left on the server" });
    const third = campaign(client(), { ...e, value: "third", ttlMs: 60_000 });
    await waitFor(() => waiting() >= 1, { what: "the third candidate waiting" });
    await holder.resign();
    const won = await within(third, { what: "the third candidate to lead", timeoutMs: 5_000 });
    expect(won.value).toBe("third");
    expect(micros(won.lease.acquiredAt)).toBeLessThan(micros(holder.lease.expiresAt) - 50_000_000n);
    await won.resign();
  });
  it("E1: a campaign on a keeper cancelled while waiting leaves no waiter (its run released on the stream); the keeper goes on", async () => {
    const e = election("keeper-cancel");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const c = client();
    const keeper = await c.openKeeper({ accountId, ttlMs: 30_000 });
    const cancel = new AbortController();
    const cancelled = campaign(
      c,
      { ...e, value: "cancelled", keeper },
      { signal: cancel.signal },
    ).catch((error: unknown) => error);
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting on its keeper" });
    cancel.abort();
    expect(await cancelled).toBeInstanceOf(CanceledError);
    // Given up on the server at once, not when its wait (60 s) runs out.
    await waitFor(() => waiting() === 0, { what: "no waiter left on the server" });
    await holder.resign();
    expect(await leader(client(), e)).toBeUndefined();
    expect(keeper.signal.aborted).toBe(false);
    const other = { accountId, sessionId: `other-${randomUUID()}` };
    expect((await keeper.acquire({ key: other })).acquired).toBe(true);
    await keeper.close();
  });
  it("E1, K1: a waiting candidate whose keeper stalls aborts; the server refuses its stale waiter once the keeper expired, and the next candidate is granted at once", async () => {
    const e = election("keeper-waiter-stall");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const proxy = await proxyTo(server.url);
    const c = client({ baseUrl: proxy.url });
    const keeper = await c.openKeeper({ accountId, ttlMs: 1_500 });
    const lost = campaign(c, { ...e, value: "lost", keeper }).catch((error: unknown) => error);
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting on its keeper" });
    proxy.stall();
    expect(await within(lost, { what: "the campaign to fail" })).toBeInstanceOf(LeaseLostError);
    // The server has not seen the stall: the waiter stays queued until the
    // keeper's deadline passes on the database clock, and is never granted
    // after it (K1): the Keep stream's check at the deadline ends the keeper
    // and refuses its waiter.
    await db.sql`SELECT pg_sleep_until(expires_at) FROM keepers WHERE id = ${keeper.id}::uuid`;
    await waitFor(() => waiting() === 0, { what: "the stale waiter refused" });
    const third = campaign(client(), { ...e, value: "third", ttlMs: 60_000 });
    await waitFor(() => waiting() >= 1, { what: "the third candidate waiting" });
    await holder.resign();
    const won = await within(third, { what: "the third candidate to lead", timeoutMs: 5_000 });
    expect(won.value).toBe("third");
    expect(micros(won.lease.acquiredAt)).toBeLessThan(micros(holder.lease.expiresAt) - 50_000_000n);
    await won.resign();
  });
});

describe("runElection", () => {
  it("E1: a waiting campaign whose connection is lost is started again, and leads once the leader resigns", async () => {
    const e = election("run-retry");
    const holder = await campaign(client(), { ...e, value: "holder", ttlMs: 60_000 });
    const proxy = await proxyTo(server.url);
    const stop = new AbortController();
    const led: bigint[] = [];
    const running = runElection(
      client({ baseUrl: proxy.url }),
      { ...e, value: "patient", ttlMs: 60_000, again: false },
      async (leadership) => {
        led.push(leadership.term);
      },
      { signal: stop.signal },
    );
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting" });
    proxy.drop();
    await waitFor(() => waiting() === 0, { what: "the lost waiter dropped by the server" });
    await waitFor(() => proxy.accepted >= 2, { what: "the campaign started again (refused)" });
    proxy.pass();
    await waitFor(() => waiting() >= 1, { what: "the candidate waiting again" });
    await holder.resign();
    await within(running, { what: "runElection to lead one term and stop" });
    expect(led.length).toBe(1);
    expect(led[0]).toBeGreaterThan(holder.term);
    expect(await leader(client(), e)).toBeUndefined();
  });
});

/**
 * Observes `e` through `watcher` in the background: every change seen so
 * far, a wait for the n-th, and a stop that ends the iteration.
 */
function observing(watcher: LeaseClient, e: { accountId: string; election: string }) {
  const seen: ElectionChange[] = [];
  const arrived: (() => void)[] = [];
  const stopping = new AbortController();
  const reading = (async () => {
    for await (const change of observe(watcher, e, { signal: stopping.signal })) {
      seen.push(change);
      for (const notify of arrived.splice(0)) notify();
    }
  })();
  const count = async (n: number) => {
    while (seen.length < n) {
      await within(new Promise<void>((resolve) => arrived.push(resolve)), {
        what: `change number ${n}`,
      });
    }
  };
  const stop = async () => {
    stopping.abort();
    await reading;
  };
  return { seen, count, stop };
}

describe("observe", () => {
  it("E1: yields the current leader first, then every change in order, across an instance stopped mid-watch", async () => {
    const [one, two] = await Promise.all([spawnServer(), spawnServer()]);
    const e = election("observe");
    // The watcher reaches the second instance through a proxy, refused while
    // the changes below are made: they can only reach it through History.
    const toTwo = await proxyTo(two.url);
    const watcher = client({ baseUrls: [one.url, toTwo.url] });
    const actor = client({ baseUrl: two.url });
    const first = await campaign(actor, { ...e, value: "first", ttlMs: 10_000 });

    const { seen, count, stop } = observing(watcher, e);
    await count(1);
    await first.proclaim("first-v2");
    await count(2);
    await first.resign();
    await count(3);
    // The watcher's instance stops; before its watch can be back on the
    // other instance, two terms begin and one ends.
    toTwo.drop();
    await one.stop();
    const second = await campaign(actor, { ...e, value: "second", ttlMs: 10_000 });
    await second.resign();
    const third = await campaign(actor, { ...e, value: "third", ttlMs: 10_000 });
    toTwo.pass();
    await count(6);
    await third.resign();
    await count(7);
    await stop();

    expect(seen.map((c) => [c.type, "leader" in c ? c.leader?.term : c.term])).toEqual([
      ["current", first.term],
      ["proclaimed", first.term],
      ["ended", first.term],
      ["elected", second.term],
      ["ended", second.term],
      ["elected", third.term],
      ["ended", third.term],
    ]);
    expect(seen[1]).toMatchObject({ leader: { value: "first-v2" } });
    expect(seen[3]).toMatchObject({ leader: { value: "second" } });
    expect(seen[6]).toMatchObject({ how: "resigned" });
  });

  it("E1: a term granted between a fresh snapshot and the History read after it is seen elected, not ended, and its end is seen once", async () => {
    const e = election("observe-gap");
    const toServer = await proxyTo(server.url);
    const actor = client();
    const real = client({ baseUrl: toServer.url });
    // The first History read (the one after the reconnect's snapshot) first
    // lets a new term begin: the snapshot shows no leader, History shows it.
    let second: Leadership | undefined;
    let hooked = false;
    // The observer's reading of the session after that History read: the
    // term must not end before it, or the observer rightly finds it over.
    let checked: () => void = () => {};
    const reconciled = new Promise<void>((resolve) => {
      checked = resolve;
    });
    const watcher = new Proxy(real, {
      get(target, name, receiver) {
        if (name === "history") {
          return async (...args: Parameters<typeof real.history>) => {
            if (!hooked) {
              hooked = true;
              second = await campaign(actor, { ...e, value: "second", ttlMs: 30_000 });
            }
            return target.history(...args);
          };
        }
        if (name === "get" && hooked) {
          return async (...args: Parameters<typeof real.get>) => {
            const answer = await target.get(...args);
            checked();
            return answer;
          };
        }
        return Reflect.get(target, name, receiver);
      },
    });
    const { seen, count, stop } = observing(watcher, e);
    await count(1);
    const first = await campaign(actor, { ...e, value: "first", ttlMs: 30_000 });
    await count(2);
    await first.resign();
    await count(3);
    // The watch is cut; it comes back with a fresh snapshot (no leader).
    toServer.drop();
    toServer.pass();
    await count(4);
    await within(reconciled, { what: "the observer's Get after the History read" });
    expect(second).toBeDefined();
    await second?.resign();
    await count(5);
    await stop();
    expect(seen.map((c) => [c.type, "leader" in c ? c.leader?.term : c.term])).toEqual([
      ["current", undefined],
      ["elected", first.term],
      ["ended", first.term],
      ["elected", second?.term],
      ["ended", second?.term],
    ]);
    expect(seen[4]).toMatchObject({ how: "resigned" });
  });

  it("E1: a term that expires with no successor is seen as ended, expired", async () => {
    const proxy = await proxyTo(server.url);
    const e = election("observe-expiry");
    const seen: ElectionChange[] = [];
    const stop = new AbortController();
    const gone = (async () => {
      for await (const change of observe(client(), e, { signal: stop.signal })) {
        seen.push(change);
        if (change.type === "ended") return;
      }
    })();
    await waitFor(() => seen.length >= 1, { what: "the current leader (none)" });
    const l = await campaign(client({ baseUrl: proxy.url }), {
      ...e,
      value: "brief",
      ttlMs: 1_000,
      safetyMarginMs: 300,
    });
    proxy.drop();
    await within(gone, { what: "the expiry to be observed" });
    stop.abort();
    expect(seen.map((c) => c.type)).toEqual(["current", "elected", "ended"]);
    expect(seen[0]).toMatchObject({ leader: undefined });
    expect(seen[2]).toMatchObject({ term: l.term, how: "expired" });
  });
});
