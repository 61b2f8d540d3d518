// KeepAlive, Watch, waiting Acquire and RequestHandoff on a server in this
// process (so the tests can read its counters and use its admin store), over
// real sockets with the Connect client's gRPC transport, on each of the two
// paths that serve gRPC; how a stream ends (its client cancels, its hub
// closes it, its client stops reading) also over the Connect protocol and
// gRPC-Web.

import { randomUUID } from "node:crypto";
import { fromBinary } from "@bufbuild/protobuf";
import { anyUnpack } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-node";
import { beforeAll, describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import {
  EventType,
  KeepAliveRequestSchema,
  type KeepAliveResponse,
  LeaseService,
  LossReason,
  WatchRequestSchema,
  type WatchResponse,
  WatchResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { defaultLimits } from "../src/lease/limits.js";
import type { LeaseServer } from "../src/server/server.js";
import { openTransaction } from "./support/db.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey, lockLeaseRow, storedState, untilExpired } from "./support/leases.js";
import { frame, openRawCall } from "./support/raw-grpc.js";
import { grpcClient } from "./support/server.js";
import { answerFor, ms, openKeepAlive, openWatch } from "./support/streams.js";
import { waitFor, within } from "./support/wait.js";

const lossOf = (m: { result: { case?: string; value?: unknown } }) =>
  m.result.case === "lost" ? (m.result.value as { reason: LossReason }).reason : m.result.case;

/** An `undecided` answer's code, ErrorInfo reason and SQLSTATE; undefined for any other answer. */
function undecidedOf(m: KeepAliveResponse) {
  if (m.result.case !== "undecided") return undefined;
  const status = m.result.value;
  const info = status.details.map((d) => anyUnpack(d, ErrorInfoSchema)).find((d) => d);
  return { code: status.code, reason: info?.reason, sqlState: info?.metadata.sql_state };
}

// Every test runs on a server with `--grpc-path native` (gRPC served off
// node:http2, rpc/native-streams.ts) and on one with `--grpc-path connect`
// (connect-node's gRPC, rpc/stream-service.ts): the two drivers of the hubs.
for (const mode of ["native", "connect"] as const) {
  describe(`--grpc-path ${mode}`, () => {
    const { db, server, client, startServer } = useTestServer({
      args: ["--grpc-path", mode],
      overrides: { limits: { ...defaultLimits, minTtlMs: 50, watchBufferLength: 8 } },
    });

    describe("KeepAlive", () => {
      it("S6: one stream renews many leases; each answer carries its lease with the token kept", async () => {
        const stream = openKeepAlive(client);
        const leases = await Promise.all(
          Array.from({ length: 50 }, async (_, i) => {
            const key = freshKey(`many-${i}`);
            const a = await client.acquire({ key, ttl: ms(5_000) });
            return { key, runId: a.lease?.runId ?? "", token: a.lease?.fencingToken };
          }),
        );
        for (const l of leases) stream.send({ key: l.key, runId: l.runId, ttl: ms(30_000) });
        for (const l of leases) {
          const answer = await answerFor(stream, l.runId);
          expect(answer.result.case).toBe("lease");
          expect(answer.result.case === "lease" && answer.result.value.fencingToken).toBe(l.token);
          expect(answer.key).toEqual(expect.objectContaining(l.key));
        }
        stream.abort();
      });

      it("renewals from many streams share batch statements", async () => {
        const before = server.streaming.batcher.stats.statements;
        const streams = Array.from({ length: 10 }, () => openKeepAlive(client));
        const leases = await Promise.all(
          Array.from({ length: 300 }, async (_, i) => {
            const key = freshKey(`batch-${i}`);
            const a = await client.acquire({ key, ttl: ms(30_000) });
            return { key, runId: a.lease?.runId ?? "" };
          }),
        );
        for (const [i, l] of leases.entries()) streams[i % 10]?.send(l);
        for (const [i, l] of leases.entries()) {
          const s = streams[i % 10];
          if (s) expect((await answerFor(s, l.runId)).result.case).toBe("lease");
        }
        const statements = server.streaming.batcher.stats.statements - before;
        expect(statements).toBeGreaterThan(0);
        expect(statements).toBeLessThan(leases.length / 10);
        for (const s of streams) s.abort();
      });

      it("S4: after lost the stream never renews that run again, and the run cannot acquire anew", async () => {
        const key = freshKey("lost-forever");
        const runId = randomUUID();
        await client.acquire({ key, runId, ttl: ms(100) });
        await untilExpired(db.sql, key);
        const stream = openKeepAlive(client);
        stream.send({ key, runId });
        expect(lossOf(await answerFor(stream, runId))).toBe(LossReason.EXPIRED);
        // The same run id is refused the session: its lease ended.
        const again = await client.acquire({ key, runId, ttl: ms(60_000) }).catch((e) => e);
        expect(again).toBeInstanceOf(ConnectError);
        expect((again as ConnectError).code).toBe(Code.FailedPrecondition);
        expect((again as ConnectError).message).toContain("let its lease expire");
        // This stream answers lost again and nothing is held.
        stream.send({ key, runId, ttl: ms(120_000) });
        expect(lossOf(await answerFor(stream, runId))).toBe(LossReason.EXPIRED);
        expect((await client.get({ key })).held).toBe(false);
        stream.abort();
      });

      it("S5: a revoke reaches the holder's stream as lost(revoked) at once, and later renewals too", async () => {
        const key = freshKey("revoked");
        const a = await client.acquire({ key, ttl: ms(60_000) });
        const runId = a.lease?.runId ?? "";
        const stream = openKeepAlive(client);
        stream.send({ key, runId });
        expect((await answerFor(stream, runId)).result.case).toBe("lease");
        await server.streaming.store.revoke(key, "maintenance");
        expect(lossOf(await answerFor(stream, runId))).toBe(LossReason.REVOKED);
        stream.send({ key, runId });
        expect(lossOf(await answerFor(stream, runId))).toBe(LossReason.REVOKED);
        stream.abort();
      });

      it("S4: a renewal for a revoked run on a fresh stream is answered lost(revoked)", async () => {
        const key = freshKey("revoked-late");
        const a = await client.acquire({ key, ttl: ms(60_000) });
        await server.streaming.store.revoke(key, "maintenance");
        const stream = openKeepAlive(client);
        stream.send({ key, runId: a.lease?.runId ?? "" });
        expect(lossOf(await answerFor(stream, a.lease?.runId ?? ""))).toBe(LossReason.REVOKED);
        stream.abort();
      });

      it("L2: a run whose lease expired and was taken over learns it on its stream without asking", async () => {
        const key = freshKey("taken-live");
        const a = await client.acquire({ key, ttl: ms(150) });
        const runId = a.lease?.runId ?? "";
        const stream = openKeepAlive(client);
        stream.send({ key, runId, ttl: ms(150) });
        expect((await answerFor(stream, runId)).result.case).toBe("lease");
        await untilExpired(db.sql, key);
        expect((await client.acquire({ key, ttl: ms(60_000) })).acquired).toBe(true);
        // The takeover reports the old grant's expiry first; that is the cause.
        expect(lossOf(await answerFor(stream, runId))).toBe(LossReason.EXPIRED);
        // And the stream keeps saying so.
        stream.send({ key, runId });
        expect(lossOf(await answerFor(stream, runId))).toBe(LossReason.EXPIRED);
        stream.abort();
      });

      it("S8: a renewal stuck behind another transaction's row lock is answered undecided; the stream and its other leases go on", async () => {
        const stuckKey = freshKey("stuck");
        const freeKey = freshKey("free");
        const a = await client.acquire({ key: stuckKey, ttl: ms(60_000) });
        const b = await client.acquire({ key: freeKey, ttl: ms(60_000) });
        const stuckRun = a.lease?.runId ?? "";
        const freeRun = b.lease?.runId ?? "";
        const lock = await lockLeaseRow(db, stuckKey);
        const lockWaits = async () =>
          (
            await db.sql`SELECT 1 FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'`
          ).length;
        try {
          const stream = openKeepAlive(client);
          stream.send({ key: stuckKey, runId: stuckRun });
          stream.send({ key: freeKey, runId: freeRun });
          expect((await answerFor(stream, freeRun)).result.case).toBe("lease");
          // The stuck renewal is retried alone, waiting on the lock, until
          // lock_timeout (1 s) gives up on it: that renewal is not decided,
          // and answered so.
          await waitFor(async () => (await lockWaits()) > 0, {
            what: "the stuck renewal's retry to wait on the row lock",
          });
          const undecided = await answerFor(stream, stuckRun);
          expect(undecidedOf(undecided)).toEqual({
            code: Code.Unavailable,
            reason: "DATABASE_UNAVAILABLE",
            sqlState: "55P03",
          });
          expect(undecided.key).toEqual(expect.objectContaining(stuckKey));
          // The stream is open, and its other lease is renewed as usual.
          stream.send({ key: freeKey, runId: freeRun, ttl: ms(90_000) });
          const again = await answerFor(stream, freeRun);
          expect(again.result.case).toBe("lease");
          expect(stream.reader.done).toBe(false);
          // The stuck key was not renewed, and its lease is still there.
          expect((await client.get({ key: stuckKey })).lease?.expiresAt).toEqual(
            a.lease?.expiresAt,
          );
          // Once the lock is gone, the client's next renewal of it succeeds.
          await lock.end();
          stream.send({ key: stuckKey, runId: stuckRun });
          const renewed = await answerFor(stream, stuckRun);
          expect(renewed.result.case).toBe("lease");
          expect(stream.reader.done).toBe(false);
          stream.abort();
        } finally {
          await lock.end();
        }
      });

      it("L2: a renewal statement that times out ends no stream: its renewals are answered undecided, their leases unchanged, and the next ones are renewed", async () => {
        // A server of its own whose statements time out long before their
        // lock waits do: a batch stuck behind a table lock ends at
        // statement_timeout (57014), which once ended the stream, and every
        // lease on it, with DEADLINE_EXCEEDED, and then left the renewals
        // unanswered (which clients took for a stalled connection).
        const slow = await startServer([
          "--grpc-path",
          mode,
          "--statement-timeout",
          "300ms",
          "--lock-timeout",
          "30s",
        ]);
        const slowClient = grpcClient(slow.url);
        const keys = [freshKey("timeout-a"), freshKey("timeout-b")];
        const runs: string[] = [];
        const expiries: unknown[] = [];
        for (const key of keys) {
          const a = await slowClient.acquire({ key, ttl: ms(60_000) });
          runs.push(a.lease?.runId ?? "");
          expiries.push(a.lease?.expiresAt);
        }
        const stream = openKeepAlive(slowClient);
        // Writes to leases wait for this transaction; reads do not.
        const lock = await openTransaction(db, (tx) => tx`LOCK TABLE leases IN SHARE MODE`);
        const renewalsWaiting = async () =>
          (
            await db.sql`SELECT 1 FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'
                AND query LIKE '%lookup_handoff%'`
          ).length;
        try {
          for (const [i, key] of keys.entries()) stream.send({ key, runId: runs[i] });
          await waitFor(async () => (await renewalsWaiting()) > 0, {
            what: "the renewal statement to wait on the table lock",
          });
          // The statement ends at statement_timeout: each of its renewals
          // is answered undecided, and nothing else.
          for (const runId of runs) {
            expect(undecidedOf(await answerFor(stream, runId))).toEqual({
              code: Code.Unavailable,
              reason: "DATABASE_UNAVAILABLE",
              sqlState: "57014",
            });
          }
          expect(stream.reader.done).toBe(false);
        } finally {
          await lock.end();
        }
        // Their leases are as they were: neither renewed nor lost.
        for (const [i, key] of keys.entries()) {
          const got = await slowClient.get({ key });
          expect(got.lease?.runId).toBe(runs[i]);
          expect(got.lease?.expiresAt).toEqual(expiries[i]);
        }
        // The client's next renewals, on the same stream, are decided.
        for (const [i, key] of keys.entries())
          stream.send({ key, runId: runs[i], ttl: ms(90_000) });
        for (const runId of runs) {
          const answer = await answerFor(stream, runId);
          expect(answer.result.case).toBe("lease");
          expect(answer.result.case === "lease" && answer.result.value.ttl?.seconds).toBe(90n);
        }
        expect(stream.reader.done).toBe(false);
        stream.abort();
      });

      it("closing a stream releases nothing", async () => {
        const key = freshKey("close");
        const a = await client.acquire({ key, ttl: ms(60_000) });
        const runId = a.lease?.runId ?? "";
        const stream = openKeepAlive(client);
        stream.send({ key, runId });
        await answerFor(stream, runId);
        stream.end();
        await stream.reader.finished;
        expect(stream.reader.error).toBeUndefined();
        const got = await client.get({ key });
        expect(got.lease?.runId).toBe(runId);
      });

      it("a stream whose client half-closes without a renewal ends OK, over gRPC and the Connect protocol", async () => {
        const raw = openRawCall(server.url, "/leasehold.v1.LeaseService/KeepAlive");
        raw.read();
        raw.end();
        expect(await raw.ended).toEqual({ status: 0, message: "" });
        raw.close();
        const overConnect = createClient(
          LeaseService,
          createConnectTransport({ baseUrl: server.url, httpVersion: "2" }),
        );
        for (const c of [client, overConnect]) {
          const answers: unknown[] = [];
          for await (const answer of c.keepAlive((async function* () {})())) answers.push(answer);
          expect(answers).toEqual([]);
        }
      });

      it("bad input ends the stream with INVALID_ARGUMENT naming the field, and changes nothing", async () => {
        const key = freshKey("bad");
        const a = await client.acquire({ key, ttl: ms(60_000) });
        const before = await storedState(db.sql);
        for (const [request, field] of [
          [{ key, runId: "not-a-uuid" }, "run_id"],
          [
            { key: { accountId: "", sessionId: "x" }, runId: a.lease?.runId ?? "" },
            "key.account_id",
          ],
          [{ key, runId: a.lease?.runId ?? "", ttl: ms(0) }, "ttl"],
          [{ runId: a.lease?.runId ?? "" }, "key"],
        ] as const) {
          const stream = openKeepAlive(client);
          stream.send(request);
          await stream.reader.finished;
          expect(stream.reader.error?.code).toBe(Code.InvalidArgument);
          expect(stream.reader.error?.rawMessage).toContain(field);
        }
        expect(await storedState(db.sql)).toEqual(before);
      });

      it("bad input after the first answer ends the stream with INVALID_ARGUMENT, though its client is still sending", async () => {
        // The status goes out in trailers while more of the client's renewals
        // wait unread at the server: the stream is reset after the status,
        // never in its place (the native path's reset, submitted while the
        // trailers were still queued, made nghttp2 drop them).
        const key = freshKey("bad-mid");
        const a = await client.acquire({ key, ttl: ms(60_000) });
        const runId = a.lease?.runId ?? "";
        const good = frame(KeepAliveRequestSchema, { key, runId });
        const bad = frame(KeepAliveRequestSchema, { key, runId: "not-a-uuid" });
        for (const first of [good, undefined]) {
          const raw = openRawCall(server.url, "/leasehold.v1.LeaseService/KeepAlive");
          raw.read();
          if (first) {
            raw.send(first);
            await raw.until((frames) => frames.length >= 1);
          }
          raw.send(Buffer.concat([bad, ...Array.from({ length: 500 }, () => good)]));
          raw.send(Buffer.concat(Array.from({ length: 500 }, () => good)));
          const ended = await raw.ended;
          raw.close();
          expect(ended.status).toBe(Code.InvalidArgument);
          expect(ended.message).toContain("run_id");
        }
        expect((await client.get({ key })).lease?.runId).toBe(runId);
      });

      it("a client that stops reading does not stall other streams; its own stream ends with RESOURCE_EXHAUSTED rather than grow; its lease stays", async () => {
        const stalledKey = freshKey("stall");
        const a = await client.acquire({ key: stalledKey, ttl: ms(60_000), holder: "stalled" });
        const stalledRun = a.lease?.runId ?? "";
        const before = server.streaming.keepAlive.stats.overflows;
        // Its own connection; it sends renewals and reads nothing, so HTTP/2
        // flow control stops the server's writes to it.
        const stalled = openRawCall(server.url, "/leasehold.v1.LeaseService/KeepAlive");
        const request = frame(KeepAliveRequestSchema, { key: stalledKey, runId: stalledRun });
        const sent = 20_000;
        for (let i = 0; i < sent; i++) stalled.send(request);
        // Meanwhile another client keeps renewing through the same server.
        const key = freshKey("unstalled");
        const b = await client.acquire({ key, ttl: ms(60_000), holder: "reader" });
        const runId = b.lease?.runId ?? "";
        const healthy = openKeepAlive(client);
        for (let i = 0; i < 20; i++) {
          healthy.send({ key, runId });
          expect((await answerFor(healthy, runId, 5_000)).result.case).toBe("lease");
        }
        healthy.abort();
        await waitFor(() => server.streaming.keepAlive.stats.overflows > before, {
          what: "the stalled stream's backlog to reach its bound",
        });
        // Now read the stalled stream: it was ended rather than left to grow.
        stalled.read();
        const ended = await stalled.ended;
        expect(ended.status).toBe(Code.ResourceExhausted);
        expect(stalled.frames.length).toBeLessThan(sent);
        stalled.close();
        expect((await client.get({ key: stalledKey })).lease?.runId).toBe(stalledRun);
      });

      it("S3: a handoff requested before the holder's stream opened is delivered with its first renewal", async () => {
        const key = freshKey("handoff-early");
        const a = await client.acquire({ key, ttl: ms(60_000), holder: "desktop" });
        const runId = a.lease?.runId ?? "";
        const asked = await client.requestHandoff({
          key,
          requesterHolder: "phone",
          reason: "here",
        });
        expect(asked.delivered).toBe(true);
        const stream = openKeepAlive(client);
        stream.send({ key, runId });
        expect((await answerFor(stream, runId)).result.case).toBe("lease");
        const handoff = await answerFor(stream, runId);
        expect(handoff.result.case === "handoffRequested" && handoff.result.value).toMatchObject({
          requesterHolder: "phone",
          reason: "here",
        });
        expect((await client.get({ key })).lease?.runId).toBe(runId);
        stream.abort();
      });

      it("RequestHandoff on a free session delivers nothing and records nothing", async () => {
        const key = freshKey("handoff-free");
        const before = await storedState(db.sql);
        const asked = await client.requestHandoff({ key, requesterHolder: "phone" });
        expect(asked.delivered).toBe(false);
        expect(asked.current).toBeUndefined();
        expect(await storedState(db.sql)).toEqual(before);
      });
    });

    describe("Watch", () => {
      it("an account watch gets a snapshot of that account's valid leases, then changes of all its sessions", async () => {
        const accountId = `acct-watch-${randomUUID().slice(0, 8)}`;
        const held = await client.acquire({ key: { accountId, sessionId: "a" }, ttl: ms(60_000) });
        const gone = await client.acquire({ key: { accountId, sessionId: "b" }, ttl: ms(60_000) });
        await client.release({
          key: { accountId, sessionId: "b" },
          runId: gone.lease?.runId ?? "",
        });
        await client.acquire({ key: freshKey("other-account"), ttl: ms(60_000) });
        const watch = openWatch(client, { accountId, sessionId: "" });
        const first = await watch.reader.next();
        expect(
          first.kind.case === "snapshot" && first.kind.value.leases.map((l) => l.runId),
        ).toEqual([held.lease?.runId]);
        const c = await client.acquire({ key: { accountId, sessionId: "c" }, ttl: ms(60_000) });
        await client.release({
          key: { accountId, sessionId: "a" },
          runId: held.lease?.runId ?? "",
        });
        const e1 = await watch.reader.next();
        const e2 = await watch.reader.next();
        expect(
          [e1, e2].map(
            (m) => m.kind.case === "event" && [m.kind.value.type, m.kind.value.key?.sessionId],
          ),
        ).toEqual([
          [EventType.ACQUIRED, "c"],
          [EventType.RELEASED, "a"],
        ]);
        expect(e1.kind.case === "event" && e1.kind.value.fencingToken).toBe(c.lease?.fencingToken);
        watch.abort();
      });

      it("S6: a takeover after expiry shows EXPIRED of the old grant before ACQUIRED of the new, and nothing of the old grant once the new one was shown", async () => {
        const key = freshKey("takeover");
        const watch = openWatch(client, key);
        await watch.reader.next((m) => m.kind.case === "snapshot");
        const a = await client.acquire({ key, ttl: ms(100) });
        await watch.reader.next((m) => m.kind.case === "event");
        await untilExpired(db.sql, key);
        const b = await client.acquire({ key, ttl: ms(60_000) });
        const oldToken = a.lease?.fencingToken ?? 0n;
        const newToken = b.lease?.fencingToken ?? 0n;
        expect(newToken).toBeGreaterThan(oldToken);
        // What the watcher is shown: an event as [type, token], a snapshot as
        // ["snapshot", ...the tokens of the leases it shows].
        type Shown = (EventType | "snapshot" | bigint)[];
        const shown = (m: WatchResponse): Shown | undefined =>
          m.kind.case === "event"
            ? [m.kind.value.type, m.kind.value.fencingToken]
            : m.kind.case === "snapshot"
              ? ["snapshot", ...m.kind.value.leases.map((l) => l.fencingToken)]
              : undefined;
        const next = async () => {
          for (;;) {
            const m = shown(await watch.reader.next());
            if (m) return m;
          }
        };
        // Until the watcher learns of the new grant: its ACQUIRED, or a fresh
        // snapshot instead (the hub re-snapshots a watcher when its expiry
        // timer or periodic re-check reads a grant before its notification
        // arrived). Either way, what came before it is in order.
        const before: Shown[] = [];
        for (;;) {
          const m = await next();
          before.push(m);
          if (m[0] === "snapshot" || m[0] === EventType.ACQUIRED) break;
        }
        const learned = before.at(-1);
        if (learned?.[0] === "snapshot") {
          // The snapshot shows the new grant alone, after at most the old grant's EXPIRED.
          expect(learned).toEqual(["snapshot", newToken]);
          expect(before.slice(0, -1)).toEqual(
            [[EventType.EXPIRED, oldToken]].slice(0, before.length - 1),
          );
        } else {
          expect(before).toEqual([
            [EventType.EXPIRED, oldToken],
            [EventType.ACQUIRED, newToken],
          ]);
        }
        // Once the new grant was shown, nothing about the old one may follow
        // (the order guard drops the takeover's EXPIRED of it, or the timer's,
        // when it comes late). The new grant's release is the barrier: what
        // was published before it has reached the watcher by its RELEASED (or
        // by a fresh snapshot showing the session free).
        await client.release({ key, runId: b.lease?.runId ?? "" });
        const after: Shown[] = [];
        for (;;) {
          const m = await next();
          after.push(m);
          if (m[0] === EventType.RELEASED || (m[0] === "snapshot" && m.length === 1)) break;
        }
        expect(
          after.filter((m) => m.slice(1).some((token) => token !== newToken)),
          "messages about another grant than the new one, after it was shown",
        ).toEqual([]);
        watch.abort();
      });

      it("a consumer that falls behind gets a fresh snapshot instead of unbounded buffering", async () => {
        const accountId = `acct-slow-${randomUUID().slice(0, 8)}`;
        const before = server.streaming.watch.stats.overflows;
        // A client that reads nothing: HTTP/2 flow control stops the server's
        // writes, the watcher's buffer (8 here) overflows, and what the client
        // reads next, once it reads again, is a fresh snapshot.
        const call = openRawCall(server.url, "/leasehold.v1.LeaseService/Watch");
        call.send(frame(WatchRequestSchema, { key: { accountId, sessionId: "" } }));
        call.end();
        let last: { key: { accountId: string; sessionId: string }; runId: string } | undefined;
        for (let i = 0; server.streaming.watch.stats.overflows === before; i++) {
          expect(i).toBeLessThan(20_000);
          const key = { accountId, sessionId: `s${i % 50}` };
          if (last) await client.release({ key: last.key, runId: last.runId });
          const a = await client.acquire({ key, ttl: ms(60_000) });
          last = { key, runId: a.lease?.runId ?? "" };
        }
        const finalRun = last?.runId;
        call.read();
        const snapshots = (frames: Uint8Array[]) =>
          frames
            .map((f) => fromBinary(WatchResponseSchema, f))
            .filter((m) => m.kind.case === "snapshot");
        await call.until((frames) => snapshots(frames).length >= 2);
        call.close();
        const second = snapshots(call.frames)[1];
        expect(
          second?.kind.case === "snapshot" && second.kind.value.leases.map((l) => l.runId),
        ).toContain(finalRun);
        // Far fewer messages than changes made: the backlog was dropped, not kept.
        expect(call.frames.length).toBeLessThan(2 * 50 + 1000);
      });

      it("bad input gets INVALID_ARGUMENT naming the field", async () => {
        const watch = openWatch(client, { accountId: "bad account", sessionId: "" });
        await watch.reader.finished;
        expect(watch.reader.error?.code).toBe(Code.InvalidArgument);
        expect(watch.reader.error?.rawMessage).toContain("key.account_id");
      });
    });

    describe("Acquire with wait", () => {
      it("answers acquired=false with the holder when the wait runs out", async () => {
        const key = freshKey("wait-out");
        const a = await client.acquire({ key, ttl: ms(60_000), holder: "desktop" });
        const b = await client.acquire({ key, ttl: ms(60_000), wait: ms(300), holder: "browser" });
        expect(b.acquired).toBe(false);
        expect(b.current?.runId).toBe(a.lease?.runId);
        expect(b.current?.holder).toBe("desktop");
        expect(server.streaming.waiters.stats.waiting).toBe(0);
      });

      it("gets the session when the holder's lease expires (a confirmed deadline, no release)", async () => {
        const key = freshKey("wait-expiry");
        const a = await client.acquire({ key, ttl: ms(300) });
        const b = await client.acquire({ key, ttl: ms(60_000), wait: ms(30_000) });
        expect(b.acquired).toBe(true);
        expect(b.lease?.fencingToken).toBeGreaterThan(a.lease?.fencingToken ?? 0n);
      });

      it("honours the call deadline: answers before it instead of failing", async () => {
        const key = freshKey("wait-deadline");
        await client.acquire({ key, ttl: ms(60_000) });
        // The deadline goes to the server as the grpc-timeout header only: the
        // client does not enforce it, so what is checked is the server's answer,
        // not whether it also crossed a busy machine within the server's margin.
        // A server that ignored the deadline would wait the full five minutes.
        const b = await client.acquire(
          { key, ttl: ms(60_000), wait: ms(300_000) },
          { headers: { "grpc-timeout": "1000m" } },
        );
        expect(b.acquired).toBe(false);
        expect(server.streaming.waiters.stats.waiting).toBe(0);
      });

      it("a cancelled waiter stops waiting and is not granted the session later", async () => {
        const key = freshKey("wait-cancel");
        const a = await client.acquire({ key, ttl: ms(60_000) });
        const controller = new AbortController();
        const waiting = client.acquire(
          { key, ttl: ms(60_000), wait: ms(60_000) },
          { signal: controller.signal },
        );
        await waitFor(() => server.streaming.waiters.stats.waiting > 0, {
          what: "the acquire to wait on the server",
        });
        controller.abort();
        await expect(waiting).rejects.toBeInstanceOf(ConnectError);
        await waitFor(() => server.streaming.waiters.stats.waiting === 0, {
          what: "the server to drop the cancelled waiter",
        });
        await client.release({ key, runId: a.lease?.runId ?? "" });
        const got = await client.get({ key });
        expect(got.held).toBe(false);
      });

      it("bad wait gets INVALID_ARGUMENT naming the field", async () => {
        const error = await client
          .acquire({ key: freshKey("wait-bad"), ttl: ms(1_000), wait: ms(3_600_000) })
          .catch((e: unknown) => ConnectError.from(e));
        expect(error).toBeInstanceOf(ConnectError);
        expect((error as ConnectError).code).toBe(Code.InvalidArgument);
        expect((error as ConnectError).rawMessage).toContain("wait");
      });
    });

    describe("graceful shutdown", () => {
      it("ends KeepAlive and Watch streams with UNAVAILABLE; leases stay", async () => {
        const other = await startServer(["--grpc-path", mode]);
        const c = grpcClient(other.url);
        const key = freshKey("shutdown");
        const a = await c.acquire({ key, ttl: ms(60_000) });
        const runId = a.lease?.runId ?? "";
        const stream = openKeepAlive(c);
        stream.send({ key, runId });
        await answerFor(stream, runId);
        const watch = openWatch(c, key);
        await watch.reader.next();
        const waiting = c
          .acquire({ key, ttl: ms(60_000), wait: ms(60_000) })
          .catch((e: unknown) => ConnectError.from(e));
        await waitFor(() => other.streaming.waiters.stats.waiting > 0, {
          what: "the acquire to wait on the closing server",
        });
        await other.close();
        await stream.reader.finished;
        await watch.reader.finished;
        expect(stream.reader.error?.code).toBe(Code.Unavailable);
        expect(watch.reader.error?.code).toBe(Code.Unavailable);
        const ended = await waiting;
        expect(ended instanceof ConnectError && ended.code).toBe(Code.Unavailable);
        expect((await client.get({ key })).lease?.runId).toBe(runId);
      });
    });

    describe("how a stream ends, over gRPC, the Connect protocol and gRPC-Web", () => {
      // A server of its own: its hubs' counters and its hubs' close are this
      // describe's.
      let own: LeaseServer;
      const clients = () =>
        ({
          grpc: grpcClient(own.url),
          connect: createClient(
            LeaseService,
            createConnectTransport({ baseUrl: own.url, httpVersion: "2" }),
          ),
          "grpc-web": createClient(
            LeaseService,
            createGrpcWebTransport({ baseUrl: own.url, httpVersion: "1.1" }),
          ),
        }) as const;
      beforeAll(async () => {
        own = await startServer(["--grpc-path", mode]);
      });

      /** A KeepAlive stream (gRPC, Connect) renewing a fresh lease, and Watch streams of its key. */
      async function openStreams(label: string) {
        const c = clients();
        const opened = [];
        for (const protocol of ["grpc", "connect"] as const) {
          const key = freshKey(`${label}-${protocol}`);
          const a = await c[protocol].acquire({ key, ttl: ms(60_000) });
          const runId = a.lease?.runId ?? "";
          const keepAlive = openKeepAlive(c[protocol]);
          keepAlive.send({ key, runId });
          expect((await answerFor(keepAlive, runId)).result.case).toBe("lease");
          opened.push({ protocol, key, runId, stream: keepAlive });
        }
        const watches = [];
        for (const protocol of ["grpc", "connect", "grpc-web"] as const) {
          const watch = openWatch(c[protocol], freshKey(`${label}-watch-${protocol}`));
          expect((await watch.reader.next()).kind.case).toBe("snapshot");
          watches.push({ protocol, watch });
        }
        return { keepAlives: opened, watches };
      }

      it("a cancelled KeepAlive or Watch stream gives back its session and its watcher; its lease stays", async () => {
        const { keepAlives, watches } = await openStreams("cancel");
        expect(own.streaming.keepAlive.stats.streams).toBe(2);
        expect(own.streaming.watch.stats.watchers).toBe(3);
        for (const k of keepAlives) k.stream.abort();
        for (const w of watches) w.watch.abort();
        await waitFor(
          () =>
            own.streaming.keepAlive.stats.streams === 0 && own.streaming.watch.stats.watchers === 0,
          { what: "the cancelled streams' sessions and watchers to be given back" },
        );
        for (const k of keepAlives) {
          expect((await grpcClient(own.url).get({ key: k.key })).lease?.runId).toBe(k.runId);
        }
      });

      it("streams its hubs close end with the hubs' reason (UNAVAILABLE at shutdown); their leases stay", async () => {
        const { keepAlives, watches } = await openStreams("hub-close");
        const reason = new ConnectError(
          "the server is shutting down: reconnect to another instance",
          Code.Unavailable,
        );
        own.streaming.keepAlive.close(reason);
        own.streaming.watch.close(reason);
        for (const { protocol, stream } of keepAlives) {
          await within(stream.reader.finished, { what: `the ${protocol} KeepAlive stream to end` });
          expect(stream.reader.error?.code, `${protocol} KeepAlive`).toBe(Code.Unavailable);
          expect(stream.reader.error?.rawMessage).toBe(reason.rawMessage);
        }
        for (const { protocol, watch } of watches) {
          await within(watch.reader.finished, { what: `the ${protocol} Watch stream to end` });
          expect(watch.reader.error?.code, `${protocol} Watch`).toBe(Code.Unavailable);
        }
        for (const k of keepAlives) {
          expect((await grpcClient(own.url).get({ key: k.key })).lease?.runId).toBe(k.runId);
        }
      });
    });
  });
}
