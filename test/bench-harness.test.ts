// The benchmark's own checks and plumbing, fast enough for every run: its
// database-side S1 check must be able to see an overlap, and a load
// generator process must report a measured window over real connections.
// Figures are never asserted here; they belong to `npm run bench`.

import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import type { CycleOptions, CycleResult } from "../bench/load-cycles.js";
import { runLoad } from "../bench/load-protocol.js";
import { countOverlappingGrants, createSeedTable } from "../bench/postgres.js";
import { useTestDatabase } from "./support/fixture.js";

const { db } = useTestDatabase();

beforeAll(async () => {
  await createSeedTable(db.sql);
});

describe("benchmark S1 check on the audit trail", () => {
  const record = async (sessionId: string, events: [string, string, number, number][]) => {
    for (const [type, runId, token, second] of events) {
      await db.sql`
        INSERT INTO lease_events (account_id, session_id, type, run_id, fencing_token, holder, at)
        VALUES ('bench-check', ${sessionId}, ${type}, ${runId}::uuid, ${token}, 'test',
                timestamptz '2026-01-01 00:00:00+00' + ${second} * interval '1 second')`;
    }
  };

  it("S1: counts a grant that began before the previous run ended", async () => {
    const [a, b] = [randomUUID(), randomUUID()];
    await record("overlap", [
      ["acquired", a, 1, 0],
      ["acquired", b, 2, 5],
      ["released", a, 1, 10],
      ["released", b, 2, 20],
    ]);
    expect(await countOverlappingGrants(db.sql, "bench-check", "overlap")).toBe(1);
  });

  it("S1: handovers by release and by expiry are not overlaps", async () => {
    const [a, b, c] = [randomUUID(), randomUUID(), randomUUID()];
    await record("clean", [
      ["acquired", a, 1, 0],
      ["released", a, 1, 10],
      ["acquired", b, 2, 10],
      ["expired", b, 2, 15],
      ["acquired", c, 3, 16],
    ]);
    expect(await countOverlappingGrants(db.sql, "bench-check", "clean")).toBe(0);
  });
});

describe("load generator process", () => {
  it("reports the measured window's cycles of the seed's statements, releasing every key it took", async () => {
    const phases: string[] = [];
    const options: CycleOptions = {
      target: { kind: "sql", databaseUrl: db.url },
      concurrency: 2,
      keys: 10,
      ttlSeconds: 30,
      accountId: "bench-smoke",
      warmupMs: 100,
      windowMs: 300,
    };
    const result = await runLoad<CycleResult>(
      "load-cycles.ts",
      options,
      { onMeasure: () => phases.push("measure"), onWindowEnd: () => phases.push("window-end") },
      30_000,
    );
    expect(phases).toEqual(["measure", "window-end"]);
    expect(result.errors).toBe(0);
    expect(result.cycles).toBeGreaterThan(0);
    expect(result.cycle.count).toBe(result.cycles);
    // Every cycle released what it acquired: no key is left held.
    const left = await db.sql`SELECT 1 FROM demo_session_lease WHERE account_id = 'bench-smoke'`;
    expect(left).toHaveLength(0);
  });
});
