// The orchestrator's loop over the scenarios (bench/run.ts) and what it
// says about those that did not run. A scenario that fails has every load
// generator it started stopped, with what each one started itself (the
// KeepAlive scenario's server and PostgreSQL), before the next scenario
// runs: a failed scenario stops what it started, as a finished one does.
// The run goes on, so one failure does not cost the other figures, but it
// ends non-zero naming the failed scenarios, and the table has a row for
// every scenario that did not run: a benchmark that fails never passes
// unseen.

import type { ScenarioReport } from "./context.js";
import { stopLoads } from "./load-protocol.js";
import type { Row } from "./report.js";

export interface Scenario {
  id: string;
  /** As the table names it: "3 KeepAlive". */
  scenario: string;
  /** Set when the scenario cannot run here (said in the table), instead of running it. */
  skip?: string;
  run(): Promise<ScenarioReport>;
}

export interface NotRun {
  scenario: string;
  reason: string;
  /** It started and failed (as opposed to skipped before it started). */
  failed: boolean;
}

export interface ScenarioOutcomes {
  reports: ScenarioReport[];
  notRun: NotRun[];
}

/** Runs `scenarios` in turn; see the top of this file. */
export async function runScenarios(
  scenarios: Scenario[],
  log: (line: string) => void,
  stop: () => Promise<void> = stopLoads,
): Promise<ScenarioOutcomes> {
  const reports: ScenarioReport[] = [];
  const notRun: NotRun[] = [];
  for (const s of scenarios) {
    if (s.skip !== undefined) {
      notRun.push({ scenario: s.scenario, reason: s.skip, failed: false });
      continue;
    }
    try {
      reports.push(await s.run());
    } catch (error) {
      const reason = error instanceof Error ? error.message : String(error);
      log(`scenario ${s.scenario} failed: ${reason}`);
      log(`scenario ${s.scenario}: stopping its load generators and what they started`);
      await stop();
      notRun.push({ scenario: s.scenario, reason: reason.slice(0, 500), failed: true });
    }
  }
  return { reports, notRun };
}

/** A row of the table for each scenario that did not run, saying why. */
export function notRunRows(notRun: NotRun[]): Row[] {
  return notRun.map((n) => ({
    scenario: n.scenario,
    load: n.failed ? "FAILED (see below)" : "skipped (see below)",
    metric: "did not run",
    leasehold: "–",
  }));
}

/** The line the run ends with when a scenario failed (it then exits 1); undefined when none did. */
export function failureSummary(notRun: NotRun[]): string | undefined {
  const failed = notRun.filter((n) => n.failed);
  if (failed.length === 0) return undefined;
  return `bench: ${failed.length} scenario(s) failed: ${failed.map((f) => f.scenario).join(", ")}`;
}
