// L1 crash liveness with a real process, and S9: the server's wall clock
// plays no part in any decision.

import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { once } from "node:events";
import { createInterface } from "node:readline";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { describe, expect, it, vi } from "vitest";
import { useTestServer } from "./support/fixture.js";
import { untilExpired } from "./support/leases.js";
import { repoRoot } from "./support/server.js";

const { db, server, client } = useTestServer();

describe("L1 crash liveness", () => {
  it("L1: a process killed after acquiring leaves a lease that expires; then the session is free and another run takes it", async () => {
    const key = { accountId: "crash", sessionId: `s-${randomUUID().slice(0, 8)}` };
    const child = spawn(
      process.execPath,
      [
        "--import",
        "tsx",
        "test/support/acquire-and-hang.ts",
        server.url,
        key.accountId,
        key.sessionId,
        "300",
      ],
      { cwd: repoRoot, stdio: ["ignore", "pipe", "inherit"] },
    );
    const exited = once(child, "exit");
    const lines = createInterface({ input: child.stdout });
    const [line] = (await once(lines, "line")) as [string];
    const granted = JSON.parse(line) as { acquired: boolean; runId: string; token: string };
    expect(granted.acquired).toBe(true);

    const whileAlive = await client.get({ key });
    expect(whileAlive.held).toBe(true);
    expect(whileAlive.lease?.runId).toBe(granted.runId);

    child.kill("SIGKILL");
    await exited;
    // Nobody releases: only the deadline, on the database clock, frees it.
    await untilExpired(db.sql, key);
    const afterDeath = await client.get({ key });
    expect(afterDeath.held).toBe(false);

    const next = await client.acquire({ key, ttl: create(DurationSchema, { seconds: 30n }) });
    expect(next.acquired).toBe(true);
    expect(next.lease?.fencingToken).toBeGreaterThan(BigInt(granted.token));
  });
});

describe("S9 database time", () => {
  it("S9: a server whose wall clock is a year off grants, blocks and expires exactly as the database says", async () => {
    const key = { accountId: "clock", sessionId: `s-${randomUUID().slice(0, 8)}` };
    vi.useFakeTimers({ toFake: ["Date"] });
    try {
      vi.setSystemTime(Date.now() + 365 * 24 * 3600 * 1000);
      const a = await client.acquire({ key, ttl: create(DurationSchema, { seconds: 30n }) });
      expect(a.acquired).toBe(true);
      const [row] = await db.sql<{ dbNowUs: bigint }[]>`
        SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS db_now_us`;
      const expiresUs =
        (a.lease?.expiresAt?.seconds ?? 0n) * 1_000_000n +
        BigInt((a.lease?.expiresAt?.nanos ?? 0) / 1000);
      // The deadline is 30 s after the database's now, not the server's.
      const ahead = expiresUs - (row?.dbNowUs ?? 0n);
      expect(ahead).toBeGreaterThan(25_000_000n);
      expect(ahead).toBeLessThanOrEqual(30_000_000n);
      const b = await client.acquire({ key, ttl: create(DurationSchema, { seconds: 30n }) });
      expect(b.acquired).toBe(false);
      vi.setSystemTime(Date.now() - 2 * 365 * 24 * 3600 * 1000);
      expect((await client.get({ key })).held).toBe(true);
    } finally {
      vi.useRealTimers();
    }
  });
});
