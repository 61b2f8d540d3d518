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
import { type KeepResponse, LossReason } from "../src/gen/leasehold/v1/lease_pb.js";
import { defaultLimits } from "../src/lease/limits.js";
import { useTestServer } from "./support/fixture.js";
import { ms, openKeep } from "./support/streams.js";

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
    const { db, client } = useTestServer({
      args: ["--grpc-path", mode],
      overrides: { limits: { ...defaultLimits, minTtlMs: 50 } },
    });

    /** Opens a keeper on a new stream; its answer is checked. */
    async function opened(accountId: string, ttlMs: number, lockDelayMs = 0) {
      const keep = openKeep(client);
      keep.send({
        id: 1n,
        op: {
          case: "open",
          value: { accountId, holder: "worker", ttl: ms(ttlMs), lockDelay: ms(lockDelayMs) },
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
      // S4: the late heartbeat fails; the stream ends after `lost`.
      const late = await ask(keep, { case: "heartbeat", value: {} });
      expect(late.result.case).toBe("lost");
      expect(late.result.case === "lost" && late.result.value.reason).toBe(LossReason.EXPIRED);
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
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
  });
}
