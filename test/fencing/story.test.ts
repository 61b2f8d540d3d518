// The story fencing exists for, end to end: the lease server and guarded
// stores run as separate OS processes (`leasehold serve`, `leasehold guarded
// serve`) and are reached over real sockets. Run A pauses past its TTL, run
// B takes the session over, and A's late write must not land (S6, S7).

import { Code, ConnectError } from "@connectrpc/connect";
import { beforeAll, describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../../src/gen/google/rpc/error_details_pb.js";
import type { SessionKey } from "../../src/lease/types.js";
import { durationFromMillis } from "../../src/server/rpc/convert.js";
import { useTestDatabase } from "../support/fixture.js";
import { freshKey, untilExpired } from "../support/leases.js";
import {
  type GuardedClient,
  grpcClient,
  guardedConnectClient,
  guardedGrpcClient,
  type LeaseClient,
} from "../support/server.js";

// The lease server and the live store share one database; the two monotonic
// stores each have their own, as independent resources would.
const { db: leaseDb, anotherDatabase, spawnServer, spawnGuardedServer } = useTestDatabase();
let leases: LeaseClient;
let store: GuardedClient;
let liveStore: GuardedClient;
let otherStore: GuardedClient;

beforeAll(async () => {
  const [storeDb, otherStoreDb] = await Promise.all([anotherDatabase(), anotherDatabase()]);
  const leaseServer = await spawnServer();
  // Every store asks the lease server before a write raises its fence.
  const lease = { LEASEHOLD_LEASE_URL: leaseServer.url };
  const [monotonic, live, other] = await Promise.all([
    spawnGuardedServer([], { ...lease, LEASEHOLD_FENCE_MODE: "monotonic" }, storeDb.url),
    spawnGuardedServer([], { ...lease, LEASEHOLD_FENCE_MODE: "live" }),
    spawnGuardedServer([], lease, otherStoreDb.url),
  ]);
  leases = grpcClient(leaseServer.url);
  store = guardedGrpcClient(monotonic.url);
  liveStore = guardedConnectClient(live.url);
  otherStore = guardedConnectClient(other.url);
});

const text = (s: string) => new TextEncoder().encode(s);
const read = (b: Uint8Array) => new TextDecoder().decode(b);

async function acquire(key: SessionKey, holder: string) {
  const res = await leases.acquire({ key, ttl: durationFromMillis(30_000), holder });
  if (!res.acquired || !res.lease) throw new Error(`${holder} must be granted the session`);
  return res.lease;
}

/**
 * The run's last heartbeat asks for only 100 ms more, then the run stalls
 * (a GC pause, a suspended laptop) past that deadline. The wait is on the
 * database clock, the one that decides expiry.
 */
async function stallPastDeadline(key: SessionKey, runId: string) {
  await leases.renew({ key, runId, ttl: durationFromMillis(100) });
  await untilExpired(leaseDb.sql, key);
}

async function refusal(call: Promise<unknown>): Promise<ConnectError> {
  return call.then(
    () => expect.fail("expected the write to be refused"),
    (e: unknown) => ConnectError.from(e),
  );
}

function expectStale(error: ConnectError, highest: bigint) {
  expect(error.code).toBe(Code.Aborted);
  const [info] = error.findDetails(ErrorInfoSchema);
  expect(info?.reason).toBe("STALE_FENCING_TOKEN");
  expect(info?.metadata.highest_token).toBe(highest.toString());
}

describe("the paused run (both servers as processes)", () => {
  const session = freshKey("story");
  let t1 = 0n;
  let t2 = 0n;

  it("S6, S7: A writes, pauses past its TTL, B takes over and writes; A's late write is ABORTED and B's document is intact", async () => {
    // Run A (the desktop app) holds the session and writes its transcript.
    const a = await acquire(session, "desktop");
    t1 = a.fencingToken;
    await store.put({
      key: session,
      name: "transcript",
      value: text("A: step 1"),
      fencingToken: t1,
    });

    // A stalls past its deadline.
    await stallPastDeadline(session, a.runId);

    // Run B (the browser) takes the session over with a larger token.
    const b = await acquire(session, "browser");
    t2 = b.fencingToken;
    expect(t2).toBeGreaterThan(t1);
    await store.put({
      key: session,
      name: "transcript",
      value: text("B: step 1"),
      fencingToken: t2,
    });

    // A wakes up, unaware, and sends the write it was about to send.
    const late = await refusal(
      store.put({ key: session, name: "transcript", value: text("A: step 2"), fencingToken: t1 }),
    );
    expectStale(late, t2);
    const doc = await store.get({ key: session, name: "transcript" });
    expect([read(doc.value), doc.fencingToken]).toEqual(["B: step 1", t2]);

    // The lease alone tells A nothing until A asks: its renewal fails now.
    const renew = await refusal(leases.renew({ key: session, runId: a.runId }));
    expect(renew.code).toBe(Code.FailedPrecondition);
  });

  it("S7: A's stale token is refused for every other document of the session too", async () => {
    for (const name of ["files/plan.md", "files/new-file.ts"]) {
      const error = await refusal(
        store.put({ key: session, name, value: text("from A"), fencingToken: t1 }),
      );
      expectStale(error, t2);
    }
    const listed = await store.list({ key: session });
    expect(listed.documents.map((d) => [d.name, d.fencingToken])).toEqual([["transcript", t2]]);
    expect(listed.highestToken).toBe(t2);
  });

  it("S7 live: the live store refuses A's stale token and accepts B's current one", async () => {
    expectStale(
      await refusal(
        liveStore.put({ key: session, name: "transcript", value: text("A"), fencingToken: t1 }),
      ),
      t2,
    );
    const ok = await liveStore.put({
      key: session,
      name: "transcript",
      value: text("B: step 2"),
      fencingToken: t2,
    });
    expect(ok.document?.fencingToken).toBe(t2);
  });

  it("S4, S7 live: a write by an expired holder that nobody replaced is refused in live mode; monotonic mode cannot tell", async () => {
    const key = freshKey("unreplaced");
    const c = await acquire(key, "desktop");
    await liveStore.put({
      key,
      name: "transcript",
      value: text("C: step 1"),
      fencingToken: c.fencingToken,
    });
    await stallPastDeadline(key, c.runId);

    const error = await refusal(
      liveStore.put({
        key,
        name: "transcript",
        value: text("C: late"),
        fencingToken: c.fencingToken,
      }),
    );
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(error.findDetails(ErrorInfoSchema)[0]).toMatchObject({
      reason: "LEASE_NOT_HELD",
      metadata: { cause: "expired" },
    });
    const doc = await liveStore.get({ key, name: "transcript" });
    expect(read(doc.value)).toBe("C: step 1");

    // Monotonic mode only compares tokens: nobody presented a larger one,
    // so it accepts — the gap live mode closes (docs/fencing.md).
    await store.put({
      key,
      name: "transcript",
      value: text("C: late"),
      fencingToken: c.fencingToken,
    });
  });

  it("S7: a resource that has never seen a session accepts its first token", async () => {
    const key = freshKey("first");
    const d = await acquire(key, "desktop");
    expect((await otherStore.list({ key })).highestToken).toBe(0n);
    const put = await otherStore.put({
      key,
      name: "transcript",
      value: text("D: step 1"),
      fencingToken: d.fencingToken,
    });
    expect(put.highestToken).toBe(d.fencingToken);
  });

  it("S7: two independently guarded resources do not interfere: each refuses what it has seen, nothing more", async () => {
    const before = await store.list({ key: session });

    // The other store never saw a token of this session. A's token would
    // raise its fence, so it asks the lease server, which has granted B's
    // since: refused, naming B's. Its fence stays untouched.
    expect((await otherStore.list({ key: session })).highestToken).toBe(0n);
    expectStale(
      await refusal(
        otherStore.put({ key: session, name: "cache", value: text("A"), fencingToken: t1 }),
      ),
      t2,
    );
    expect((await otherStore.list({ key: session })).highestToken).toBe(0n);
    await otherStore.put({ key: session, name: "cache", value: text("B"), fencingToken: t2 });
    expectStale(
      await refusal(
        otherStore.put({ key: session, name: "cache", value: text("A again"), fencingToken: t1 }),
      ),
      t2,
    );
    const other = await otherStore.get({ key: session, name: "cache" });
    expect([read(other.value), other.fencingToken]).toEqual(["B", t2]);

    // The first store's documents and fence are untouched by all of that.
    expect(await store.list({ key: session })).toEqual(before);
  });
});
