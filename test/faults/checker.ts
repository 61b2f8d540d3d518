// The history checker of the fault suite: a pure function from what the
// clients saw (the invoke/complete history of op-history.ts: every request
// with its answer and the database times the server returned) and what the
// database recorded (lease_events) to the list of broken invariants of
// DESIGN §1. checkOperations reads the history: it derives the records the
// lease rules are written in (grants, renewals, releases, writes, aborts;
// recordsFromHistory) and checks Gets against the history's real-time order.
//
// Every rule errs towards silence only where the history cannot know more:
// an answer lost on the way back (a dropped connection) hides a renewal from
// the client, so "renewed after its deadline" is judged only against the
// deadline the database must have had (a later grant of another run, the
// run's own release), never against a deadline the client merely last saw.
//
// The cost is O(n log n) in the history's size (maps, sorts, binary searches
// and sweeps; no scan over all records per record), so a soak's history of
// hundreds of thousands of records is checked in seconds.
//
// Times are microseconds since the epoch on the database clock, except the
// `*Ms` fields of guarded writes (the history's monotonic time, used only to
// order two writes in real time) and the `wallUs` of an abort (the same
// host's clock as the database's, used only when the database was down).

import { checkKeepersAndElections, type KeeperCheckResult } from "./checker-keepers.js";
import type { HistoryEvent, LostNote, OpEvent } from "./op-history.js";

export type HistoryRecord =
  | GrantRecord
  | RenewedRecord
  | RenewFailedRecord
  | ReleaseRecord
  | WriteRecord
  | AbortRecord
  | PauseRecord
  | RevokeRecord;

/** A lease the client was granted (Acquire, or runExclusive's grant). */
export interface GrantRecord {
  type: "grant";
  client: number;
  key: string;
  runId: string;
  token: number;
  acquiredAt: number;
  expiresAt: number;
  ttlUs: number;
  via: "acquire" | "exclusive";
}

/**
 * A renewal the client saw confirmed: by Renew, on the KeepAlive stream, or
 * by the same run's Acquire again (an idempotent retry of its valid lease).
 */
export interface RenewedRecord {
  type: "renewed";
  client: number;
  key: string;
  runId: string;
  token: number;
  expiresAt: number;
  ttlUs: number;
  via: "renew" | "keepalive" | "reacquire";
  /** Every earlier renewal of this run had a known outcome, so the client knows its deadline. */
  deadlineKnown: boolean;
}

/**
 * A Renew (or a same-run Acquire, `via` "reacquire") that failed; `cause` is
 * the LEASE_NOT_HELD cause, `code` the error code name.
 */
export interface RenewFailedRecord {
  type: "renew-failed";
  client: number;
  key: string;
  runId: string;
  code: string;
  cause?: string;
  via?: "renew" | "reacquire";
}

/**
 * An admin Revoke the client sent; `revoked` is undefined when its answer was
 * not seen, and `runId`, `token` name the lease it ended when it was true.
 */
export interface RevokeRecord {
  type: "revoke";
  client: number;
  key: string;
  revoked?: boolean;
  runId?: string;
  token?: number;
}

/** A release the client sent; `released` is undefined when its answer was not seen. */
export interface ReleaseRecord {
  type: "release";
  client: number;
  key: string;
  runId: string;
  released?: boolean;
}

/** A guarded store Put made with a run's fencing token. */
export interface WriteRecord {
  type: "write";
  client: number;
  key: string;
  runId: string;
  token: number;
  /** True: accepted; false: refused as stale (ABORTED); undefined: outcome unknown. */
  accepted?: boolean;
  startMs: number;
  endMs: number;
}

/** runExclusive aborted a run's signal while its work was still running. */
export interface AbortRecord {
  type: "abort";
  client: number;
  key: string;
  runId: string;
  /** LeaseLostError.lossReason. */
  reason: string;
  /** The last deadline (expires_at) the client saw confirmed for the run. */
  deadlineUs: number;
  /** The database clock read by a query sent right after the abort, and that query's round trip. */
  dbUs?: number;
  dbRttUs?: number;
  /** The host clock at the abort (the database runs on the same host). */
  wallUs: number;
  /** The run's safety margin: its local deadline falls this long before `deadlineUs`, or earlier. */
  marginUs?: number;
}

/** A client's event loop did not run between these instants (a busy loop or SIGSTOP). */
export interface PauseRecord {
  type: "pause";
  client: number;
  fromUs: number;
  toUs: number;
}

/** One row of lease_events. */
export interface LeaseEvent {
  id: number;
  type: string;
  key: string;
  runId: string;
  token: number;
  atUs: number;
}

export type Invariant =
  | "S1"
  | "S4"
  | "S5"
  | "S6"
  | "S7"
  | "L2"
  | "K1"
  | "K2"
  | "E1"
  | "audit"
  | "get"
  | "history";

export interface Violation {
  invariant: Invariant;
  key: string;
  message: string;
}

export interface CheckResult {
  violations: Violation[];
  /** Aborts after the deadline of clients that were paused across it: excused, not checked. */
  l2Excused: number;
  /** Aborts whose lateness is within the clock query's round trip: not provably late. */
  l2WithinLatency: number;
  /** Aborts checked for L2. */
  l2Checked: number;
  /** Grants in lease_events whose answer no client saw (lost on the way back). */
  unseenGrants: number;
  /**
   * Revokes answered `revoked: true` whose lease (run and token) lease_events
   * records as revoked: the leases Revoke ended, as the checker saw them end.
   * One answered without that record is an audit violation instead.
   */
  revokesConfirmed: number;
}

interface RunView {
  key: string;
  runId: string;
  token: number;
  acquiredAt: number;
  /** The latest confirmed deadline. */
  expiresAt: number;
  /** When its release or revoke (lease_events) ended it. */
  endedAt?: number;
  releaseSent: boolean;
}

/** How soon after a pause ends a client's overdue timers are expected to have fired. */
export const pauseCatchUpUs = 50_000;

/** Checks a history against S1, S4–S7 and L2, and against the database's audit trail. */
export function checkHistory(
  records: readonly HistoryRecord[],
  events: readonly LeaseEvent[],
): CheckResult {
  const violations: Violation[] = [];
  const flag = (invariant: Invariant, key: string, message: string) =>
    violations.push({ invariant, key, message });

  const runs = new Map<string, RunView>();
  // A run holds at most one grant (S4: a run whose lease ended is never
  // granted the session again; a second grant is flagged below). Ends are
  // matched by run and token all the same, so that a second grant's
  // renewals are judged against its own end.
  const releases = events.filter((e) => e.type === "released");
  const ends = events.filter((e) => e.type === "released" || e.type === "revoked");
  const releasedRuns = new Set(releases.map((e) => e.runId));
  const revokedGrants = new Set(
    events.filter((e) => e.type === "revoked").map((e) => `${e.runId}:${e.token}`),
  );
  const revokedRuns = new Set(events.filter((e) => e.type === "revoked").map((e) => e.runId));
  const grantEnd = new Map(ends.map((e) => [`${e.runId}:${e.token}`, e]));
  let revokesConfirmed = 0;

  for (const r of records) {
    if (r.type === "grant") {
      // A run first seen by its release (a release record may come first)
      // is filled in by its grant, not taken for an earlier grant.
      const placeholder = runs.get(r.runId);
      if (placeholder && placeholder.acquiredAt === 0) runs.delete(r.runId);
      const seen = runs.get(r.runId);
      if (seen && seen.token !== r.token) {
        flag(
          "S6",
          r.key,
          `run ${r.runId} was granted twice with tokens ${seen.token} and ${r.token}`,
        );
      }
      if (!seen) {
        runs.set(r.runId, {
          key: r.key,
          runId: r.runId,
          token: r.token,
          acquiredAt: r.acquiredAt,
          expiresAt: r.expiresAt,
          releaseSent: placeholder?.releaseSent ?? false,
        });
      } else {
        seen.expiresAt = Math.max(seen.expiresAt, r.expiresAt);
      }
    } else if (r.type === "renewed") {
      const run = runs.get(r.runId);
      if (!run) continue;
      if (r.token !== run.token) {
        flag("S6", r.key, `renewal of run ${r.runId} changed its token ${run.token} to ${r.token}`);
      }
      // S4: the renewal's own database time is its new deadline minus its TTL.
      const renewedAt = r.expiresAt - r.ttlUs;
      const what = r.via === "reacquire" ? "re-acquired" : "renewed";
      if (r.deadlineKnown && renewedAt >= run.expiresAt) {
        flag(
          "S4",
          r.key,
          `run ${r.runId} was ${what} at ${renewedAt}, after its deadline ${run.expiresAt}`,
        );
      }
      const end = grantEnd.get(`${r.runId}:${r.token}`);
      // An end records no time before the last renewal of the row it ends
      // (a Release or Revoke that waited behind that renewal's row lock read
      // its clock first): a renewal at the end's very instant preceded it.
      if (end && renewedAt > end.atUs) {
        flag(
          "S4",
          r.key,
          `run ${r.runId} was ${what} at ${renewedAt}, after its ${end.type === "revoked" ? "revoke" : "release"} at ${end.atUs}`,
        );
      }
      run.expiresAt = Math.max(run.expiresAt, r.expiresAt);
    } else if (r.type === "release") {
      const run = runs.get(r.runId);
      if (run) run.releaseSent = true;
      else
        runs.set(r.runId, {
          key: r.key,
          runId: r.runId,
          token: 0,
          acquiredAt: 0,
          expiresAt: 0,
          releaseSent: true,
        });
      if (r.released === true && !releasedRuns.has(r.runId)) {
        flag(
          "audit",
          r.key,
          `release of run ${r.runId} answered released=true but lease_events has no release`,
        );
      }
    } else if (r.type === "revoke" && r.revoked === true) {
      if (revokedGrants.has(`${r.runId}:${r.token}`)) revokesConfirmed += 1;
      else {
        flag(
          "audit",
          r.key,
          `revoke answered revoked=true for run ${r.runId} (token ${r.token}) but lease_events has no such revoke`,
        );
      }
    }
  }
  for (const e of ends) {
    const run = runs.get(e.runId);
    if (run && run.token === e.token) run.endedAt = e.atUs;
  }

  // Per key: the held intervals of every run, in grant order.
  const byKey = new Map<string, RunView[]>();
  for (const run of runs.values()) {
    if (run.acquiredAt === 0) continue;
    const list = byKey.get(run.key) ?? [];
    list.push(run);
    byKey.set(run.key, list);
  }
  for (const [key, list] of byKey) {
    list.sort((a, b) => a.acquiredAt - b.acquiredAt || a.token - b.token);
    let holder: RunView | undefined;
    let holderEnd = Number.NEGATIVE_INFINITY;
    for (let i = 0; i < list.length; i++) {
      const run = list[i] as RunView;
      const end = Math.min(run.expiresAt, run.endedAt ?? Number.POSITIVE_INFINITY);
      // S1: a grant may start exactly at the previous deadline (expires_at <= observed_at), not before.
      if (holder && run.acquiredAt < holderEnd) {
        flag(
          "S1",
          key,
          `run ${run.runId} (token ${run.token}) was granted at ${run.acquiredAt} while run ${holder.runId} (token ${holder.token}) held until ${holderEnd}`,
        );
      }
      const previous = list[i - 1];
      if (previous && run.token <= previous.token) {
        flag(
          "S6",
          key,
          `token ${run.token} (run ${run.runId}) was granted after token ${previous.token} (run ${previous.runId})`,
        );
      }
      if (end > holderEnd) {
        holder = run;
        holderEnd = end;
      }
    }
  }

  // S4: no confirmed renewal of a run at or after another run's grant of its
  // key. The key's runs are in grant order (sorted above), so the first grant
  // after the run's own is found by binary search, not by a scan per renewal.
  for (const r of records) {
    if (r.type !== "renewed") continue;
    const list = byKey.get(r.key);
    if (!list) continue;
    const renewedAt = r.expiresAt - r.ttlUs;
    const next = list[firstGrantAfter(list, runs.get(r.runId)?.acquiredAt ?? 0)];
    if (next && next.acquiredAt <= renewedAt) {
      flag(
        "S4",
        r.key,
        `run ${r.runId} was renewed at ${renewedAt}, after run ${next.runId} was granted at ${next.acquiredAt}`,
      );
    }
  }

  // S5: a lease ends as "released" only by its own run's release, and as
  // "revoked" only by a revoke the audit trail records.
  for (const r of records) {
    if (r.type === "renew-failed" && r.cause === "released" && !runs.get(r.runId)?.releaseSent) {
      flag("S5", r.key, `run ${r.runId} never released, yet its renew failed as released`);
    }
    if (r.type === "abort" && r.reason === "released" && !runs.get(r.runId)?.releaseSent) {
      flag("S5", r.key, `run ${r.runId} never released, yet its stream reported it released`);
    }
    const told = r.type === "renew-failed" ? r.cause : r.type === "abort" ? r.reason : undefined;
    if (told === "revoked" && (r.type === "renew-failed" || r.type === "abort")) {
      if (!revokedRuns.has(r.runId)) {
        flag(
          "audit",
          r.key,
          `run ${r.runId} was told its lease was revoked, but lease_events has no revoke of it`,
        );
      }
    }
  }
  for (const e of releases) {
    if (!runs.get(e.runId)?.releaseSent) {
      flag(
        "S5",
        e.key,
        `lease_events records a release of run ${e.runId}, which never asked for one`,
      );
    }
  }

  // S7: an accepted write never follows (in real time) an accepted write with a higher token.
  const writes = new Map<string, WriteRecord[]>();
  for (const r of records) {
    if (r.type !== "write" || r.accepted !== true) continue;
    const list = writes.get(r.key) ?? [];
    list.push(r);
    writes.set(r.key, list);
  }
  // One sweep per key: writes in order of their start, and the highest token
  // among the writes that had finished before the current one started.
  for (const [key, list] of writes) {
    const byEnd = [...list].sort((a, b) => a.endMs - b.endMs);
    list.sort((a, b) => a.startMs - b.startMs);
    let finished = 0;
    let highest: WriteRecord | undefined;
    for (const later of list) {
      for (; finished < byEnd.length; finished++) {
        const earlier = byEnd[finished] as WriteRecord;
        if (earlier.endMs >= later.startMs) break;
        if (!highest || earlier.token > highest.token) highest = earlier;
      }
      if (highest && later.token < highest.token) {
        flag(
          "S7",
          key,
          `write with token ${later.token} accepted after a write with token ${highest.token} was accepted`,
        );
      }
    }
  }

  // L2: a run that lost its lease saw its signal abort before the database deadline.
  const pauses = pauseIndex(records.filter((r): r is PauseRecord => r.type === "pause"));
  let l2Excused = 0;
  let l2WithinLatency = 0;
  let l2Checked = 0;
  // A revoke ends a lease before its deadline; the run's stream then says
  // `revoked`, or `taken_over` once another run was granted the key.
  const revokedAt = new Map<string, number>();
  for (const e of events) {
    if (e.type !== "revoked") continue;
    revokedAt.set(e.runId, Math.min(e.atUs, revokedAt.get(e.runId) ?? e.atUs));
  }
  for (const r of records) {
    if (r.type !== "abort") continue;
    l2Checked += 1;
    const latest = r.dbUs ?? r.wallUs;
    const earliest = r.dbUs !== undefined ? r.dbUs - (r.dbRttUs ?? 0) : r.wallUs;
    const revoked = revokedAt.get(r.runId);
    // A "lost" the server sent is a claim that the lease had expired (or was
    // revoked): it cannot come before the deadline the client saw confirmed.
    if (
      (r.reason === "expired" || r.reason === "taken_over") &&
      latest < r.deadlineUs &&
      (revoked === undefined || revoked > latest)
    ) {
      flag(
        "L2",
        r.key,
        `run ${r.runId} was reported ${r.reason} at ${latest}, before its confirmed deadline ${r.deadlineUs}`,
      );
    }
    if (earliest <= r.deadlineUs) {
      if (latest > r.deadlineUs) l2WithinLatency += 1;
      continue;
    }
    // A client that could not run can abort only once it runs again. Its
    // abort is excused when a pause covered the deadline, or covered the
    // moment its local deadline fell due (the margin before the deadline)
    // and the abort fired first thing after the pause — even when the
    // deadline itself fell in the moment between the two.
    const localDueUs = r.deadlineUs - (r.marginUs ?? 0);
    // The pause reaching furthest among those begun by an instant answers
    // both questions: one pause must satisfy every bound on its end.
    const reach = (atUs: number) =>
      pauses.get(r.client)?.reachFrom(atUs) ?? Number.NEGATIVE_INFINITY;
    const paused =
      reach(r.deadlineUs) >= r.deadlineUs - 1 ||
      (r.marginUs !== undefined &&
        reach(localDueUs) >= Math.max(localDueUs, earliest - pauseCatchUpUs));
    if (paused) {
      l2Excused += 1;
      continue;
    }
    flag(
      "L2",
      r.key,
      `run ${r.runId} aborted at ${earliest} or later, after its deadline ${r.deadlineUs}`,
    );
  }

  // The audit trail: every grant a client saw is recorded once; tokens grow
  // per key. One run_id holds one grant at most: a run whose lease ended
  // (released, revoked, expired) is never granted the session again (S4).
  const acquiredByGrant = new Map<string, LeaseEvent>();
  const grantOfRun = new Map<string, LeaseEvent>();
  const lastToken = new Map<string, number>();
  for (const e of [...events].sort((a, b) => a.id - b.id)) {
    if (e.type !== "acquired") continue;
    const grantId = `${e.runId} ${e.token}`;
    if (acquiredByGrant.has(grantId)) {
      flag(
        "audit",
        e.key,
        `lease_events records the grant of run ${e.runId}, token ${e.token}, twice`,
      );
    }
    acquiredByGrant.set(grantId, e);
    const runKey = `${e.key} ${e.runId}`;
    const earlier = grantOfRun.get(runKey);
    if (earlier && earlier.token !== e.token) {
      flag(
        "S4",
        e.key,
        `run ${e.runId} was granted token ${e.token} after its lease with token ${earlier.token} ended`,
      );
    }
    if (!earlier) grantOfRun.set(runKey, e);
    const last = lastToken.get(e.key);
    if (last !== undefined && e.token <= last) {
      flag("S6", e.key, `lease_events grants token ${e.token} after token ${last}`);
    }
    lastToken.set(e.key, e.token);
  }
  let seenGrants = 0;
  for (const run of runs.values()) {
    if (run.acquiredAt === 0) continue;
    const e = acquiredByGrant.get(`${run.runId} ${run.token}`);
    if (!e) {
      flag(
        "audit",
        run.key,
        `run ${run.runId} (token ${run.token}) was granted but lease_events has no grant`,
      );
    } else if (e.atUs !== run.acquiredAt || e.key !== run.key) {
      flag(
        "audit",
        run.key,
        `run ${run.runId}: granted token ${run.token} at ${run.acquiredAt}, recorded token ${e.token} at ${e.atUs}`,
      );
    } else {
      seenGrants += 1;
    }
  }

  return {
    violations,
    l2Excused,
    l2WithinLatency,
    l2Checked,
    unseenGrants: acquiredByGrant.size - seenGrants,
    revokesConfirmed,
  };
}

/** The index of the first run in `list` (in grant order) granted after `afterUs`, or its length. */
function firstGrantAfter(list: readonly RunView[], afterUs: number): number {
  let low = 0;
  let high = list.length;
  while (low < high) {
    const mid = (low + high) >>> 1;
    if ((list[mid] as RunView).acquiredAt > afterUs) high = mid;
    else low = mid + 1;
  }
  return low;
}

interface PauseReach {
  /** The latest end of a pause that began at or before `atUs`. */
  reachFrom(atUs: number): number;
}

/** Each client's pauses by start, with the furthest end reached so far (pauses may overlap). */
function pauseIndex(pauses: readonly PauseRecord[]): Map<number, PauseReach> {
  const byClient = new Map<number, PauseRecord[]>();
  for (const p of pauses) {
    const list = byClient.get(p.client) ?? [];
    list.push(p);
    byClient.set(p.client, list);
  }
  const index = new Map<number, PauseReach>();
  for (const [client, list] of byClient) {
    list.sort((a, b) => a.fromUs - b.fromUs);
    const starts = list.map((p) => p.fromUs);
    const reach: number[] = [];
    let furthest = Number.NEGATIVE_INFINITY;
    for (const p of list) {
      furthest = Math.max(furthest, p.toUs);
      reach.push(furthest);
    }
    index.set(client, {
      reachFrom(atUs) {
        let low = 0;
        let high = starts.length;
        while (low < high) {
          const mid = (low + high) >>> 1;
          if ((starts[mid] as number) <= atUs) low = mid + 1;
          else high = mid;
        }
        return low === 0 ? Number.NEGATIVE_INFINITY : (reach[low - 1] as number);
      },
    });
  }
  return index;
}

/**
 * The records the lease rules read, derived from the invoke/complete
 * history. Completions are taken in the order of their time, each with its
 * invocation (the one before it on the same process):
 *
 * - an Acquire granted to a run for the first time is its grant; granted
 *   again (the same run_id) it is a renewal (`reacquire`), and refused with
 *   an error a failed renewal;
 * - Renew and KeepAlive answers are renewals, Renew errors failed renewals;
 * - a Release invoked is a release sent (a lease the database shows
 *   released must have been asked for), its answer the release's answer;
 *   so is a waiting Acquire left without an answer (completed `info`, or
 *   never), or with an attempt left without one (the server releases a
 *   grant made for an abandoned wait on the run's behalf);
 * - a Revoke invoked, and its answer; guarded writes with their times;
 * - the notes: a lost lease (an abort), a paused client.
 *
 * A renewal's deadline is known to its client (`deadlineKnown`) when no
 * earlier operation of the run ended unknown or left an attempt without
 * an answer, none was under way when it
 * was invoked, and the run was not kept alive by KeepAlive (whose
 * renewals the library sends on its own).
 */
export function recordsFromHistory(history: readonly HistoryEvent[]): HistoryRecord[] {
  const records: HistoryRecord[] = [];
  const ops: OpEvent[] = [];
  for (const e of history) {
    if (e.process === "nemesis") {
      records.push({ type: "pause", client: e.client, fromUs: e.fromUs, toUs: e.toUs });
    } else if (e.process === "signal") {
      records.push(abortRecord(e));
    } else ops.push(e);
  }
  // Stable: an invocation and its completion at the same nanosecond stay in order.
  ops.sort((a, b) => a.time - b.time);
  const invoked = new Map<number, { op: OpEvent; deadlineKnown: boolean }>();
  const granted = new Set<string>();
  const unknownDeadline = new Set<string>();
  const underWay = new Map<string, number>();
  const lease = new Set(["acquire", "renew", "keepalive"]);
  // The runs acquired on each keeper (its close releases them all), by run id with their key.
  const keeperRuns = new Map<string, Map<string, string>>();
  for (const e of ops) {
    const run = e.runId ?? "";
    if (e.type === "invoke") {
      if (e.f === "keepalive") unknownDeadline.add(run);
      const deadlineKnown = !unknownDeadline.has(run) && (underWay.get(run) ?? 0) === 0;
      if (lease.has(e.f) && run) underWay.set(run, (underWay.get(run) ?? 0) + 1);
      invoked.set(e.process, { op: e, deadlineKnown });
      if (e.f === "release" || e.f === "keeper-release") {
        records.push({ type: "release", client: e.client, key: e.key, runId: run });
      } else if (e.f === "revoke") records.push({ type: "revoke", client: e.client, key: e.key });
      else if (e.f === "keeper-acquire" && e.value?.keeperId) {
        const runs = keeperRuns.get(e.value.keeperId) ?? new Map<string, string>();
        runs.set(run, e.key);
        keeperRuns.set(e.value.keeperId, runs);
      } else if (e.f === "keeper-close-request" && e.value?.keeperId) {
        // A keeper's close releases every lease on it: each of its runs asked.
        for (const [runId, key] of keeperRuns.get(e.value.keeperId) ?? []) {
          records.push({ type: "release", client: e.client, key, runId });
        }
      }
      continue;
    }
    const call = invoked.get(e.process);
    if (!call) continue;
    invoked.delete(e.process);
    const { op, deadlineKnown } = call;
    const runId = op.runId ?? "";
    if (lease.has(e.f) && runId) underWay.set(runId, (underWay.get(runId) ?? 1) - 1);
    // An answer lost, or an attempt left behind by a failover, may still
    // extend the run's deadline unseen.
    const unanswered = e.type === "info" || (e.value?.unanswered ?? 0) > 0;
    if (unanswered && lease.has(e.f)) unknownDeadline.add(runId);
    const renewal = (via: RenewedRecord["via"]): RenewedRecord => ({
      type: "renewed",
      client: e.client,
      key: e.key,
      runId,
      token: e.token ?? 0,
      expiresAt: e.value?.expiresAtUs ?? 0,
      ttlUs: e.value?.ttlUs ?? 0,
      via,
      deadlineKnown: via === "keepalive" ? false : deadlineKnown,
    });
    const failedRenewal = (via: "renew" | "reacquire"): RenewFailedRecord => ({
      type: "renew-failed",
      client: e.client,
      key: e.key,
      runId,
      code: e.error?.code ?? "Error",
      cause: e.error?.cause,
      via,
    });
    switch (e.f) {
      case "acquire":
        if (e.type === "ok" && !granted.has(runId)) {
          granted.add(runId);
          records.push({
            type: "grant",
            client: e.client,
            key: e.key,
            runId,
            token: e.token ?? 0,
            acquiredAt: e.value?.acquiredAtUs ?? 0,
            expiresAt: e.value?.expiresAtUs ?? 0,
            ttlUs: e.value?.ttlUs ?? 0,
            via: "acquire",
          });
        } else if (e.type === "ok") records.push(renewal("reacquire"));
        else if (e.error && granted.has(runId)) records.push(failedRenewal("reacquire"));
        if (unanswered && (op.value?.waitMs ?? 0) > 0) {
          records.push({ type: "release", client: e.client, key: e.key, runId });
        }
        break;
      case "renew":
        if (e.type === "ok") records.push(renewal("renew"));
        else records.push(failedRenewal("renew"));
        break;
      case "keepalive":
        if (e.type === "ok") records.push(renewal("keepalive"));
        break;
      case "release":
        if (e.type === "ok") {
          records.push({
            type: "release",
            client: e.client,
            key: e.key,
            runId,
            released: e.value?.released,
          });
        }
        break;
      case "revoke":
        if (e.type === "ok") {
          records.push({
            type: "revoke",
            client: e.client,
            key: e.key,
            revoked: e.value?.revoked,
            runId: e.runId,
            token: e.token,
          });
        }
        break;
      case "write":
        records.push({
          type: "write",
          client: e.client,
          key: e.key,
          runId,
          token: op.token ?? 0,
          accepted:
            e.type === "ok"
              ? true
              : e.type === "fail" && e.error?.code === "Aborted"
                ? false
                : undefined,
          startMs: op.time / 1e6,
          endMs: e.time / 1e6,
        });
        break;
      default:
        break;
    }
  }
  // An invocation never completed is read as `info`: a waiting Acquire
  // among them may have been granted for a waiter that is gone.
  for (const { op } of invoked.values()) {
    if (op.f === "acquire" && (op.value?.waitMs ?? 0) > 0) {
      records.push({ type: "release", client: op.client, key: op.key, runId: op.runId ?? "" });
    }
  }
  return records;
}

function abortRecord(note: LostNote): AbortRecord {
  return {
    type: "abort",
    client: note.client,
    key: note.key,
    runId: note.runId,
    reason: note.reason,
    deadlineUs: note.deadlineUs,
    dbUs: note.dbUs,
    dbRttUs: note.dbRttUs,
    wallUs: note.wallUs,
    marginUs: note.marginUs,
  };
}

export interface OperationsCheckResult extends CheckResult {
  /** Gets answered with a held lease, checked against the grants completed before they began. */
  getsChecked: number;
  /** The keeper and election rules' figures (K1, K2, E1). */
  keepers: KeeperCheckResult;
}

/**
 * Checks an invoke/complete history: the lease rules of checkHistory on the
 * records derived from it, and the Get rule: a Get that shows a token older
 * than one already granted, its Acquire completed `ok` before the Get was
 * invoked, is a violation (the grant had committed before the Get began,
 * and Get answers the valid lease, which is never an older one).
 *
 * It also checks that the history is one a checker of Jepsen histories
 * accepts ("history"): a process invokes only when its last operation
 * completed `ok` or `fail`, never again after an `info`, and every
 * completion follows an invocation of its process.
 */
export function checkOperations(
  history: readonly HistoryEvent[],
  events: readonly LeaseEvent[],
): OperationsCheckResult {
  const result = checkHistory(recordsFromHistory(history), events);
  const invokedAt = new Map<number, number>();
  const grants = new Map<string, { token: number; doneAt: number; runId: string }[]>();
  const gets = new Map<string, { token: number; invokedAt: number; runId: string }[]>();
  const ops = history
    .filter((e): e is OpEvent => typeof e.process === "number")
    .sort((a, b) => a.time - b.time);
  const retired = new Set<number>();
  const malformed = (e: OpEvent, why: string) =>
    result.violations.push({
      invariant: "history",
      key: e.key,
      message: `process ${e.process} (client ${e.client}) ${why} at ${e.time}`,
    });
  for (const e of ops) {
    if (e.type === "invoke") {
      if (invokedAt.has(e.process)) malformed(e, `invoked ${e.f} during another operation`);
      else if (retired.has(e.process)) malformed(e, `invoked ${e.f} after an info completion`);
      invokedAt.set(e.process, e.time);
      continue;
    }
    const began = invokedAt.get(e.process);
    invokedAt.delete(e.process);
    if (began === undefined) malformed(e, `completed ${e.f} without an invocation`);
    if (e.type === "info") retired.add(e.process);
    if (e.type !== "ok" || e.token === undefined) continue;
    if (e.f === "acquire") {
      const list = grants.get(e.key) ?? [];
      list.push({ token: e.token, doneAt: e.time, runId: e.runId ?? "" });
      grants.set(e.key, list);
    } else if (e.f === "get" && e.value?.held && began !== undefined) {
      const list = gets.get(e.key) ?? [];
      list.push({ token: e.token, invokedAt: began, runId: e.runId ?? "" });
      gets.set(e.key, list);
    }
  }
  let getsChecked = 0;
  // One sweep per key: grants in order of completion, Gets in order of invocation.
  for (const [key, list] of gets) {
    const done = grants.get(key) ?? [];
    list.sort((a, b) => a.invokedAt - b.invokedAt);
    let next = 0;
    let highest: (typeof done)[number] | undefined;
    for (const get of list) {
      getsChecked += 1;
      for (
        ;
        next < done.length && (done[next] as (typeof done)[number]).doneAt < get.invokedAt;
        next++
      ) {
        const grant = done[next] as (typeof done)[number];
        if (!highest || grant.token > highest.token) highest = grant;
      }
      if (highest && get.token < highest.token) {
        result.violations.push({
          invariant: "get",
          key,
          message: `a Get showed token ${get.token} (run ${get.runId}) after token ${highest.token} (run ${highest.runId}) was granted and answered`,
        });
      }
    }
  }
  // K1, K2 and E1 (checker-keepers.ts).
  const keepers = checkKeepersAndElections(history, events);
  result.violations.push(...keepers.violations);
  return { ...result, getsChecked, keepers };
}
