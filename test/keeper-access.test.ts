// Keepers under the one call policy, on a server with keys, on both gRPC
// paths: the Keep stream's open is of the caller's account (else the stream
// ends PERMISSION_DENIED), each acquire, release and get is checked like a
// unary call (a key of another account is refused in that request's error,
// and the keeper goes on), a call without a token is refused before any of
// its body is read; RevokeKeeper needs the admin scope of the keeper's
// account.

import { randomUUID } from "node:crypto";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { describe, expect, it } from "vitest";
import { LeaseService, LossReason } from "../src/gen/leasehold/v1/lease_pb.js";
import { useTestServer } from "./support/fixture.js";
import { grpcClient } from "./support/server.js";
import { ms, openKeep } from "./support/streams.js";
import { adminScope } from "./support/tokens.js";

for (const mode of ["native", "connect"] as const) {
  describe(`keepers and the call policy, --grpc-path ${mode}`, () => {
    const { server, keys } = useTestServer({ keys: true, args: ["--grpc-path", mode] });

    /** A client whose every call carries `account`'s token (with `scope`). */
    async function clientOf(account: string, scope?: string) {
      const authorization = `Bearer ${await keys.token(account, scope ? { scope } : {})}`;
      return createClient(
        LeaseService,
        createGrpcTransport({
          baseUrl: server.url,
          interceptors: [
            (next) => (req) => {
              req.header.set("authorization", authorization);
              return next(req);
            },
          ],
        }),
      );
    }

    it("an open of another account ends the stream PERMISSION_DENIED; a key of another account is refused in its request's error and the keeper goes on", async () => {
      const alice = await clientOf("alice");
      const refused = openKeep(alice);
      refused.send({ id: 1n, op: { case: "open", value: { accountId: "bob", ttl: ms(10_000) } } });
      await refused.reader.finished;
      expect(refused.reader.error?.code).toBe(Code.PermissionDenied);

      const keep = openKeep(alice);
      keep.send({ id: 1n, op: { case: "open", value: { accountId: "alice", ttl: ms(10_000) } } });
      expect((await keep.answer(1n)).result.case).toBe("keeper");
      keep.send({
        id: 2n,
        op: { case: "get", value: { key: { accountId: "bob", sessionId: "s" } } },
      });
      const answer = await keep.answer(2n);
      expect(answer.result.case === "error" && answer.result.value.code).toBe(
        Code.PermissionDenied,
      );
      keep.send({
        id: 3n,
        op: { case: "acquire", value: { key: { accountId: "alice", sessionId: randomUUID() } } },
      });
      const granted = await keep.answer(3n);
      expect(granted.result.case === "acquire" && granted.result.value.acquired).toBe(true);
      keep.send({ id: 4n, op: { case: "close", value: {} } });
      expect((await keep.answer(4n)).result.case).toBe("keeper");
      await keep.reader.finished;
      expect(keep.reader.error).toBeUndefined();
    });

    it("a Keep stream without a token is refused UNAUTHENTICATED", async () => {
      const keep = openKeep(grpcClient(server.url));
      keep.send({ id: 1n, op: { case: "open", value: { accountId: "alice", ttl: ms(10_000) } } });
      await keep.reader.finished;
      expect(keep.reader.error?.code).toBe(Code.Unauthenticated);
    });

    it("RevokeKeeper needs the admin scope, of the keeper's own account", async () => {
      const alice = await clientOf("alice");
      const keep = openKeep(alice);
      keep.send({ id: 1n, op: { case: "open", value: { accountId: "alice", ttl: ms(10_000) } } });
      const opened = await keep.answer(1n);
      if (opened.result.case !== "keeper") throw new Error("not opened");
      const keeperId = opened.result.value.keeperId;
      const request = { accountId: "alice", keeperId, reason: "test" };
      const codeOf = (p: Promise<unknown>) =>
        p.then(
          () => undefined,
          (e: unknown) => ConnectError.from(e).code,
        );
      expect(await codeOf(alice.revokeKeeper(request))).toBe(Code.PermissionDenied);
      const mallory = await clientOf("mallory", adminScope);
      expect(await codeOf(mallory.revokeKeeper(request))).toBe(Code.PermissionDenied);
      const admin = await clientOf("alice", adminScope);
      expect(await admin.revokeKeeper(request)).toMatchObject({ revoked: true });
      // Revoked on this instance: its stream is told at once, unasked.
      const lost = await keep.reader.take((m) => m.result.case === "lost");
      expect(lost.result.case === "lost" && lost.result.value.reason).toBe(LossReason.REVOKED);
      await keep.reader.finished;
    });
  });
}
