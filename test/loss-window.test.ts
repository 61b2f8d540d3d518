// What a lost notification costs (DESIGN §3): an instance that commits a
// change and dies before publishing it. Here the writing instance runs with
// notifications off, so none of its changes is ever published — the worst
// case of that crash, for every change. The other instance must still
// converge: through its deadline timers (confirmed by the database) and its
// periodic re-check, never by polling in between.

import { beforeAll, describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { grpcClient, type LeaseClient, type ServerProcess } from "./support/server.js";
import { logLine, ms, openWatch } from "./support/streams.js";

const { spawnServer } = useTestDatabase();
let silent: ServerProcess;
let watching: ServerProcess;
let timerOnly: ServerProcess;
let writer: LeaseClient;
let reader: LeaseClient;
let timerReader: LeaseClient;

beforeAll(async () => {
  [silent, watching, timerOnly] = await Promise.all([
    spawnServer(["--notifications", "off"]),
    spawnServer(["--recheck-interval", "500ms"], { LEASEHOLD_LOG_LEVEL: "debug" }),
    spawnServer(["--recheck-interval", "10m"]),
  ]);
  writer = grpcClient(silent.url);
  reader = grpcClient(watching.url);
  timerReader = grpcClient(timerOnly.url);
});

describe("changes whose notification was lost", () => {
  it("L1: a release never published reaches a watcher at the released lease's deadline", async () => {
    const key = freshKey("lost-release");
    const a = await writer.acquire({ key, ttl: ms(1_500), holder: "desktop" });
    const watch = openWatch(timerReader, key);
    const first = await watch.reader.next();
    expect(first.kind.case === "snapshot" && first.kind.value.leases[0]?.runId).toBe(
      a.lease?.runId,
    );
    await writer.release({ key, runId: a.lease?.runId ?? "" });
    // No re-check on this instance: its deadline timer reads the row and
    // reports the release it was never told about.
    const seen = await watch.reader.next((m) => m.kind.case === "event");
    expect(seen.kind.case === "event" && seen.kind.value.type).toBe(EventType.RELEASED);
    expect(seen.kind.case === "event" && seen.kind.value.fencingToken).toBe(a.lease?.fencingToken);
    expect(seen.kind.case === "event" && seen.kind.value.id).toBeGreaterThan(0n);
    watch.abort();
  });

  it("L1: a grant never published reaches a watcher through the periodic re-check", async () => {
    const key = freshKey("lost-grant");
    const watch = openWatch(reader, key);
    await watch.reader.next((m) => m.kind.case === "snapshot");
    const a = await writer.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const fresh = await watch.reader.next((m) => m.kind.case === "snapshot");
    expect(fresh.kind.case === "snapshot" && fresh.kind.value.leases.map((l) => l.runId)).toEqual([
      a.lease?.runId,
    ]);
    watch.abort();
  });

  it("L1: a waiter gets a session whose release was never published", async () => {
    const key = freshKey("lost-wake");
    const a = await writer.acquire({ key, ttl: ms(60_000), holder: "desktop" });
    const blocked = logLine(
      watching.child,
      new RegExp(`"sessionId":"${key.sessionId}".*acquire waiting`),
    );
    const waiting = reader.acquire({ key, ttl: ms(60_000), wait: ms(30_000), holder: "browser" });
    await blocked;
    await writer.release({ key, runId: a.lease?.runId ?? "" });
    const won = await waiting;
    expect(won.acquired).toBe(true);
    // Long before the released lease's deadline: the re-check found it.
    expect(won.lease?.acquiredAt?.seconds).toBeLessThan((a.lease?.expiresAt?.seconds ?? 0n) - 30n);
  });
});
