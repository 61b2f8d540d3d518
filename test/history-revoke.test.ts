// History (the audit trail, newest first, paged) and Revoke (the audited
// admin end of a valid lease) over a real socket.

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { failure, seconds } from "./support/calls.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey, untilExpired } from "./support/leases.js";

const { db, client } = useTestServer();

describe("History", () => {
  it("S6: lists acquired, released, expired and revoked events newest first, with tokens in grant order", async () => {
    const key = freshKey("hist");
    const a = await client.acquire({ key, ttl: seconds(30), holder: "desktop" });
    await client.release({ key, runId: a.lease?.runId ?? "" });
    const b = await client.acquire({
      key,
      ttl: create(DurationSchema, { nanos: 100_000_000 }),
      holder: "browser",
    });
    await untilExpired(db.sql, key);
    const c = await client.acquire({ key, ttl: seconds(30), holder: "cli" });
    await client.revoke({ key, reason: "stuck agent" });

    const { events, nextPageToken } = await client.history({ key });
    expect(nextPageToken).toBe("");
    expect(events.map((e) => EventType[e.type])).toEqual([
      "REVOKED",
      "ACQUIRED",
      "EXPIRED",
      "ACQUIRED",
      "RELEASED",
      "ACQUIRED",
    ]);
    expect(events.map((e) => e.runId)).toEqual([
      c.lease?.runId,
      c.lease?.runId,
      b.lease?.runId,
      b.lease?.runId,
      a.lease?.runId,
      a.lease?.runId,
    ]);
    expect(events[0]?.reason).toBe("stuck agent");
    expect(events[0]?.key).toMatchObject(key);
    const ids = events.map((e) => e.id);
    expect([...ids].sort((x, y) => (x < y ? 1 : -1))).toEqual(ids);
    const grants = events.filter((e) => e.type === EventType.ACQUIRED).map((e) => e.fencingToken);
    expect(grants[0]).toBeGreaterThan(grants[1] ?? 0n);
    expect(grants[1]).toBeGreaterThan(grants[2] ?? 0n);
    expect(events.every((e) => (e.at?.seconds ?? 0n) > 0n)).toBe(true);
  });

  it("pages with opaque tokens, newest first, without gaps or repeats", async () => {
    const key = freshKey("pages");
    for (let i = 0; i < 5; i++) {
      const a = await client.acquire({ key, ttl: seconds(30) });
      await client.release({ key, runId: a.lease?.runId ?? "" });
    }
    const all = (await client.history({ key, pageSize: 100 })).events.map((e) => e.id);
    expect(all).toHaveLength(10);
    const paged: bigint[] = [];
    let pageToken = "";
    do {
      const page = await client.history({ key, pageSize: 3, pageToken });
      expect(page.events.length).toBeLessThanOrEqual(3);
      paged.push(...page.events.map((e) => e.id));
      pageToken = page.nextPageToken;
    } while (pageToken !== "");
    expect(paged).toEqual(all);
  });

  it("a forged page token is INVALID_ARGUMENT naming page_token", async () => {
    const error = await failure(client.history({ key: freshKey(), pageToken: "bm9wZQ" }));
    expect(error.code).toBe(Code.InvalidArgument);
    expect(error.rawMessage).toMatch(/^page_token /);
  });
});

describe("Revoke", () => {
  it("S3: ends the valid lease of any run, audited; the run's renewal then fails with cause revoked", async () => {
    const key = freshKey("rev");
    const a = await client.acquire({ key, ttl: seconds(60), holder: "desktop" });
    const revoked = await client.revoke({ key, reason: "operator: runaway run" });
    expect(revoked.revoked).toBe(true);
    expect(revoked.lease?.runId).toBe(a.lease?.runId);
    expect((await client.get({ key })).held).toBe(false);
    const error = await failure(client.renew({ key, runId: a.lease?.runId ?? "" }));
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(error.findDetails(ErrorInfoSchema)[0]?.metadata.cause).toBe("revoked");
    // S6: the next grant gets a larger token.
    const b = await client.acquire({ key, ttl: seconds(60) });
    expect(b.lease?.fencingToken).toBeGreaterThan(a.lease?.fencingToken ?? 0n);
  });

  it("revoking a session nobody holds answers revoked=false and records nothing", async () => {
    const key = freshKey("free");
    const answer = await client.revoke({ key, reason: "nothing to end" });
    expect(answer.revoked).toBe(false);
    expect((await client.history({ key })).events).toEqual([]);
  });

  it("a revoke needs a reason: it is audited", async () => {
    const key = { accountId: "acct", sessionId: `r-${randomUUID()}` };
    await client.acquire({ key, ttl: seconds(60) });
    const error = await failure(client.revoke({ key, reason: "  " }));
    expect(error.code).toBe(Code.InvalidArgument);
    expect(error.rawMessage).toMatch(/^reason is required/);
    expect((await client.get({ key })).held).toBe(true);
  });
});
