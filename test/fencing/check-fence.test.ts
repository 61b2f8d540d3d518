// CheckFence on LeaseService: what a live-mode resource asks the lease
// server, over a real socket with both gRPC (h2c) and Connect (HTTP/1.1).

import { Code, ConnectError } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import type { SessionKey } from "../../src/lease/types.js";
import { durationFromMillis } from "../../src/server/rpc/convert.js";
import { useTestServer } from "../support/fixture.js";
import { freshKey, untilExpired } from "../support/leases.js";
import type { LeaseClient } from "../support/server.js";

const { db, client: grpc, connect } = useTestServer();

async function acquire(client: LeaseClient, key: SessionKey) {
  const res = await client.acquire({ key, ttl: durationFromMillis(30_000), holder: "test" });
  if (!res.lease) throw new Error("expected the lease to be granted");
  return res.lease;
}

/** The holder's last renewal asks for 100 ms; then the database clock passes it. */
async function expire(key: SessionKey, runId: string) {
  await grpc.renew({ key, runId, ttl: durationFromMillis(100) });
  await untilExpired(db.sql, key);
}

describe("CheckFence", () => {
  it("S7 live: the valid lease's token is current, and it is the highest granted", async () => {
    for (const client of [grpc, connect]) {
      const key = freshKey("fence");
      const lease = await acquire(client, key);
      const res = await client.checkFence({ key, fencingToken: lease.fencingToken });
      expect(res).toMatchObject({ current: true, highestToken: lease.fencingToken });
    }
  });

  it("S4, S7 live: an expired lease's token is no longer current, even with nobody replacing it", async () => {
    const key = freshKey("fence");
    const lease = await acquire(grpc, key);
    await expire(key, lease.runId);
    const res = await grpc.checkFence({ key, fencingToken: lease.fencingToken });
    expect(res).toMatchObject({ current: false, highestToken: lease.fencingToken });
  });

  it("S6, S7 live: after a takeover the old token is not current and the highest is the new one", async () => {
    const key = freshKey("fence");
    const first = await acquire(grpc, key);
    await expire(key, first.runId);
    const second = await acquire(grpc, key);
    expect(second.fencingToken).toBeGreaterThan(first.fencingToken);
    expect(await grpc.checkFence({ key, fencingToken: first.fencingToken })).toMatchObject({
      current: false,
      highestToken: second.fencingToken,
    });
    expect(await grpc.checkFence({ key, fencingToken: second.fencingToken })).toMatchObject({
      current: true,
      highestToken: second.fencingToken,
    });
  });

  it("S5, S7 live: a released lease's token is not current; the tombstone keeps the highest", async () => {
    const key = freshKey("fence");
    const lease = await acquire(grpc, key);
    expect((await grpc.release({ key, runId: lease.runId })).released).toBe(true);
    expect(await grpc.checkFence({ key, fencingToken: lease.fencingToken })).toMatchObject({
      current: false,
      highestToken: lease.fencingToken,
    });
  });

  it("a session never granted has highest token 0 and no current token", async () => {
    const res = await grpc.checkFence({ key: freshKey("fence"), fencingToken: 1n });
    expect(res).toMatchObject({ current: false, highestToken: 0n });
  });

  it("bad input: a token ≤ 0 or a bad key is INVALID_ARGUMENT naming the field", async () => {
    const cases: [Parameters<LeaseClient["checkFence"]>[0], string][] = [
      [{ key: freshKey("fence"), fencingToken: 0n }, "fencing_token"],
      [{ key: freshKey("fence"), fencingToken: -4n }, "fencing_token"],
      [{ fencingToken: 1n }, "key"],
      [{ key: { accountId: "", sessionId: "s" }, fencingToken: 1n }, "key.account_id"],
      [{ key: { accountId: "a", sessionId: "has space" }, fencingToken: 1n }, "key.session_id"],
    ];
    for (const [request, field] of cases) {
      const error = await connect.checkFence(request).then(
        () => expect.fail(`expected ${field} to be refused`),
        (e: unknown) => ConnectError.from(e),
      );
      expect(error.code).toBe(Code.InvalidArgument);
      expect(error.rawMessage.startsWith(`${field} `)).toBe(true);
    }
  });
});
