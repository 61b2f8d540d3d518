// This page as a device: it starts a run on a session, keeps its lease
// alive, and stops it. Browsers cannot open KeepAlive (a bidirectional
// stream needs HTTP/2 end to end, and fetch uploads do not stream over
// HTTP/1.1), so the page renews with unary Renew calls about every TTL/3.
//
// L2: the page presents itself as the holder only while it has a confirmed
// grant. Its local deadline is measured on the monotonic clock from when
// each request was *sent*, plus the `remaining` the database answered,
// minus a margin: neither clock skew nor a slow answer extends it. When a
// renewal says the lease is not held, or the local deadline passes without
// a confirmed renewal, the run ends: renewals stop, the run's AbortSignal
// fires, and the page stops showing itself as running.

import type { Lease } from "../../src/gen/leasehold/v1/lease_pb.js";
import { describeError, errorInfo, isLeaseNotHeld, type LeaseClient } from "./api.js";
import { durationMs, msDuration } from "./durations.js";

export interface SessionKey {
  accountId: string;
  sessionId: string;
}

export interface RunSettings {
  key: SessionKey;
  holder: string;
  ttlMs: number;
}

export type DeviceState =
  | { kind: "idle" }
  | { kind: "starting"; runId: string }
  | {
      kind: "running";
      runId: string;
      lease: Lease;
      /** performance.now() after which this page no longer claims the lease. */
      deadline: number;
      /** Aborts when the run ends, for whatever reason. */
      signal: AbortSignal;
    }
  | { kind: "stopping"; runId: string };

export interface DeviceHooks {
  /** A lease seen in an answer (the grant, a renewal, the lease in the way). */
  onLease(lease: Lease, now: number): void;
  /** This page released its run's lease. */
  onReleased(key: SessionKey, runId: string): void;
  onChange(): void;
}

interface Run extends RunSettings {
  runId: string;
  controller: AbortController;
  renewTimer?: ReturnType<typeof setTimeout>;
  deadlineTimer?: ReturnType<typeof setTimeout>;
}

export class Device {
  state: DeviceState = { kind: "idle" };
  /** What happened last, for the status line. */
  note = "";
  private run: Run | undefined;

  constructor(
    private readonly client: LeaseClient,
    private readonly hooks: DeviceHooks,
  ) {}

  /** Acquires the session for a new run; resolves when it runs or was refused. */
  async start(settings: RunSettings): Promise<void> {
    if (this.run) return;
    const run: Run = { ...settings, runId: crypto.randomUUID(), controller: new AbortController() };
    this.run = run;
    this.set({ kind: "starting", runId: run.runId }, "");
    const sentAt = performance.now();
    let lease: Lease | undefined;
    try {
      const answer = await this.client.acquire(
        { key: run.key, runId: run.runId, ttl: msDuration(run.ttlMs), holder: run.holder },
        { signal: run.controller.signal, timeoutMs: run.ttlMs },
      );
      if (!answer.acquired) {
        if (answer.current) this.hooks.onLease(answer.current, performance.now());
        const holder = answer.current?.holder || "another device";
        this.finish(run, `Not started: the session is running on ${holder}.`, false);
        return;
      }
      lease = answer.lease;
    } catch (error) {
      // The grant may have been made and its answer lost: release it by
      // run id (owner-checked, so it can only end this run's lease).
      const why = run.controller.signal.aborted ? "cancelled" : describeError(error);
      this.finish(run, `Not started: ${why}.`, true);
      return;
    }
    if (this.run !== run || lease === undefined) return;
    this.hooks.onLease(lease, performance.now());
    const deadline = localDeadline(sentAt, lease, run.ttlMs);
    if (deadline <= performance.now()) {
      this.finish(run, "Not started: the grant arrived after its own deadline.", true);
      return;
    }
    this.confirm(run, lease, deadline);
  }

  /** Ends the run and releases its lease. */
  async stop(): Promise<void> {
    const run = this.run;
    if (!run) return;
    if (this.state.kind === "starting") {
      // start() sees the abort and releases by run id.
      run.controller.abort();
      return;
    }
    this.clear(run);
    this.set({ kind: "stopping", runId: run.runId }, "");
    let note: string;
    try {
      const answer = await this.client.release(
        { key: run.key, runId: run.runId },
        { timeoutMs: 5000 },
      );
      if (answer.released) this.hooks.onReleased(run.key, run.runId);
      note = answer.released ? "Stopped and released." : "Stopped; the lease had already ended.";
    } catch (error) {
      note = `Stopped; the release failed (${describeError(error)}), so the lease ends with its TTL.`;
    }
    if (this.run === run) {
      this.run = undefined;
      this.set({ kind: "idle" }, note);
    }
  }

  private confirm(run: Run, lease: Lease, deadline: number): void {
    this.set(
      { kind: "running", runId: run.runId, lease, deadline, signal: run.controller.signal },
      this.state.kind === "running" ? this.note : "",
    );
    clearTimeout(run.deadlineTimer);
    run.deadlineTimer = setTimeout(
      () =>
        this.finish(run, "Lease lost: no renewal was confirmed before the local deadline.", true),
      deadline - performance.now(),
    );
    this.scheduleRenew(run, run.ttlMs / 3);
  }

  private scheduleRenew(run: Run, delayMs: number): void {
    clearTimeout(run.renewTimer);
    run.renewTimer = setTimeout(() => void this.renew(run), delayMs);
  }

  private async renew(run: Run): Promise<void> {
    const state = this.state;
    if (this.run !== run || state.kind !== "running") return;
    const sentAt = performance.now();
    try {
      const answer = await this.client.renew(
        { key: run.key, runId: run.runId },
        // A renewal that cannot answer before the local deadline is useless.
        // (The Connect timeout header takes whole milliseconds.)
        {
          signal: run.controller.signal,
          timeoutMs: Math.max(1, Math.floor(state.deadline - sentAt)),
        },
      );
      if (this.run !== run || answer.lease === undefined) return;
      this.hooks.onLease(answer.lease, performance.now());
      this.note = "";
      this.confirm(run, answer.lease, localDeadline(sentAt, answer.lease, run.ttlMs));
    } catch (error) {
      if (this.run !== run) return;
      if (isLeaseNotHeld(error)) {
        const cause = errorInfo(error).metadata.cause || "not held";
        this.finish(run, `Lease lost: ${cause.replace("_", " ")}.`, false);
        return;
      }
      // Not a definite answer: try again until the local deadline decides.
      this.note = `Renewal failed (${describeError(error)}); retrying.`;
      this.hooks.onChange();
      this.scheduleRenew(run, Math.min(run.ttlMs / 10, 1000));
    }
  }

  private finish(run: Run, note: string, release: boolean): void {
    if (this.run !== run) return;
    this.clear(run);
    this.run = undefined;
    this.set({ kind: "idle" }, note);
    if (release) {
      this.client.release({ key: run.key, runId: run.runId }, { timeoutMs: 5000 }).then(
        (answer) => {
          if (answer.released) this.hooks.onReleased(run.key, run.runId);
        },
        () => {
          // Unreachable server: the lease ends with its TTL, as L1 promises.
        },
      );
    }
  }

  private clear(run: Run): void {
    clearTimeout(run.renewTimer);
    clearTimeout(run.deadlineTimer);
    run.controller.abort();
  }

  private set(state: DeviceState, note: string): void {
    this.state = state;
    this.note = note;
    this.hooks.onChange();
  }
}

/**
 * The deadline this page keeps for a grant: when the request was sent plus
 * the database's `remaining`, minus a margin of a tenth of the TTL (at most
 * 2 s) for the time the answer took to arrive and timer lateness.
 */
export function localDeadline(sentAt: number, lease: Lease, ttlMs: number): number {
  return sentAt + durationMs(lease.remaining) - Math.min(ttlMs / 10, 2000);
}
