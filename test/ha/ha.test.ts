// The HA suite (issue 28, npm run test:ha): Leasehold on the reference
// deployment of deploy/ha — three Patroni members (PostgreSQL 15,
// synchronous replication), etcd 3.4 as the DCS, HAProxy following the
// primary by Patroni's REST API — with three lease servers and the guarded
// store behind HAProxy, under the fault suite's clients and history checker.
//
// The cluster manager decides here, not the suite: each fault is injected
// into the stack (a process killed, frozen, restarted, a switchover asked
// for) and the suite waits to see that it bit (the primary moved, the
// timeline changed, the member rejoined) before its outcome counts. Per
// fault it asserts that every instance grants again, that tokens granted
// after it exceed every token acknowledged before it, and that every grant
// acknowledged before it is read back afterwards; at the end the whole
// history goes through the checker (S1, S4–S7, L2, the audit trail), one
// test per invariant. Timings are printed, never asserted.

import { once } from "node:events";
import { createWriteStream } from "node:fs";
import { mkdir, writeFile } from "node:fs/promises";
import path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { Code, ConnectError } from "@connectrpc/connect";
import postgres from "postgres";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { durationFromMs, LeaseholdError } from "../../src/client/index.js";
import { openDatabase } from "../../src/postgres/pool.js";
import {
  checkOperations,
  type Invariant,
  type LeaseEvent,
  type OperationsCheckResult,
  recordsFromHistory,
} from "../faults/checker.js";
import { countOperations, type HistoryEvent } from "../faults/op-history.js";
import { createPrng, soakBounds, suiteSeed } from "../faults/prng.js";
import { grpcClient, type LeaseClient, repoRoot } from "../support/server.js";
import { waitFor } from "../support/wait.js";
import { type HaStack, type Member, startHaStack } from "./stack.js";
import { failedWith, type History, operationsOf, startWorker, type Worker } from "./workers.js";

const soak = process.env.LEASEHOLD_SOAK === "1";
const bounds = soakBounds();
const seed = suiteSeed();
const rng = createPrng(seed);
const ttlMs = 1_200;
const clientCount = soak ? 8 : 4;
const accountId = "ha";
const sessionIds = soak
  ? ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
  : ["alpha", "beta", "gamma"];
const probeAccount = "ha-probe";
/** The history's time 0, on the host's monotonic clock (the clients' `time` counts from it). */
const originNs = process.hrtime.bigint();
/** The DCS ttl of deploy/ha/patroni.yml: a frozen primary stays frozen past it. */
const patroniTtlMs = 20_000;
/** How long the suite waits for the stack to do something it must do (promote, rejoin). */
const stackBoundMs = 180_000;
const soakCapMinutes = 6 * 60;

const errorCode = (error: unknown): Code =>
  error instanceof LeaseholdError ? error.code : ConnectError.from(error).code;

/** Retries a call while it fails with UNAVAILABLE or DEADLINE_EXCEEDED, up to a bound. */
async function untilAvailable<T>(call: () => Promise<T>, boundMs = stackBoundMs): Promise<T> {
  const giveUpAt = performance.now() + boundMs;
  for (;;) {
    try {
      return await call();
    } catch (error) {
      const code = errorCode(error);
      const retriable = code === Code.Unavailable || code === Code.DeadlineExceeded;
      if (!retriable || performance.now() > giveUpAt) throw error;
      await sleep(100);
    }
  }
}

/** Retries a statement of the suite's own (through HAProxy) while the database is away. */
async function untilAnswered<T>(query: () => Promise<T>, boundMs = stackBoundMs): Promise<T> {
  const giveUpAt = performance.now() + boundMs;
  for (;;) {
    try {
      return await query();
    } catch (error) {
      if (performance.now() > giveUpAt) throw error;
      await sleep(200);
    }
  }
}

/** What the suite reports of one fault. */
interface FaultReport {
  fault: string;
  /** Where it struck and what showed that it bit. */
  detail: string;
  killToNewPrimaryMs?: number;
  killToEveryInstanceGrantingMs: number;
  unavailableCalls: number;
  /** Calls that ran into their deadline (2 s in the clients): a commit that waited. */
  deadlineCalls: number;
  /** Leader changes seen while this fault was under way. */
  leaderChanges: number;
  asserted: string;
}

interface Fault {
  /** Its name in LEASEHOLD_HA_FAULTS. */
  id: string;
  name: string;
  expected: string;
  /** Injects the fault, waits until it bit; resolves with its detail and when it struck. */
  inject(): Promise<{ detail: string; struckAt: number; newPrimaryAt?: number }>;
}

describe.sequential("Leasehold on Patroni, etcd and HAProxy, faults under a checked history", () => {
  let stack: HaStack;
  let admin: postgres.Sql;
  const workers: Worker[] = [];
  let history: History;
  const reports: FaultReport[] = [];
  let result: OperationsCheckResult | undefined;
  let exitCodes: (number | null)[] = [];
  let startedAt = 0;
  let cycles = 1;
  let probe = 0;
  const probeKey = (what: string) => ({ accountId: probeAccount, sessionId: `${what}-${++probe}` });
  let clients: LeaseClient[] = [];
  /** Grants the clients saw, in the order their answers arrived. */
  const grants: { runId: string; token: number }[] = [];
  const grantedRuns = new Set<string>();
  // The leader as the REST APIs tell it, sampled all along: a change outside
  // an injected fault is a failover the stack made on its own.
  let leader: string | undefined;
  let faultUnderWay: string | undefined;
  let faultLeaderChanges = 0;
  const automaticFailovers: { at: string; from?: string; to?: string }[] = [];
  let monitoring = true;
  let monitor: Promise<void> = Promise.resolve();

  const log = (line: string) => console.log(`[ha ${new Date().toISOString()}] ${line}`);

  beforeAll(async () => {
    log(`HA suite seed ${seed} (replay: LEASEHOLD_FAULT_SEED=${seed} npm run test:ha)`);
    const results = path.join(repoRoot, "test-results");
    await mkdir(results, { recursive: true });
    history = { events: [], out: createWriteStream(path.join(results, "ha-history.jsonl")) };
    stack = await startHaStack({ log });
    admin = postgres(stack.databaseUrl, { max: 1, onnotice: () => {}, connect_timeout: 5 });
    clients = stack.instances.map((i) => grpcClient(i.url));
    leader = (await stack.primary())?.name;
    monitor = (async () => {
      while (monitoring) {
        const now = (await stack.primary())?.name;
        if (now !== undefined && now !== leader) {
          if (faultUnderWay !== undefined) faultLeaderChanges += 1;
          else {
            automaticFailovers.push({ at: new Date().toISOString(), from: leader, to: now });
            log(`automatic failover: ${leader} → ${now}`);
          }
          leader = now;
        }
        await sleep(250);
      }
    })();
    startedAt = performance.now();
    const budgetMs = soak ? (bounds.minutes ?? soakCapMinutes) * 60_000 : 0;
    const urls = stack.instances.map((i) => i.url);
    for (let i = 0; i < clientCount; i++) {
      workers.push(
        startWorker(
          {
            client: i,
            clients: clientCount,
            originNs: originNs.toString(),
            seed: (seed + i * 0x9e37_79b9) >>> 0,
            // Each client prefers another instance first.
            baseUrls: urls.map((_, k) => urls[(k + i) % urls.length] as string),
            guardedUrl: stack.guardedUrl,
            databaseUrl: stack.databaseUrl,
            accountId,
            sessionIds,
            durationMs: budgetMs + 3_600_000,
            ttlMs,
            protocol: i % 2 === 1 ? "grpc" : "connect",
            holdScale: soak ? 0.25 : 1,
          },
          history,
          (event: HistoryEvent) => {
            // A grant: an Acquire answered ok for a run not granted before.
            if (event.type !== "ok" || event.f !== "acquire" || !event.runId) return;
            if (grantedRuns.has(event.runId)) return;
            grantedRuns.add(event.runId);
            grants.push({ runId: event.runId, token: event.token ?? 0 });
          },
        ),
      );
    }
    // Part of the schedule: every client holds and writes before the first fault.
    await sleep(4 * ttlMs);
  }, 600_000);

  afterAll(async () => {
    monitoring = false;
    await monitor;
    for (const w of workers) if (w.child.exitCode === null) w.child.kill("SIGKILL");
    await admin?.end({ timeout: 1 });
    await stack?.close();
    if (history && !history.out.closed) {
      history.out.end();
      await once(history.out, "close");
    }
  }, 120_000);

  const instanceGrants = async (i: number) => {
    const client = clients[i] as LeaseClient;
    const granted = await untilAvailable(() =>
      client.acquire({ key: probeKey("after"), ttl: durationFromMs(ttlMs) }, { timeoutMs: 5_000 }),
    );
    expect(granted.acquired, `instance ${i} grants`).toBe(true);
    return granted.lease?.fencingToken ?? 0n;
  };

  /** Waits until another member than `old` is the primary; returns when it was first seen. */
  async function newPrimary(old: Member): Promise<{ member: Member; at: number }> {
    const member = await waitFor(
      async () => {
        const now = await stack.primary();
        return now !== undefined && now !== old ? now : undefined;
      },
      { what: `a primary other than ${old.name}`, timeoutMs: stackBoundMs, intervalMs: 100 },
    );
    return { member, at: performance.now() };
  }

  /** A member runs as a replica again: Patroni says so, and so does PostgreSQL. */
  async function rejoined(m: Member) {
    await waitFor(
      async () => {
        const status = await stack.status(m);
        if (status?.role !== "replica" || status.state !== "running") return false;
        const sql = postgres(stack.directUrl(m, "postgres"), {
          max: 1,
          connect_timeout: 2,
          fetch_types: false,
          onnotice: () => {},
        });
        try {
          const [row] = await sql<{ standby: boolean }[]>`SELECT pg_is_in_recovery() AS standby`;
          return row?.standby === true;
        } catch {
          return false;
        } finally {
          await sql.end({ timeout: 0 });
        }
      },
      { what: `${m.name} to rejoin as a replica`, timeoutMs: stackBoundMs, intervalMs: 250 },
    );
  }

  const timelineOf = async (m: Member) => (await stack.status(m))?.timeline ?? 0;

  /** The new primary's timeline once Patroni reports it past `old` (it lags the promotion by a loop). */
  const timelineAfter = (m: Member, old: number) =>
    waitFor(
      async () => {
        const now = await timelineOf(m);
        return now > old ? now : undefined;
      },
      { what: `${m.name}'s timeline to pass ${old}`, timeoutMs: stackBoundMs, intervalMs: 250 },
    );

  // Once a fault has bit, how long until every lease server grants again:
  // probed at once, while the suite goes on to wait for the old primary to
  // rejoin (which does not hold up grants).
  let granting: Promise<{ at: number; tokens: bigint[] }> | undefined;
  const probeGranting = () => {
    granting = Promise.all(stack.instances.map((i) => instanceGrants(i.index))).then((tokens) => ({
      at: performance.now(),
      tokens,
    }));
    // Awaited by inject(); a failure is reported there.
    granting.catch(() => {});
  };
  // Read through a function: inject() clears it before the fault sets it.
  const grantingProbe = () => granting;

  const primaryNow = async () =>
    waitFor(() => stack.primary(), {
      what: "a primary",
      timeoutMs: stackBoundMs,
      intervalMs: 100,
    });

  // SIGKILL of the primary's postmaster: Patroni (primary_start_timeout 0)
  // fails over to the synchronous standby rather than restarting it.
  async function killPostmaster() {
    const old = await primaryNow();
    const timeline = await timelineOf(old);
    const pid = await stack.postmasterPid(old);
    const struckAt = performance.now();
    process.kill(pid, "SIGKILL");
    const promoted = await newPrimary(old);
    probeGranting();
    const newTimeline = await timelineAfter(promoted.member, timeline);
    await rejoined(old);
    return {
      detail: `${old.name} (postmaster ${pid}) → ${promoted.member.name}, timeline ${timeline} → ${newTimeline}; ${old.name} rejoined as a replica`,
      struckAt,
      newPrimaryAt: promoted.at,
    };
  }

  // SIGKILL of the primary's Patroni; PostgreSQL runs on without it. HAProxy
  // marks it down (its REST API is gone); the leader key expires after the
  // ttl and the synchronous standby is promoted. Then Patroni is started
  // again, as systemd would, and turns its PostgreSQL into a replica.
  async function killPatroni() {
    const old = await primaryNow();
    const timeline = await timelineOf(old);
    const postmaster = await stack.postmasterPid(old);
    const struckAt = performance.now();
    old.patroni.kill("SIGKILL");
    const promoted = await newPrimary(old);
    probeGranting();
    const newTimeline = await timelineAfter(promoted.member, timeline);
    let stillRunning = true;
    try {
      process.kill(postmaster, 0);
    } catch {
      stillRunning = false;
    }
    await stack.restartPatroni(old);
    await rejoined(old);
    return {
      detail: `${old.name}'s Patroni killed (its postmaster ${stillRunning ? "still running" : "gone"} at the promotion) → ${promoted.member.name}, timeline ${timeline} → ${newTimeline}; Patroni restarted, ${old.name} rejoined as a replica`,
      struckAt,
      newPrimaryAt: promoted.at,
    };
  }

  // A planned switchover to the synchronous standby.
  async function switchover() {
    const old = await primaryNow();
    const timeline = await timelineOf(old);
    const listed = JSON.parse(await stack.patronictl(["list", "-f", "json"])) as {
      Member: string;
      Role: string;
    }[];
    const candidate = listed.find((m) => m.Role === "Sync Standby")?.Member;
    expect(candidate, "a synchronous standby to switch over to").toBeDefined();
    const struckAt = performance.now();
    await stack.patronictl([
      "switchover",
      "--leader",
      old.name,
      "--candidate",
      candidate as string,
      "--force",
    ]);
    const promoted = await newPrimary(old);
    probeGranting();
    expect(promoted.member.name).toBe(candidate);
    const newTimeline = await timelineAfter(promoted.member, timeline);
    await rejoined(old);
    return {
      detail: `${old.name} → ${candidate}, timeline ${timeline} → ${newTimeline}; ${old.name} rejoined as a replica`,
      struckAt,
      newPrimaryAt: promoted.at,
    };
  }

  // Every process of the primary (Patroni, the postmaster, its backends)
  // stopped past the DCS ttl, then continued. Writes sent to it after it
  // wakes, directly (as a pool that kept a connection to it would), must
  // not be acknowledged unless they are on the new primary; it must rejoin
  // as a replica.
  let frozenWrite = 0;
  async function freezePrimary() {
    const old = await primaryNow();
    const timeline = await timelineOf(old);
    // The lease servers' own pool settings (statement and lock timeouts).
    const direct = openDatabase({
      url: stack.directUrl(old),
      maxConnections: 1,
      statementTimeoutMs: 5_000,
      lockTimeoutMs: 1_000,
      idleInTransactionTimeoutMs: 5_000,
      applicationName: "ha-frozen-probe",
      connectTimeoutSeconds: 2,
    });
    await direct`SELECT 1`;
    const pids = await stack.processesOf(old);
    const struckAt = performance.now();
    for (const pid of pids) process.kill(pid, "SIGSTOP");
    let promoted: { member: Member; at: number };
    const writes: { id: string; acknowledged: boolean; error?: string }[] = [];
    try {
      promoted = await newPrimary(old);
      probeGranting();
      // Past the ttl, whatever the promotion took.
      const frozenFor = performance.now() - struckAt;
      if (frozenFor < patroniTtlMs) await sleep(patroniTtlMs - frozenFor);
    } finally {
      for (const pid of await stack.processesOf(old)) {
        try {
          process.kill(pid, "SIGCONT");
        } catch {}
      }
      for (const pid of pids) {
        try {
          process.kill(pid, "SIGCONT");
        } catch {}
      }
    }
    // Writes sent to it as soon as it runs again: on the connection the
    // pool kept, then on new connections until it is a replica.
    // Each write gets a few seconds before the next is sent: one that waits
    // (for a synchronous standby that no longer follows this member) is
    // left waiting, and its outcome is collected once the member rejoined.
    const connections: postgres.Sql[] = [direct as unknown as postgres.Sql];
    const settled: Promise<void>[] = [];
    const attempt = async (sql: postgres.Sql) => {
      const write: (typeof writes)[number] = { id: `frozen-${++frozenWrite}`, acknowledged: false };
      writes.push(write);
      const outcome = sql`INSERT INTO ha_probe_writes (id) VALUES (${write.id})`.then(
        () => {
          write.acknowledged = true;
          write.error = undefined;
        },
        (error: unknown) => {
          write.error = (error as Error).message;
        },
      );
      write.error = "no answer yet";
      settled.push(outcome);
      await Promise.race([outcome, sleep(3_000)]);
    };
    await attempt(direct as unknown as postgres.Sql);
    let done = false;
    const rejoining = rejoined(old).finally(() => {
      done = true;
    });
    // Awaited below, after the loop; a failure is thrown there.
    rejoining.catch(() => {});
    while (!done) {
      const fresh = postgres(stack.directUrl(old), {
        max: 1,
        connect_timeout: 2,
        // No type query of its own on connecting: against a member that is
        // going away, postgres.js left that query's failure unhandled.
        fetch_types: false,
        onnotice: () => {},
        connection: { statement_timeout: 5_000 },
      });
      connections.push(fresh);
      await attempt(fresh);
      await sleep(200);
    }
    await rejoining;
    // A member that rejoined has ended every session it had: each write has
    // its outcome by now, or never gets one.
    await Promise.race([Promise.all(settled), sleep(10_000)]);
    await Promise.all(connections.map((c) => c.end({ timeout: 0 })));
    const acknowledged = writes.filter((w) => w.acknowledged).map((w) => w.id);
    const found = await untilAnswered(
      () => admin<{ id: string }[]>`SELECT id FROM ha_probe_writes WHERE id = ANY(${acknowledged})`,
    );
    expect(
      acknowledged.filter((id) => !found.some((r) => r.id === id)),
      "writes the woken primary acknowledged are on the new primary",
    ).toEqual([]);
    const newTimeline = await timelineAfter(promoted.member, timeline);
    const errors = [...new Set(writes.filter((w) => !w.acknowledged).map((w) => w.error))];
    return {
      detail: `${old.name} frozen (${pids.length} processes) → ${promoted.member.name}, timeline ${timeline} → ${newTimeline}; ${writes.length} writes sent to ${old.name} after it woke, ${acknowledged.length} acknowledged (each on the new primary), refused with: ${errors.join(" | ")}; ${old.name} rejoined as a replica`,
      struckAt,
      newPrimaryAt: promoted.at,
    };
  }

  // SIGKILL of the etcd member that leads the raft group, then restarted.
  async function killEtcd() {
    const victim = await waitFor(() => stack.etcdLeader(), {
      what: "an etcd leader",
      timeoutMs: 30_000,
    });
    const struckAt = performance.now();
    await stack.killEtcd(victim);
    probeGranting();
    const next = await waitFor(
      async () => {
        const now = await stack.etcdLeader();
        return now !== undefined && now !== victim ? now : undefined;
      },
      { what: "another etcd leader", timeoutMs: 60_000, intervalMs: 100 },
    );
    const electedMs = Math.round(performance.now() - struckAt);
    await stack.startEtcd(victim);
    await waitFor(() => stack.etcdHealthy(victim), {
      what: `${victim.name} to rejoin`,
      timeoutMs: 60_000,
      intervalMs: 250,
    });
    return {
      detail: `${victim.name} (the etcd leader) killed; ${next.name} leads after ${electedMs} ms; ${victim.name} restarted and healthy`,
      struckAt,
    };
  }

  // HAProxy stopped and started again: every database connection is cut.
  async function restartHaproxy() {
    const struckAt = performance.now();
    const [{ restartedAt } = { restartedAt: "" }] = await admin<{ restartedAt: string }[]>`
      SELECT clock_timestamp()::text AS "restartedAt"`;
    await stack.restartHaproxy();
    probeGranting();
    // Every lease server's connection now is one opened after the restart.
    const fresh = await waitFor(
      async () => {
        try {
          const rows = await admin<{ old: number; total: number }[]>`
            SELECT count(*) FILTER (WHERE backend_start < ${restartedAt}::timestamptz)::int AS old,
                   count(*)::int AS total
            FROM pg_stat_activity WHERE usename = 'leasehold' AND pid <> pg_backend_pid()`;
          const row = rows[0];
          return row && row.old === 0 && row.total > 0 ? row.total : undefined;
        } catch {
          return undefined;
        }
      },
      { what: "every connection to be one opened after the restart", timeoutMs: 60_000 },
    );
    return { detail: `restarted; ${fresh} lease server connections, all opened anew`, struckAt };
  }

  const cycle: Fault[] = [
    {
      id: "postmaster",
      name: "SIGKILL primary's postmaster",
      expected: "failover to the synchronous standby; the old primary rejoins",
      inject: killPostmaster,
    },
    {
      id: "patroni",
      name: "SIGKILL primary's Patroni",
      expected: "failover after the ttl; Patroni restarted, the old primary rejoins",
      inject: killPatroni,
    },
    {
      id: "switchover",
      name: "patronictl switchover",
      expected: "the synchronous standby becomes primary; the old one rejoins",
      inject: switchover,
    },
    {
      id: "freeze",
      name: "primary frozen past the ttl",
      expected: "no write acknowledged that is not on the new primary; it rejoins",
      inject: freezePrimary,
    },
    {
      id: "etcd",
      name: "etcd leader killed and restarted",
      expected: "another etcd member leads; the killed one rejoins",
      inject: killEtcd,
    },
    {
      id: "haproxy",
      name: "HAProxy restarted",
      expected: "every connection replaced; every instance grants",
      inject: restartHaproxy,
    },
  ];

  // LEASEHOLD_HA_FAULTS=freeze,etcd runs only those kinds (to replay one).
  const only = process.env.LEASEHOLD_HA_FAULTS?.split(",").filter((id) => id !== "");
  const unknown = only?.filter((id) => !cycle.some((f) => f.id === id)) ?? [];
  if (unknown.length > 0) {
    throw new RangeError(
      `LEASEHOLD_HA_FAULTS names fault kinds among ${cycle.map((f) => f.id).join(", ")}, got ${unknown.join(", ")}`,
    );
  }
  const chosen = only ? cycle.filter((f) => only.includes(f.id)) : cycle;

  function shuffled(): Fault[] {
    const order = [...chosen];
    for (let i = order.length - 1; i > 0; i--) {
      const j = rng.int(0, i);
      [order[i], order[j]] = [order[j] as Fault, order[i] as Fault];
    }
    return order;
  }

  async function inject(fault: Fault) {
    // Before: a lease held across the fault, and every grant acknowledged so far.
    const heldKey = probeKey("kept");
    const held = await untilAvailable(() =>
      (clients[0] as LeaseClient).acquire({ key: heldKey, ttl: durationFromMs(600_000) }),
    );
    expect(held.acquired).toBe(true);
    const ackedBefore = [...grants];
    const highestBefore = ackedBefore.reduce(
      (max, g) => Math.max(max, g.token),
      Number(held.lease?.fencingToken ?? 0n),
    );
    const unavailableBefore = failedWith(workers, "Unavailable");
    const deadlineBefore = failedWith(workers, "DeadlineExceeded");
    faultUnderWay = fault.name;
    faultLeaderChanges = 0;
    granting = undefined;
    const report: FaultReport = {
      fault: fault.name,
      detail: "",
      killToEveryInstanceGrantingMs: 0,
      unavailableCalls: 0,
      deadlineCalls: 0,
      leaderChanges: 0,
      asserted: "ok",
    };
    try {
      const struck = await fault.inject();
      report.detail = struck.detail;
      if (struck.newPrimaryAt !== undefined) {
        report.killToNewPrimaryMs = Math.round(struck.newPrimaryAt - struck.struckAt);
      }
      // Every instance grants again; its tokens exceed every token before.
      const probed = grantingProbe();
      if (!probed) throw new Error(`${fault.name} did not probe the instances`);
      const { at, tokens } = await probed;
      report.killToEveryInstanceGrantingMs = Math.round(at - struck.struckAt);
      for (const token of tokens) {
        expect(
          Number(token),
          `S6: a token after the fault exceeds ${highestBefore}`,
        ).toBeGreaterThan(highestBefore);
      }
      // Every grant acknowledged before is read back: the held lease with
      // its token, and each client grant in lease_events.
      const kept = await untilAvailable(() =>
        (clients[1] as LeaseClient).get({ key: heldKey }, { timeoutMs: 5_000 }),
      );
      expect(kept.lease?.runId, "the lease held across the fault is still held").toBe(
        held.lease?.runId,
      );
      expect(kept.lease?.fencingToken).toBe(held.lease?.fencingToken);
      const recorded = await untilAnswered(
        () =>
          admin<{ runId: string; token: string }[]>`
          SELECT run_id::text AS "runId", fencing_token::text AS token
          FROM lease_events WHERE account_id = ${accountId} AND type = 'acquired'`,
      );
      const seen = new Set(recorded.map((r) => `${r.runId}/${r.token}`));
      const missing = ackedBefore.filter((g) => !seen.has(`${g.runId}/${g.token}`));
      expect(missing, "every grant acknowledged before the fault is read back").toEqual([]);
      await untilAvailable(() =>
        (clients[2] as LeaseClient).release({ key: heldKey, runId: held.lease?.runId ?? "" }),
      );
      report.detail += `; ${ackedBefore.length} earlier grants read back; tokens after > ${highestBefore}`;
    } catch (error) {
      report.asserted = `FAILED: ${error instanceof Error ? error.message.split("\n")[0] : String(error)}`;
      throw error;
    } finally {
      report.unavailableCalls = failedWith(workers, "Unavailable") - unavailableBefore;
      report.deadlineCalls = failedWith(workers, "DeadlineExceeded") - deadlineBefore;
      report.leaderChanges = faultLeaderChanges;
      faultUnderWay = undefined;
      reports.push(report);
      log(
        `${fault.name}: ${report.asserted}; kill → new primary ${report.killToNewPrimaryMs ?? "–"} ms, kill → every instance granting ${report.killToEveryInstanceGrantingMs} ms, ${report.unavailableCalls} calls failed UNAVAILABLE, ${report.deadlineCalls} DEADLINE_EXCEEDED; ${report.detail}`,
      );
      // Plain load for a while before the next fault.
      await sleep(rng.int(2 * ttlMs, 4 * ttlMs));
    }
  }

  it("the stack is up: one primary, two replicas streaming, one synchronously", async () => {
    const listed = JSON.parse(await stack.patronictl(["list", "-f", "json"])) as {
      Member: string;
      Role: string;
      State: string;
    }[];
    expect(listed.map((m) => m.Role).sort()).toEqual(["Leader", "Replica", "Sync Standby"]);
    await untilAnswered(
      () =>
        admin`CREATE TABLE IF NOT EXISTS ha_probe_writes (id text PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())`,
    );
  });

  for (const fault of shuffled()) {
    it(`fault: ${fault.name} — ${fault.expected}`, () => inject(fault), 600_000);
  }

  if (soak) {
    const timeBoundMs = (bounds.minutes ?? soakCapMinutes) * 60_000;
    const reachedTarget = () =>
      bounds.operations !== undefined && operationsOf(workers).total >= bounds.operations;
    const timeUp = () => performance.now() - startedAt >= timeBoundMs;
    it(
      "soak: the fault cycle repeats until its bound, each fault's outcome asserted",
      async () => {
        cycling: while (!reachedTarget() && !timeUp()) {
          cycles += 1;
          const before = operationsOf(workers).total;
          for (const fault of shuffled()) {
            await inject(fault).catch((error: unknown) => {
              throw new Error(`fault "${fault.name}" in cycle ${cycles}`, { cause: error });
            });
            if (reachedTarget() || timeUp()) break cycling;
          }
          log(`soak cycle ${cycles}: ${operationsOf(workers).total} operations`);
          expect(operationsOf(workers).total, `operations during cycle ${cycles}`).toBeGreaterThan(
            before,
          );
        }
      },
      timeBoundMs + 1_200_000,
    );
  }

  it("the clients finish; their history and lease_events go through the checker", async () => {
    await sleep(2 * ttlMs);
    for (const w of workers) w.child.stdin?.end();
    exitCodes = await Promise.all(workers.map((w) => w.exited));
    // A client that died is reported by the test after this one; the
    // history it wrote until then is checked with the others'.
    const rows = await untilAnswered(
      () => admin<
        {
          id: string;
          type: string;
          sessionId: string;
          runId: string | null;
          token: string | null;
          atUs: string;
        }[]
      >`
      SELECT id::text, type, session_id AS "sessionId", run_id::text AS "runId",
             fencing_token::text AS token, (extract(epoch FROM at) * 1000000)::bigint::text AS "atUs"
      FROM lease_events WHERE account_id = ${accountId} ORDER BY id`,
    );
    const events: LeaseEvent[] = rows.map((r) => ({
      id: Number(r.id),
      type: r.type,
      key: `${accountId}/${r.sessionId}`,
      runId: r.runId ?? "",
      token: Number(r.token ?? 0),
      atUs: Number(r.atUs),
    }));
    for (const e of events)
      history.out.write(`${JSON.stringify({ ...e, type: `event:${e.type}` })}\n`);
    history.out.end();
    await once(history.out, "close");
    const checked = checkOperations(history.events, events);
    result = checked;
    // Every invariant, so a clean run says 0 for each rather than nothing.
    const byInvariant: Record<string, number> = Object.fromEntries(
      invariantChecks.map(([i]) => [i, 0]),
    );
    for (const v of checked.violations)
      byInvariant[v.invariant] = (byInvariant[v.invariant] ?? 0) + 1;
    const operations = operationsOf(workers);
    let writesAccepted = 0;
    for (const r of recordsFromHistory(history.events))
      if (r.type === "write" && r.accepted === true) writesAccepted += 1;
    const historyOperations = countOperations(history.events);
    const summary = {
      seed,
      soak,
      cycles,
      durationS: Math.round((performance.now() - startedAt) / 1000),
      clients: clientCount,
      operations: operations.total,
      operationsByKind: operations.byKind,
      historyEvents: history.events.length,
      historyOperations,
      getsChecked: checked.getsChecked,
      grants: grants.length,
      auditEvents: events.length,
      writesAccepted,
      faults: reports,
      faultsFailed: reports.filter((r) => r.asserted !== "ok").length,
      automaticFailovers,
      clientExitCodes: exitCodes,
      violationsByInvariant: byInvariant,
      keeperRules: { ...checked.keepers, violations: checked.keepers.violations.length },
      violationList: checked.violations,
    };
    const dir = path.join(repoRoot, "test-results");
    await writeFile(path.join(dir, "ha-summary.json"), `${JSON.stringify(summary, null, 2)}\n`);
    const table = [
      "| fault | kill → new primary | kill → every instance granting | calls failed UNAVAILABLE | DEADLINE_EXCEEDED | leader changes | asserted |",
      "| --- | --- | --- | --- | --- | --- | --- |",
      ...reports.map(
        (r) =>
          `| ${r.fault} | ${r.killToNewPrimaryMs ?? "–"} ms | ${r.killToEveryInstanceGrantingMs} ms | ${r.unavailableCalls} | ${r.deadlineCalls} | ${r.leaderChanges} | ${r.asserted} |`,
      ),
    ].join("\n");
    await writeFile(path.join(dir, "ha-summary.md"), `${table}\n`);
    log(
      `\n${table}\n\nseed ${seed}, ${summary.durationS} s, ${operations.total} operations, ${grants.length} grants, history operations ${JSON.stringify(historyOperations)}, ${checked.getsChecked} Gets checked, ${writesAccepted} guarded writes accepted, keeper and election rules ${JSON.stringify({ ...checked.keepers, violations: checked.keepers.violations.length })}, ${automaticFailovers.length} automatic failovers, violations ${JSON.stringify(byInvariant)}`,
    );
    expect(grants.length, "the clients were granted leases").toBeGreaterThan(0);
    expect(writesAccepted, "the clients wrote to the guarded store").toBeGreaterThan(0);
  }, 300_000);

  it("every client finished its run (exit 0)", () => {
    expect(exitCodes, "the clients' exit codes").toEqual(workers.map(() => 0));
  });

  const invariantChecks: [Invariant, string][] = [
    ["S1", "one holder: no run is granted a key inside another run's held interval"],
    ["S4", "no resurrection: no renewal is confirmed after its grant ended"],
    ["S5", "owner-checked release: a lease ends as released only when its own run asked"],
    ["S6", "monotonic fencing: per key, tokens strictly increase in grant order"],
    ["S7", "fenced writes: no accepted write carries a lower token than one accepted before it"],
    ["L2", "stop on loss: every run stopped its work before its last confirmed deadline"],
    [
      "K1",
      "keepers: no keeper is renewed nor granted a lease after its end; no keeper run writes after its keeper's deadline unless paused",
    ],
    [
      "K2",
      "lock-delay: a key whose keeper lease expired is granted to no other run before the delay passed",
    ],
    [
      "E1",
      "one leader: per election, leadership intervals do not overlap and terms strictly increase",
    ],
    ["audit", "every grant a client saw is in lease_events exactly once, with its token and time"],
    ["get", "reads: no Get shows a token older than one granted and answered before the Get began"],
    [
      "history",
      "the history is well formed: a process does one operation at a time, none after an info",
    ],
  ];
  for (const [invariant, rule] of invariantChecks) {
    it(`${invariant}: ${rule}`, () => {
      if (!result) throw new Error("the history was not collected: see the test before");
      const broken = result.violations.filter((v) => v.invariant === invariant);
      expect(
        broken.map((v) => `${v.key}: ${v.message}`),
        `${invariant} violations (test-results/ha-summary.json lists them all)`,
      ).toEqual([]);
    });
  }
});
