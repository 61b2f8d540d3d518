// The scale check (npm run test:scale, in .ci/run): 10,000 leases of one
// account kept alive on 100 KeepAlive streams for one renewal interval,
// with a burst of acquire→release cycles of the same account meanwhile, on a
// server process of its own and a database as young as the benchmark's (no
// statistics yet). Every renewal must be answered with its lease and no
// stream may end with an error; every cycle must be granted and released.
// It fails on errors, never on timings: the one bound is each lease's TTL,
// past which an answer is worth nothing to its client (L2).
//
// Issue 33: with bea8ba2's guard planned onto the open-leases-by-account
// index, every renewal probe read all 10,000 leases, the renewal statements
// ran into statement_timeout and every stream ended with DEADLINE_EXCEEDED;
// no test renewed more than a thousand leases, so CI stayed green.

import { ConnectError } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import type { KeepAliveResponse } from "../../src/gen/leasehold/v1/lease_pb.js";
import { useTestDatabase } from "../support/fixture.js";
import { grpcClient } from "../support/server.js";
import { type KeepAliveInit, ms, Pushable, StreamReader } from "../support/streams.js";

const { db, spawnServer } = useTestDatabase();

const leases = 10_000;
const streams = 100;
const account = "scale";
// Renewals are sent spread over one interval, each lease once; the TTL is
// three intervals, as a client renewing at a third of its TTL would have.
const intervalMs = 3_000;
const ttlMs = 3 * intervalMs;
const cycles = { callers: 16, each: 25 };

async function inPool(count: number, concurrency: number, work: (i: number) => Promise<void>) {
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.min(concurrency, count) }, async () => {
      while (next < count) await work(next++);
    }),
  );
}

describe("scale: KeepAlive at 10,000 leases, with acquire→release cycles", () => {
  it("S4, L2: every renewal of one interval is answered with its lease, no stream ends with an error, every cycle is granted and released", async () => {
    // A young database: autovacuum has not analyzed leases yet, as in the
    // benchmark (it would within a minute, and hide a plan that depends on it).
    await db.sql`ALTER TABLE leases SET (autovacuum_enabled = off)`;
    // All leases are one account's: the per-account quota (10,000) is not checked here.
    const server = await spawnServer(["--max-leases-per-account", "0"]);
    // Streams spread over a few HTTP/2 connections, as a fleet of clients would.
    const clients = Array.from({ length: 4 }, () => grpcClient(server.url));

    const runIds: string[] = new Array(leases);
    await inPool(leases, 64, async (i) => {
      const a = await (clients[i % clients.length] as (typeof clients)[number]).acquire({
        key: { accountId: account, sessionId: `s${i}` },
        ttl: ms(120_000),
        holder: "scale",
      });
      if (!a.acquired || !a.lease) throw new Error(`setup could not acquire s${i}`);
      runIds[i] = a.lease.runId;
    });

    const requests = Array.from({ length: streams }, () => new Pushable<KeepAliveInit>());
    const readers = requests.map(
      (r, s) =>
        new StreamReader<KeepAliveResponse>(
          (clients[s % clients.length] as (typeof clients)[number]).keepAlive(r),
        ),
    );
    const indexOf = new Map(runIds.map((runId, i) => [runId, i]));
    const answered = new Uint8Array(leases);
    let answers = 0;
    const wrong: string[] = [];
    let allAnswered: () => void = () => {};
    const done = new Promise<void>((resolve) => {
      allAnswered = resolve;
    });
    // Each answer as it arrives (the readers keep them too).
    const watching = readers.map(async (reader) => {
      for (;;) {
        let m: KeepAliveResponse;
        try {
          m = await reader.next(() => true, ttlMs * 2);
        } catch {
          return;
        }
        const i = indexOf.get(m.runId);
        if (i === undefined || m.result.case !== "lease") {
          wrong.push(`${m.key?.sessionId}: ${m.result.case}`);
          continue;
        }
        if (answered[i] === 0) {
          answered[i] = 1;
          answers++;
          if (answers === leases) allAnswered();
        }
      }
    });

    // Acquire→release cycles of fresh sessions of the same account, while
    // the renewals go on (Release probes by key with the same guard).
    const cycling = inPool(cycles.callers * cycles.each, cycles.callers, async (n) => {
      const key = { accountId: account, sessionId: `cycle-${n}` };
      const client = clients[n % clients.length] as (typeof clients)[number];
      const a = await client.acquire({ key, ttl: ms(ttlMs) });
      if (!a.acquired || !a.lease) throw new Error(`cycle ${n} was not granted`);
      const r = await client.release({ key, runId: a.lease.runId });
      if (!r.released) throw new Error(`cycle ${n} was not released`);
    });

    // One renewal interval: lease i is renewed at its own phase in it.
    const start = performance.now();
    let sent = 0;
    while (sent < leases) {
      const due = Math.min(leases, Math.ceil(((performance.now() - start) / intervalMs) * leases));
      for (; sent < due; sent++) {
        (requests[sent % streams] as Pushable<KeepAliveInit>).push({
          key: { accountId: account, sessionId: `s${sent}` },
          runId: runIds[sent],
          ttl: ms(ttlMs),
        });
      }
      await new Promise((r) => setTimeout(r, 10));
    }
    await cycling;

    // Every renewal answered before the last one's lease would have run out;
    // a stream that ends stops the wait at once.
    const ended = Promise.race(readers.map((r) => r.finished));
    const outcome = await Promise.race([
      done.then(() => "answered"),
      ended.then(() => "a stream ended"),
      new Promise((r) => setTimeout(r, ttlMs)).then(() => "lease deadline passed"),
    ]);
    const streamErrors = readers.flatMap((r, s) =>
      r.done ? [`stream ${s}: ${r.error ? ConnectError.from(r.error).message : "ended"}`] : [],
    );
    expect(streamErrors, "streams that ended").toEqual([]);
    expect(wrong, "answers other than the renewed lease").toEqual([]);
    expect({ outcome, answers }).toEqual({ outcome: "answered", answers: leases });

    for (const r of requests) r.end();
    await Promise.all(readers.map((r) => r.finished));
    await Promise.all(watching);
    const endedWith = readers.map((r) => r.error?.code).filter((c) => c !== undefined);
    expect(endedWith, "streams that ended with an error after their last request").toEqual([]);
  });
});
