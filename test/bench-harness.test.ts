// The benchmark's own checks and plumbing, fast enough for every run: its
// database-side S1 check must be able to see an overlap, a load generator
// process must report a measured window over real connections, and a
// failure (a load generator that crashes, a scenario that throws) must stop
// every process it started and be reported, never pass unseen.
// Figures are never asserted here; they belong to `npm run bench`.

import { randomUUID } from "node:crypto";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { beforeAll, describe, expect, it } from "vitest";
import type { ScenarioReport } from "../bench/context.js";
import type { CycleOptions, CycleResult } from "../bench/load-cycles.js";
import { runLoad } from "../bench/load-protocol.js";
import { countOverlappingGrants, createSeedTable } from "../bench/postgres.js";
import { failureSummary, notRunRows, runScenarios } from "../bench/scenarios.js";
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

describe("a failing scenario stops what it started and is reported", () => {
  const fixture = "../test/fixtures/bench-load-leaves-child.ts";
  const alive = (pid: number) => {
    try {
      process.kill(pid, 0);
      return true;
    } catch {
      return false;
    }
  };
  const withPidFile = async <T>(work: (pidFile: string) => Promise<T>) => {
    const dir = await mkdtemp(path.join(os.tmpdir(), "bench-harness-"));
    try {
      return await work(path.join(dir, "pid"));
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  };

  it("a load generator that crashes takes the processes it started with it", async () => {
    await withPidFile(async (pidFile) => {
      const load = runLoad(fixture, { pidFile, mode: "crash" }, {}, 30_000);
      await expect(load).rejects.toThrow(/exited with 1/);
      const pid = Number(await readFile(pidFile, "utf8"));
      expect(pid).toBeGreaterThan(0);
      // runLoad settles once the load generator's process group is gone.
      expect(alive(pid), `process ${pid} the load generator started`).toBe(false);
    });
  });

  it("a scenario that fails has its running load generators stopped, is named, and says it did not run; the next one runs", async () => {
    await withPidFile(async (pidFile) => {
      let load: Promise<unknown> | undefined;
      const lines: string[] = [];
      const report: ScenarioReport = {
        id: "after",
        name: "after",
        figures: {},
        rows: [],
        comparisons: [],
        targets: [],
      };
      const { reports, notRun } = await runScenarios(
        [
          {
            id: "broken",
            scenario: "3 KeepAlive",
            run: async () => {
              // The scenario fails while a load generator it started runs.
              await new Promise<void>((measuring, failed) => {
                load = runLoad(
                  fixture,
                  { pidFile, mode: "hang" },
                  { onMeasure: measuring },
                  60_000,
                );
                load.catch(failed);
              });
              throw new Error("setup could not acquire s17");
            },
          },
          {
            id: "skipped",
            scenario: "4 watch fan-out",
            skip: "no Watch here",
            run: async () => report,
          },
          { id: "after", scenario: "5 after", run: async () => report },
        ],
        (line) => lines.push(line),
      );
      await expect(load).rejects.toThrow(/stopped/);
      const pid = Number(await readFile(pidFile, "utf8"));
      expect(alive(pid), `process ${pid} the load generator started`).toBe(false);
      expect(reports).toEqual([report]);
      expect(notRun).toEqual([
        { scenario: "3 KeepAlive", reason: "setup could not acquire s17", failed: true },
        { scenario: "4 watch fan-out", reason: "no Watch here", failed: false },
      ]);
      expect(lines[0]).toBe("scenario 3 KeepAlive failed: setup could not acquire s17");
      expect(notRunRows(notRun).map((r) => [r.scenario, r.load, r.metric])).toEqual([
        ["3 KeepAlive", "FAILED (see below)", "did not run"],
        ["4 watch fan-out", "skipped (see below)", "did not run"],
      ]);
      expect(failureSummary(notRun)).toBe("bench: 1 scenario(s) failed: 3 KeepAlive");
      expect(failureSummary(notRun.filter((n) => !n.failed))).toBeUndefined();
    });
  });
});
