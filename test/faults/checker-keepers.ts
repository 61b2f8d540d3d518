// The checker's rules for keepers (K1, K2) and elections (E1), read from
// the same history (op-history.ts) and lease_events as checker.ts.
// docs/testing.md states each rule and what the history gives it.
//
// Times: the `*Us` values of answers are the database clock; `wallUs` of
// events is the host's clock, the database's own (it runs on this host).

import type { LeaseEvent, Violation } from "./checker.js";
import type { HistoryEvent, OpEvent, PauseNote } from "./op-history.js";

export interface KeeperCheckResult {
  violations: Violation[];
  /** Keepers opened, and heartbeats (and re-attaches) answered ok, checked against K1. */
  keepers: number;
  heartbeatsChecked: number;
  /** Accepted writes of keeper runs checked against their keeper's deadline, and those a pause excused. */
  keeperWritesChecked: number;
  keeperWritesExcused: number;
  /** Leases of lock-delayed keepers that expired and whose key was granted again later (K2 checked). */
  lockDelayChecked: number;
  /** Leadership intervals (E1) and elections they fell in. */
  leaderships: number;
  elections: number;
}

interface KeeperView {
  id: string;
  client: number;
  lockDelayUs: number;
  /** The latest database deadline the client saw confirmed (open, re-attach, heartbeat). */
  deadlineUs: number;
  /** The earliest database time lease_events records one of its leases expired. */
  expiredAtUs?: number;
  /** Host time a close or a revoke of the keeper was answered. */
  endedWallUs?: number;
}

export function checkKeepersAndElections(
  history: readonly HistoryEvent[],
  events: readonly LeaseEvent[],
): KeeperCheckResult {
  const violations: Violation[] = [];
  const flag = (invariant: Violation["invariant"], key: string, message: string) =>
    violations.push({ invariant, key, message });
  const ops = history.filter((e): e is OpEvent => typeof e.process === "number");
  const invokes = new Map<string, OpEvent>();
  const completions: { invoke: OpEvent; done: OpEvent }[] = [];
  for (const e of ops) {
    const id = `${e.process}`;
    if (e.type === "invoke") invokes.set(id, e);
    else {
      const invoke = invokes.get(id);
      invokes.delete(id);
      if (invoke) completions.push({ invoke, done: e });
    }
  }
  const pauses = history.filter((e): e is PauseNote => e.process === "nemesis");

  // Keepers, their confirmed deadlines, and the runs granted on them.
  const keepers = new Map<string, KeeperView>();
  const keeperOf = (id: string, client: number) => {
    let k = keepers.get(id);
    if (!k) {
      k = { id, client, lockDelayUs: 0, deadlineUs: 0 };
      keepers.set(id, k);
    }
    return k;
  };
  const keeperRuns = new Map<
    string,
    { keeperId: string; key: string; token: number; acquiredAtUs: number }
  >();
  for (const { invoke, done } of completions) {
    if (done.type !== "ok") continue;
    // A close or a revoke names its keeper in the invocation only.
    const keeperId = done.value?.keeperId ?? invoke.value?.keeperId;
    if (!keeperId) continue;
    if (done.f === "keeper-open" || done.f === "keeper-attach" || done.f === "keeper-heartbeat") {
      const k = keeperOf(keeperId, done.client);
      k.deadlineUs = Math.max(k.deadlineUs, done.value?.expiresAtUs ?? 0);
      if (done.value?.lockDelayMs) k.lockDelayUs = done.value.lockDelayMs * 1000;
    } else if (done.f === "keeper-acquire" && done.runId && done.token !== undefined) {
      keeperRuns.set(done.runId, {
        keeperId,
        key: done.key,
        token: done.token,
        acquiredAtUs: done.value?.acquiredAtUs ?? 0,
      });
    } else if (
      done.f === "keeper-close" ||
      (done.f === "keeper-revoke" && done.value?.revoked === true)
    ) {
      const k = keeperOf(keeperId, done.client);
      k.endedWallUs = Math.min(k.endedWallUs ?? done.wallUs, done.wallUs);
    }
  }
  // How each keeper lease ended in lease_events, and every grant per key in order.
  const endOfRun = new Map<string, LeaseEvent>();
  const grantsByKey = new Map<string, LeaseEvent[]>();
  for (const e of [...events].sort((a, b) => a.id - b.id)) {
    if (e.type === "acquired") {
      const list = grantsByKey.get(e.key) ?? [];
      list.push(e);
      grantsByKey.set(e.key, list);
    } else if (!endOfRun.has(e.runId)) endOfRun.set(e.runId, e);
  }
  for (const [runId, run] of keeperRuns) {
    const end = endOfRun.get(runId);
    const k = keepers.get(run.keeperId);
    if (end?.type === "expired" && k) k.expiredAtUs = Math.min(k.expiredAtUs ?? end.atUs, end.atUs);
  }

  // K1 (a): nothing renews a keeper, or grants a lease on it, after it ended.
  let heartbeatsChecked = 0;
  for (const { invoke, done } of completions) {
    if (done.type !== "ok") continue;
    const keeperId = done.value?.keeperId;
    const k = keeperId ? keepers.get(keeperId) : undefined;
    if (!k) continue;
    if (done.f === "keeper-heartbeat" || done.f === "keeper-attach") {
      heartbeatsChecked += 1;
      const renewedAt = (done.value?.expiresAtUs ?? 0) - (done.value?.ttlUs ?? 0);
      if (k.expiredAtUs !== undefined && renewedAt > k.expiredAtUs) {
        flag(
          "K1",
          done.key,
          `keeper ${k.id} was renewed at ${renewedAt} (${done.f}), after its leases expired at ${k.expiredAtUs}`,
        );
      }
      if (k.endedWallUs !== undefined && invoke.wallUs > k.endedWallUs) {
        flag(
          "K1",
          done.key,
          `keeper ${k.id} was renewed (${done.f} sent at ${invoke.wallUs}) after its close or revoke was answered at ${k.endedWallUs}`,
        );
      }
    } else if (done.f === "keeper-acquire") {
      const at = done.value?.acquiredAtUs ?? 0;
      if (k.expiredAtUs !== undefined && at > k.expiredAtUs) {
        flag(
          "K1",
          done.key,
          `run ${done.runId} was granted on keeper ${k.id} at ${at}, after its leases expired at ${k.expiredAtUs}`,
        );
      }
    }
  }
  // K1 (a), used: an accepted write of a keeper's run was sent before the
  // keeper's confirmed deadline, unless a pause of its client reached past
  // the point where the client's local deadline fell due.
  let keeperWritesChecked = 0;
  let keeperWritesExcused = 0;
  for (const { invoke, done } of completions) {
    if (done.f !== "write" || done.type !== "ok" || !done.runId) continue;
    const run = keeperRuns.get(done.runId);
    const k = run ? keepers.get(run.keeperId) : undefined;
    if (!run || !k) continue;
    keeperWritesChecked += 1;
    if (invoke.wallUs <= k.deadlineUs) continue;
    const paused = pauses.some(
      (p) =>
        p.client === invoke.client &&
        p.fromUs <= invoke.wallUs &&
        p.toUs >= k.deadlineUs - 1_000_000,
    );
    if (paused) {
      keeperWritesExcused += 1;
      continue;
    }
    flag(
      "K1",
      done.key,
      `run ${done.runId} on keeper ${k.id} wrote with token ${done.token} at ${invoke.wallUs}, after the keeper's deadline ${k.deadlineUs}`,
    );
  }

  // K2 (b): a lease of a lock-delayed keeper that expired (lease_events: no
  // release, no revoke) keeps its key from every other run until the
  // keeper's deadline plus the delay; the confirmed deadline is a lower
  // bound of the database's.
  let lockDelayChecked = 0;
  for (const [runId, run] of keeperRuns) {
    const k = keepers.get(run.keeperId);
    if (!k || k.lockDelayUs === 0) continue;
    const end = endOfRun.get(runId);
    if (end && end.type !== "expired") continue;
    const next = (grantsByKey.get(run.key) ?? []).find(
      (g) => g.runId !== runId && g.token > run.token,
    );
    if (!next) continue;
    // Expired per the audit trail, or never ended there while another run was granted the key.
    lockDelayChecked += 1;
    const until = k.deadlineUs + k.lockDelayUs;
    if (next.atUs < until) {
      flag(
        "K2",
        run.key,
        `run ${next.runId} was granted at ${next.atUs}, before the lock-delay of keeper ${k.id} (run ${runId}) passed at ${until}`,
      );
    }
  }

  // E1: leadership intervals, from the grant (database time) to the
  // earliest of the confirmed deadline, the resign's sending and the
  // signal's abort; per election none overlaps the next, and terms grow.
  const terms = new Map<
    string,
    { key: string; runId: string; term: number; startUs: number; endUs: number }
  >();
  for (const { done } of completions) {
    if (done.f === "campaign" && done.type === "ok" && done.runId && done.token !== undefined) {
      terms.set(done.runId, {
        key: done.key,
        runId: done.runId,
        term: done.token,
        startUs: done.value?.acquiredAtUs ?? 0,
        endUs: done.value?.expiresAtUs ?? 0,
      });
    }
  }
  for (const { done } of completions) {
    const t = done.runId ? terms.get(done.runId) : undefined;
    if (!t) continue;
    if (
      (done.f === "keepalive" || done.f === "acquire" || done.f === "renew") &&
      done.type === "ok"
    ) {
      t.endUs = Math.max(t.endUs, done.value?.expiresAtUs ?? 0);
    }
  }
  // A term held on a keeper is renewed by the keeper's heartbeats: its
  // confirmed deadline is the keeper's too.
  for (const t of terms.values()) {
    const run = keeperRuns.get(t.runId);
    const k = run ? keepers.get(run.keeperId) : undefined;
    if (k) t.endUs = Math.max(t.endUs, k.deadlineUs);
  }
  const stops = new Map<string, number>();
  for (const { invoke } of completions) {
    if (invoke.f === "resign" && invoke.runId) {
      stops.set(invoke.runId, Math.min(stops.get(invoke.runId) ?? invoke.wallUs, invoke.wallUs));
    }
  }
  for (const e of history) {
    if (e.process === "signal" && terms.has(e.runId)) {
      stops.set(e.runId, Math.min(stops.get(e.runId) ?? e.wallUs, e.wallUs));
    }
  }
  const byElection = new Map<string, (typeof terms extends Map<string, infer V> ? V : never)[]>();
  for (const t of terms.values()) {
    const stop = stops.get(t.runId);
    if (stop !== undefined) t.endUs = Math.min(t.endUs, stop);
    const list = byElection.get(t.key) ?? [];
    list.push(t);
    byElection.set(t.key, list);
  }
  for (const [key, list] of byElection) {
    list.sort((a, b) => a.startUs - b.startUs || a.term - b.term);
    let previous: (typeof list)[number] | undefined;
    for (const t of list) {
      if (previous && t.term <= previous.term) {
        flag("E1", key, `term ${t.term} (run ${t.runId}) began after term ${previous.term}`);
      }
      if (previous && t.startUs < previous.endUs) {
        flag(
          "E1",
          key,
          `term ${t.term} (run ${t.runId}) began at ${t.startUs} while term ${previous.term} (run ${previous.runId}) led until ${previous.endUs}`,
        );
      }
      if (!previous || t.endUs > previous.endUs) previous = t;
    }
  }

  return {
    violations,
    keepers: keepers.size,
    heartbeatsChecked,
    keeperWritesChecked,
    keeperWritesExcused,
    lockDelayChecked,
    leaderships: terms.size,
    elections: byElection.size,
  };
}
