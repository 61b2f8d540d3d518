// The Keep stream (docs/keepers.md) on a server in this process, over real
// sockets with the Connect client's gRPC transport, on each of the two paths
// that serve gRPC (the native path, native-streams.ts, and connect-node's,
// keep-service.ts). K1 over the stream: one heartbeat keeps every lease on
// the keeper; without heartbeats every lease ends at the keeper's deadline
// (waited for on the database clock), and a late heartbeat is answered
// `lost`. S1, S3, S5, S6 for the keeper's leases; answers by id in any order
// (a waiting acquire does not hold up a heartbeat); bad input in one request
// is answered in that request's error, and the keeper goes on.

import { randomUUID } from "node:crypto";
import { fromBinary } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import type { Status } from "../src/gen/google/rpc/status_pb.js";
import { EventType, type KeepResponse, LossReason } from "../src/gen/leasehold/v1/lease_pb.js";
import { defaultLimits } from "../src/lease/limits.js";
import { openTransaction } from "./support/db.js";
import { useTestServer } from "./support/fixture.js";
import { grpcClient } from "./support/server.js";
import { ms, openKeep, openWatch } from "./support/streams.js";
import { waitFor } from "./support/wait.js";

/** The error a request was answered with, or a failure naming what came instead. */
function errorOf(m: KeepResponse): Status {
  if (m.result.case !== "error") throw new Error(`expected an error, got ${m.result.case}`);
  return m.result.value;
}

/** The ErrorInfo of a request's error. */
function errorInfo(status: Status) {
  const any = status.details.find((d) => d.typeUrl.endsWith("google.rpc.ErrorInfo"));
  if (!any) throw new Error("no ErrorInfo in the error's details");
  return fromBinary(ErrorInfoSchema, any.value);
}

const account = (name: string) => `acct-${name}-${randomUUID().slice(0, 8)}`;

for (const mode of ["native", "connect"] as const) {
  describe(`Keep on --grpc-path ${mode}`, () => {
    const { db, client, server, startServer } = useTestServer({
      args: ["--grpc-path", mode],
      overrides: { limits: { ...defaultLimits, minTtlMs: 50 } },
    });

    /** Opens a keeper on a new stream; its answer is checked. */
    async function opened(
      accountId: string,
      ttlMs: number,
      lockDelayMs = 0,
      keeperId = "",
      on = client,
    ) {
      const keep = openKeep(on);
      keep.send({
        id: 1n,
        op: {
          case: "open",
          value: {
            accountId,
            keeperId,
            holder: "worker",
            ttl: ms(ttlMs),
            lockDelay: ms(lockDelayMs),
          },
        },
      });
      const answer = await keep.answer(1n);
      if (answer.result.case !== "keeper") throw new Error(`open answered ${answer.result.case}`);
      return { keep, keeper: answer.result.value };
    }

    let nextId = 100n;
    /** Sends one request and waits for its answer. */
    async function ask(
      keep: ReturnType<typeof openKeep>,
      op: Parameters<ReturnType<typeof openKeep>["send"]>[0]["op"],
    ) {
      const id = nextId++;
      keep.send({ id, op });
      return keep.answer(id);
    }

    it("K1: a heartbeat keeps every lease on the keeper; without one, every lease ends at the keeper's deadline, Get shows none and a late heartbeat is answered lost", async () => {
      const accountId = account("k1");
      const { keep, keeper } = await opened(accountId, 1_500);
      expect(keeper.keeperId).toMatch(/^[0-9a-f-]{36}$/);
      expect(keeper.accountId).toBe(accountId);
      const sessions = ["a", "b", "c", "d", "e"];
      for (const sessionId of sessions) {
        const a = await ask(keep, { case: "acquire", value: { key: { accountId, sessionId } } });
        if (a.result.case !== "acquire") throw new Error(`acquire answered ${a.result.case}`);
        expect(a.result.value.acquired).toBe(true);
        expect(a.result.value.lease?.keeperId).toBe(keeper.keeperId);
      }
      // A heartbeat moves the deadline of every lease: Get (unary) reports
      // the keeper's new deadline for each.
      const beat = await ask(keep, { case: "heartbeat", value: {} });
      if (beat.result.case !== "keeper") throw new Error(`heartbeat answered ${beat.result.case}`);
      const deadline = beat.result.value.expiresAt;
      expect(deadline).toBeDefined();
      for (const sessionId of sessions) {
        const got = await client.get({ key: { accountId, sessionId } });
        expect(got.held).toBe(true);
        expect(got.lease?.keeperId).toBe(keeper.keeperId);
        expect(got.lease?.expiresAt).toEqual(deadline);
      }
      // No more heartbeats: past the keeper's deadline on the database clock,
      // every lease is over at once.
      await db.sql`
        SELECT pg_sleep_until(expires_at + interval '1 millisecond')
        FROM keepers WHERE id = ${keeper.keeperId}::uuid`;
      for (const sessionId of sessions) {
        expect((await client.get({ key: { accountId, sessionId } })).held).toBe(false);
      }
      // S4: the late heartbeat fails. The stream is told `lost` once: as
      // that heartbeat's answer, or unasked (id 0) when the server's check
      // at the keeper's deadline found it first; then it ends OK.
      const lateId = nextId++;
      keep.send({ id: lateId, op: { case: "heartbeat", value: {} } });
      const lost = await keep.reader.take((m) => m.result.case === "lost");
      expect([0n, lateId]).toContain(lost.id);
      expect(lost.result.case === "lost" && lost.result.value.reason).toBe(LossReason.EXPIRED);
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
      expect(keep.reader.pending().filter((m) => m.result.case === "keeper")).toEqual([]);
    });

    it("a heartbeat with a ttl gives the keeper that TTL from then on; a re-attach takes the TTL it names; a ttl out of bounds is refused in that heartbeat's error", async () => {
      const accountId = account("ttl");
      const keeperId = randomUUID();
      const { keep } = await opened(accountId, 30_000, 0, keeperId);
      const beat = await ask(keep, { case: "heartbeat", value: { ttl: ms(45_000) } });
      if (beat.result.case !== "keeper") throw new Error(`heartbeat answered ${beat.result.case}`);
      expect(beat.result.value.ttl?.seconds).toBe(45n);
      expect(beat.result.value.remaining?.seconds).toBeGreaterThan(40n);
      const plain = await ask(keep, { case: "heartbeat", value: {} });
      expect(plain.result.case === "keeper" && plain.result.value.ttl?.seconds).toBe(45n);
      const tooLong = errorOf(
        await ask(keep, { case: "heartbeat", value: { ttl: ms(7_200_000) } }),
      );
      expect(errorInfo(tooLong).metadata.field).toBe("heartbeat.ttl");
      keep.abort();
      await keep.reader.finished;
      const again = await opened(accountId, 20_000, 0, keeperId);
      expect(again.keeper.ttl?.seconds).toBe(20n);
      again.keep.abort();
    });

    it("S1, S3, S5, S6 on a keeper's leases: another run is refused while the keeper lives, Release is owner-checked, a re-acquire gets a higher token", async () => {
      const accountId = account("s1");
      const { keep, keeper } = await opened(accountId, 30_000);
      const key = { accountId, sessionId: "shared" };
      const a = await ask(keep, { case: "acquire", value: { key } });
      if (a.result.case !== "acquire" || !a.result.value.lease) throw new Error("not acquired");
      const lease = a.result.value.lease;

      // S1, S3: another run (unary) is refused and told who holds it.
      const other = await client.acquire({ key, ttl: ms(5_000) });
      expect(other.acquired).toBe(false);
      expect(other.current?.runId).toBe(lease.runId);
      expect(other.current?.keeperId).toBe(keeper.keeperId);

      // S5: a release of another run ends nothing; the owner's does.
      const wrong = await ask(keep, { case: "release", value: { key, runId: randomUUID() } });
      expect(wrong.result.case === "release" && wrong.result.value.released).toBe(false);
      const got = await ask(keep, { case: "get", value: { key } });
      expect(got.result.case === "get" && got.result.value.lease?.runId).toBe(lease.runId);
      const right = await ask(keep, { case: "release", value: { key, runId: lease.runId } });
      expect(right.result.case === "release" && right.result.value.released).toBe(true);

      // S6: the next grant of the key has a higher token.
      const again = await ask(keep, { case: "acquire", value: { key } });
      if (again.result.case !== "acquire" || !again.result.value.lease) throw new Error("no grant");
      expect(again.result.value.lease.fencingToken).toBeGreaterThan(lease.fencingToken);

      // Close: answered, then the stream ends OK, and every lease is released.
      const closed = await ask(keep, { case: "close", value: {} });
      expect(closed.result.case).toBe("keeper");
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
      expect((await client.get({ key })).held).toBe(false);
    });

    it("a release of a run whose acquire waits on the stream gives that acquire up (CANCELLED) and leaves no waiter; the next candidate is granted at once", async () => {
      const accountId = account("give-up");
      const { keep } = await opened(accountId, 30_000);
      const key = { accountId, sessionId: "contended" };
      const blocker = await client.acquire({ key, ttl: ms(30_000) });
      if (!blocker.lease) throw new Error("blocker not acquired");
      const runId = randomUUID();
      keep.send({ id: 9n, op: { case: "acquire", value: { key, runId, wait: ms(60_000) } } });
      await waitFor(() => server.streaming.waiters.stats.waiting === 1, {
        what: "the acquire waiting",
      });
      const released = await ask(keep, { case: "release", value: { key, runId } });
      expect(released.result.case === "release" && released.result.value.released).toBe(false);
      expect(errorOf(await keep.answer(9n)).code).toBe(Code.Canceled);
      expect(server.streaming.waiters.stats.waiting).toBe(0);
      // Nothing of the given-up run is left to be granted: the blocker's
      // release lets the next run in, and the stream goes on.
      await client.release({ key, runId: blocker.lease.runId });
      const next = await client.acquire({ key, ttl: ms(5_000) });
      expect(next.acquired).toBe(true);
      const beat = await ask(keep, { case: "heartbeat", value: {} });
      expect(beat.result.case).toBe("keeper");
      const events = await db.sql<{ runId: string }[]>`
        SELECT run_id FROM lease_events
        WHERE account_id = ${accountId} AND session_id = ${key.sessionId} AND type = 'acquired'`;
      expect(events.map((e) => e.runId)).not.toContain(runId);
    });

    /**
     * A waiting acquire of `runId` whose attempt is deciding, held on the
     * lease row by a transaction that frees the key, is given up by a
     * release of its run; then the transaction commits and the attempt
     * grants the key to the given-up run.
     */
    async function giveUpDuringAttempt(name: string, waitMs: number, serverArgs: string[]) {
      // A lock wait long enough to hold the attempt while the release arrives.
      const other = await startServer(
        ["--grpc-path", mode, "--lock-timeout", "30s", ...serverArgs],
        { limits: { ...defaultLimits, minTtlMs: 50 } },
      );
      const there = grpcClient(other.url);
      const accountId = account(name);
      const { keep } = await opened(accountId, 30_000, 0, "", there);
      const key = { accountId, sessionId: "contended" };
      const blocker = await there.acquire({ key, ttl: ms(60_000) });
      if (!blocker.lease) throw new Error("blocker not acquired");
      const runId = randomUUID();
      keep.send({ id: 9n, op: { case: "acquire", value: { key, runId, wait: ms(waitMs) } } });
      await waitFor(() => other.streaming.waiters.stats.waiting === 1, {
        what: "the acquire waiting",
      });
      const lockWaits = async () =>
        (
          await db.sql`SELECT 1 FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock'`
        ).length;
      const freeing = await openTransaction(
        db,
        (tx) => tx`UPDATE leases SET expires_at = acquired_at
          WHERE account_id = ${accountId} AND session_id = ${key.sessionId}`,
      );
      try {
        await waitFor(async () => (await lockWaits()) >= 1, {
          what: "an attempt waiting on the lease row",
          timeoutMs: 5_000,
        });
        // The release gives the acquire up as it arrives (the heartbeat
        // behind it is answered once it has).
        keep.send({ id: 10n, op: { case: "release", value: { key, runId } } });
        const beat = await ask(keep, { case: "heartbeat", value: {} });
        expect(beat.result.case).toBe("keeper");
      } finally {
        await freeing.end();
      }
      return { keep, there, key, runId, accountId };
    }

    /** The given-up run was granted once, and nothing of it is left once the release is answered. */
    async function expectGivenUp(given: Awaited<ReturnType<typeof giveUpDuringAttempt>>) {
      const { keep, there, key, runId, accountId } = given;
      expect(errorOf(await keep.answer(9n, 5_000)).code).toBe(Code.Canceled);
      expect((await keep.answer(10n, 5_000)).result.case).toBe("release");
      const granted = async () =>
        (
          await db.sql`SELECT 1 FROM lease_events WHERE account_id = ${accountId}
            AND session_id = ${key.sessionId} AND type = 'acquired' AND run_id = ${runId}::uuid`
        ).length;
      // The attempt did grant the given-up run (what this case is about) ...
      await waitFor(async () => (await granted()) === 1, { what: "the attempt's grant" });
      // ... and the release, answered after the acquire, left none of it.
      expect((await there.get({ key })).held).toBe(false);
      keep.abort();
    }

    it("a release that gives up an acquire whose wait ran out while its last attempt grants it: the acquire is answered CANCELLED, and the grant ended", async () => {
      await expectGivenUp(await giveUpDuringAttempt("give-up-last", 1_000, []));
    });

    it("a release that gives up an acquire while one of its attempts grants it (a lease on the keeper, which the waiters cannot end by its grant's deadline): the grant ended before the release is answered", async () => {
      // Attempts every 100 ms: one of them is deciding when the release comes.
      const given = await giveUpDuringAttempt("give-up-attempt", 60_000, [
        "--recheck-interval",
        "100ms",
      ]);
      await expectGivenUp(given);
    });

    it("answers by id in any order: an acquire waiting on a held key does not hold up the heartbeat behind it", async () => {
      const accountId = account("order");
      const { keep } = await opened(accountId, 30_000);
      const key = { accountId, sessionId: "busy" };
      const blocker = await client.acquire({ key, ttl: ms(30_000) });
      if (!blocker.lease) throw new Error("blocker not acquired");

      keep.send({ id: 7n, op: { case: "acquire", value: { key, wait: ms(20_000) } } });
      keep.send({ id: 8n, op: { case: "heartbeat", value: {} } });
      const beat = await keep.answer(8n);
      expect(beat.result.case).toBe("keeper");
      // The waiting acquire is still unanswered; the release wakes it.
      expect(keep.reader.pending().some((m) => m.id === 7n)).toBe(false);
      await client.release({ key, runId: blocker.lease.runId });
      const granted = await keep.answer(7n);
      expect(granted.result.case === "acquire" && granted.result.value.acquired).toBe(true);
      keep.abort();
    });

    it("bad input in one request is answered in its error (code, field, ErrorInfo); the keeper goes on", async () => {
      const accountId = account("bad");
      const { keep } = await opened(accountId, 30_000);
      const key = { accountId, sessionId: "k" };

      const withTtl = errorOf(await ask(keep, { case: "acquire", value: { key, ttl: ms(5_000) } }));
      expect(withTtl.code).toBe(Code.InvalidArgument);
      expect(withTtl.message).toContain("acquire.ttl");
      const info = errorInfo(withTtl);
      expect(info.reason).toBe("INVALID_ARGUMENT");
      expect(info.metadata.field).toBe("acquire.ttl");

      const badRun = errorOf(await ask(keep, { case: "release", value: { key, runId: "nope" } }));
      expect(badRun.code).toBe(Code.InvalidArgument);
      expect(errorInfo(badRun).metadata.field).toBe("release.run_id");

      const otherAccount = errorOf(
        await ask(keep, {
          case: "get",
          value: { key: { accountId: "someone-else", sessionId: "k" } },
        }),
      );
      expect(otherAccount.code).toBe(Code.PermissionDenied);

      const reopen = errorOf(
        await ask(keep, { case: "open", value: { accountId, ttl: ms(1_000) } }),
      );
      expect(reopen.code).toBe(Code.InvalidArgument);

      const empty = errorOf(await ask(keep, { case: undefined }));
      expect(empty.code).toBe(Code.InvalidArgument);

      // An id reused while its request is in flight (a waiting acquire).
      const blocker = await client.acquire({ key, ttl: ms(30_000) });
      keep.send({ id: 5n, op: { case: "acquire", value: { key, wait: ms(20_000) } } });
      keep.send({ id: 5n, op: { case: "heartbeat", value: {} } });
      const reused = errorOf(await keep.answer(5n));
      expect(reused.code).toBe(Code.InvalidArgument);
      expect(errorInfo(reused).metadata.field).toBe("id");

      // The keeper went on through all of it.
      const beat = await ask(keep, { case: "heartbeat", value: {} });
      expect(beat.result.case).toBe("keeper");
      await client.release({ key, runId: blocker.lease?.runId ?? "" });
      const granted = await keep.answer(5n);
      expect(granted.result.case === "acquire" && granted.result.value.acquired).toBe(true);
      keep.abort();
    });

    it("a stream whose first request is not an open ends INVALID_ARGUMENT naming open; a refused open ends the stream", async () => {
      const keep = openKeep(client);
      keep.send({ id: 1n, op: { case: "heartbeat", value: {} } });
      await keep.reader.finished;
      expect(keep.reader.error?.code).toBe(Code.InvalidArgument);
      expect(keep.reader.error?.rawMessage).toContain("open");

      const bad = openKeep(client);
      bad.send({ id: 1n, op: { case: "open", value: { accountId: account("x"), ttl: ms(10) } } });
      await bad.reader.finished;
      expect(bad.reader.error?.code).toBe(Code.InvalidArgument);
      expect(bad.reader.error?.rawMessage).toContain("open.ttl");
    });

    /** Acquires `sessions` on the stream's keeper; their leases. */
    async function acquireAll(
      keep: ReturnType<typeof openKeep>,
      accountId: string,
      sessions: string[],
    ) {
      const leases = [];
      for (const sessionId of sessions) {
        const a = await ask(keep, { case: "acquire", value: { key: { accountId, sessionId } } });
        if (a.result.case !== "acquire" || !a.result.value.lease) throw new Error("not acquired");
        leases.push(a.result.value.lease);
      }
      return leases;
    }

    it("a revoke of one lease is pushed as lease_lost and the keeper goes on; a handoff request of a keeper's lease is pushed as handoff_requested", async () => {
      const accountId = account("one");
      const { keep } = await opened(accountId, 30_000);
      const [a, b] = await acquireAll(keep, accountId, ["a", "b"]);
      if (!a || !b) throw new Error("no leases");
      await client.requestHandoff({ key: b.key, requesterHolder: "laptop", reason: "move" });
      const handoff = await keep.reader.take((m) => m.result.case === "handoffRequested");
      expect(handoff.id).toBe(0n);
      if (handoff.result.case !== "handoffRequested") throw new Error("no handoff");
      expect(handoff.result.value.runId).toBe(b.runId);
      expect(handoff.result.value.request?.requesterHolder).toBe("laptop");

      const revoked = await client.revoke({ key: a.key, reason: "stuck" });
      expect(revoked.revoked).toBe(true);
      const lost = await keep.reader.take((m) => m.result.case === "leaseLost");
      expect(lost.id).toBe(0n);
      if (lost.result.case !== "leaseLost") throw new Error("no lease_lost");
      expect(lost.result.value.runId).toBe(a.runId);
      expect(lost.result.value.reason).toBe(LossReason.REVOKED);
      // The keeper and its other lease go on.
      expect((await ask(keep, { case: "heartbeat", value: {} })).result.case).toBe("keeper");
      expect((await client.get({ key: b.key })).lease?.runId).toBe(b.runId);
      keep.abort();
    });

    it("RevokeKeeper: every lease ends REVOKED at once (Watch sees each), the stream is told lost with the reason and ends", async () => {
      const accountId = account("revoke");
      const { keep, keeper } = await opened(accountId, 30_000);
      const sessions = ["a", "b", "c"];
      await acquireAll(keep, accountId, sessions);
      const watch = openWatch(client, { accountId, sessionId: "" });
      const snapshot = await watch.reader.next((m) => m.kind.case === "snapshot");
      expect(
        snapshot.kind.case === "snapshot" && snapshot.kind.value.leases.map((l) => l.keeperId),
      ).toEqual(sessions.map(() => keeper.keeperId));

      const revoked = await client.revokeKeeper({
        accountId,
        keeperId: keeper.keeperId,
        reason: "runaway",
      });
      expect(revoked).toMatchObject({ revoked: true, leasesRevoked: 3 });
      const events = [];
      for (const _ of sessions) {
        const m = await watch.reader.next((e) => e.kind.case === "event");
        if (m.kind.case === "event") events.push(m.kind.value);
      }
      expect(events.map((e) => e.type)).toEqual(sessions.map(() => EventType.REVOKED));
      expect(events.map((e) => e.key?.sessionId).sort()).toEqual(sessions);
      const lost = await keep.reader.take((m) => m.result.case === "lost");
      expect(lost.result.case === "lost" && lost.result.value).toMatchObject({
        reason: LossReason.REVOKED,
        detail: "runaway",
      });
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
      // Again: nothing left to revoke.
      expect(
        await client.revokeKeeper({ accountId, keeperId: keeper.keeperId, reason: "again" }),
      ).toMatchObject({ revoked: false, leasesRevoked: 0 });
      watch.abort();
    });

    it("RevokeKeeper of a keeper with no leases: its stream on this instance is told lost at once", async () => {
      const accountId = account("revoke-empty");
      const { keep, keeper } = await opened(accountId, 60_000);
      await client.revokeKeeper({ accountId, keeperId: keeper.keeperId, reason: "idle" });
      const lost = await keep.reader.take((m) => m.result.case === "lost");
      expect(lost.id).toBe(0n);
      expect(lost.result.case === "lost" && lost.result.value).toMatchObject({
        reason: LossReason.REVOKED,
        detail: "idle",
      });
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
    });

    it("a close is published: Watch sees RELEASED for each lease at once", async () => {
      const accountId = account("close");
      const { keep } = await opened(accountId, 30_000);
      await acquireAll(keep, accountId, ["a", "b"]);
      const watch = openWatch(client, { accountId, sessionId: "" });
      await watch.reader.next((m) => m.kind.case === "snapshot");
      expect((await ask(keep, { case: "close", value: {} })).result.case).toBe("keeper");
      for (const _ of [1, 2]) {
        const m = await watch.reader.next((e) => e.kind.case === "event");
        expect(m.kind.case === "event" && m.kind.value.type).toBe(EventType.RELEASED);
      }
      watch.abort();
    });

    it("K1: a keeper not renewed is found lost at its deadline and the stream told unasked (id 0), then it ends", async () => {
      const accountId = account("deadline");
      const { keep } = await opened(accountId, 1_000);
      await acquireAll(keep, accountId, ["a"]);
      const lost = await keep.reader.take((m) => m.result.case === "lost");
      expect(lost.id).toBe(0n);
      expect(lost.result.case === "lost" && lost.result.value.reason).toBe(LossReason.EXPIRED);
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
      expect((await client.get({ key: { accountId, sessionId: "a" } })).held).toBe(false);
    });

    it("re-attach after a cut stream, on this instance and on another one on the same database: every lease kept and followed", async () => {
      const accountId = account("reattach");
      const keeperId = randomUUID();
      const first = await opened(accountId, 30_000, 0, keeperId);
      const leases = await acquireAll(first.keep, accountId, ["a", "b"]);
      first.keep.abort();
      await first.keep.reader.finished;

      const again = await opened(accountId, 30_000, 0, keeperId);
      expect(again.keeper.keeperId).toBe(keeperId);
      expect(again.keeper.leases).toBe(2);
      again.keep.abort();
      await again.keep.reader.finished;

      const other = await startServer(["--grpc-path", mode], {
        limits: { ...defaultLimits, minTtlMs: 50 },
      });
      expect(other.url).not.toBe(server.url);
      const there = await opened(accountId, 30_000, 0, keeperId, grpcClient(other.url));
      expect(there.keeper.leases).toBe(2);
      expect((await ask(there.keep, { case: "heartbeat", value: {} })).result.case).toBe("keeper");
      for (const lease of leases) {
        expect((await client.get({ key: lease.key })).lease?.runId).toBe(lease.runId);
      }
      // The re-attached stream follows the leases acquired before: a revoke
      // on the first instance reaches it.
      await client.revoke({ key: leases[0]?.key, reason: "one" });
      const lost = await there.keep.reader.take((m) => m.result.case === "leaseLost");
      expect(lost.result.case === "leaseLost" && lost.result.value.runId).toBe(leases[0]?.runId);
      there.keep.abort();
    });

    it("a graceful shutdown ends the Keep stream UNAVAILABLE (its waiting acquire too); the keeper and its leases stay, and the client re-attaches elsewhere", async () => {
      const other = await startServer(["--grpc-path", mode], {
        limits: { ...defaultLimits, minTtlMs: 50 },
      });
      const accountId = account("shutdown");
      const keeperId = randomUUID();
      const { keep } = await opened(accountId, 30_000, 0, keeperId, grpcClient(other.url));
      const [lease] = await acquireAll(keep, accountId, ["a"]);
      const key = { accountId, sessionId: "busy" };
      const blocker = await client.acquire({ key, ttl: ms(30_000) });
      keep.send({ id: 50n, op: { case: "acquire", value: { key, wait: ms(30_000) } } });
      await waitFor(() => other.streaming.waiters.stats.waiting > 0, {
        what: "the stream's acquire to wait on the closing server",
      });
      await other.close();
      await keep.reader.finished;
      expect(keep.reader.error?.code).toBe(Code.Unavailable);
      const there = await opened(accountId, 30_000, 0, keeperId);
      expect(there.keeper.leases).toBe(1);
      expect((await client.get({ key: lease?.key })).lease?.runId).toBe(lease?.runId);
      await client.release({ key, runId: blocker.lease?.runId ?? "" });
      there.keep.abort();
    });

    it("unary Acquire on a keeper (keeper_id), ttl refused with it; K2: a refused Acquire and Get say until when the lock-delay runs", async () => {
      const accountId = account("unary");
      const { keep, keeper } = await opened(accountId, 1_000, 30_000);
      const key = { accountId, sessionId: "u" };
      const withTtl = await client.acquire({ key, keeperId: keeper.keeperId, ttl: ms(5_000) }).then(
        () => undefined,
        (e: unknown) => e as { code: Code; rawMessage: string },
      );
      expect(withTtl?.code).toBe(Code.InvalidArgument);
      expect(withTtl?.rawMessage).toContain("ttl");
      const granted = await client.acquire({ key, keeperId: keeper.keeperId });
      expect(granted.acquired).toBe(true);
      expect(granted.lease?.keeperId).toBe(keeper.keeperId);
      // The keeper expires (no heartbeat): the key is in its lock-delay.
      await keep.reader.take((m) => m.result.case === "lost");
      const refused = await client.acquire({ key, ttl: ms(5_000) });
      expect(refused.acquired).toBe(false);
      expect(refused.current).toBeUndefined();
      expect(refused.lockDelayUntil).toBeDefined();
      const got = await client.get({ key });
      expect(got.held).toBe(false);
      expect(got.lockDelayUntil).toEqual(refused.lockDelayUntil);
    });
  });
}

describe("Keep limits, set by flags", () => {
  const { client } = useTestServer({
    args: [
      "--max-keepers-per-account",
      "1",
      "--max-leases-per-keeper",
      "3",
      "--max-keeper-ops-in-flight",
      "3",
      "--max-lock-delay",
      "5s",
    ],
  });

  const open = (accountId: string, lockDelayMs = 0) => {
    const keep = openKeep(client);
    keep.send({
      id: 1n,
      op: { case: "open", value: { accountId, ttl: ms(30_000), lockDelay: ms(lockDelayMs) } },
    });
    return keep;
  };

  it("--max-lock-delay: a longer lock-delay refuses the open, naming open.lock_delay and the flag", async () => {
    const keep = open(account("delay"), 6_000);
    await keep.reader.finished;
    expect(keep.reader.error?.code).toBe(Code.InvalidArgument);
    expect(keep.reader.error?.rawMessage).toContain("open.lock_delay");
    expect(keep.reader.error?.rawMessage).toContain("--max-lock-delay");
  });

  it("--max-keepers-per-account: a second open keeper of the account refuses the open with RESOURCE_EXHAUSTED naming the limit", async () => {
    const accountId = account("keepers");
    const first = open(accountId);
    expect((await first.answer(1n)).result.case).toBe("keeper");
    const second = open(accountId);
    await second.reader.finished;
    expect(second.reader.error?.code).toBe(Code.ResourceExhausted);
    const info = second.reader.error?.findDetails(ErrorInfoSchema)[0];
    expect(info?.metadata.limit).toBe("max-keepers-per-account");
    first.abort();
  });

  it("--max-leases-per-keeper: the acquire past the bound is answered RESOURCE_EXHAUSTED naming the limit; the keeper goes on", async () => {
    const accountId = account("leases");
    const keep = open(accountId);
    expect((await keep.answer(1n)).result.case).toBe("keeper");
    for (const [i, sessionId] of ["a", "b", "c"].entries()) {
      const id = BigInt(10 + i);
      keep.send({ id, op: { case: "acquire", value: { key: { accountId, sessionId } } } });
      const a = await keep.answer(id);
      expect(a.result.case === "acquire" && a.result.value.acquired).toBe(true);
    }
    keep.send({ id: 13n, op: { case: "acquire", value: { key: { accountId, sessionId: "d" } } } });
    const fourth = errorOf(await keep.answer(13n));
    expect(fourth.code).toBe(Code.ResourceExhausted);
    expect(errorInfo(fourth).metadata.limit).toBe("max-leases-per-keeper");
    keep.send({ id: 14n, op: { case: "heartbeat", value: {} } });
    expect((await keep.answer(14n)).result.case).toBe("keeper");
    keep.abort();
  });

  it("--max-keeper-ops-in-flight: with three acquires waiting, the next request is answered RESOURCE_EXHAUSTED naming the limit; the waiting ones are answered after", async () => {
    const accountId = account("ops");
    const keep = open(accountId);
    expect((await keep.answer(1n)).result.case).toBe("keeper");
    // Three acquires, each waiting on a key held elsewhere, fill the bound.
    const keys = ["x", "y", "z"].map((sessionId) => ({ accountId, sessionId }));
    const blockers = await Promise.all(keys.map((key) => client.acquire({ key, ttl: ms(30_000) })));
    for (const [i, key] of keys.entries()) {
      keep.send({ id: BigInt(20 + i), op: { case: "acquire", value: { key, wait: ms(20_000) } } });
    }
    keep.send({ id: 23n, op: { case: "heartbeat", value: {} } });
    const past = errorOf(await keep.answer(23n));
    expect(past.code).toBe(Code.ResourceExhausted);
    expect(errorInfo(past).metadata.limit).toBe("max-keeper-ops-in-flight");
    for (const [i, key] of keys.entries()) {
      await client.release({ key, runId: blockers[i]?.lease?.runId ?? "" });
    }
    for (const id of [20n, 21n, 22n]) {
      const a = await keep.answer(id);
      expect(a.result.case === "acquire" && a.result.value.acquired).toBe(true);
    }
    keep.abort();
  });
});
