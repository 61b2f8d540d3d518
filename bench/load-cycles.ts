// Load generator for acquire → release cycles (scenario 1 and its etcd
// peer). `concurrency` workers each loop: pick one of `keys` keys at random,
// acquire it with a fresh run id, release it. A key another worker holds is a
// "contended" attempt, counted apart and not released. Run by bench/run.ts as
// its own process; see load-protocol.ts.

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { createClient } from "@connectrpc/connect";
import { Etcd3 } from "etcd3";
import postgres from "postgres";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { createLeaseClient } from "../src/client/index.js";
import { LeaseService, SessionKeySchema } from "../src/gen/leasehold/v1/lease_pb.js";
import { openDatabase } from "../src/postgres/pool.js";
import { createLeaseStore } from "../src/server/db/lease-store.js";
import { Latency, type LatencySummary } from "./latency.js";
import { loadOptions, MeasuredWindow, send, type WindowTiming } from "./load-protocol.js";

export type CycleTarget =
  /** LeaseService over gRPC (Connect client, HTTP/2), to one or more servers. */
  | { kind: "service"; urls: string[] }
  /** The seed's two statements, sent with postgres.js: the raw-SQL limit. */
  | { kind: "sql"; databaseUrl: string }
  /** Leasehold's own store SQL, sent from this process: the service minus RPC. */
  | { kind: "store"; databaseUrl: string }
  /** etcd: lease grant, put-if-absent txn, owner-checked delete txn, revoke. */
  | { kind: "etcd"; url: string }
  /** Acquire and Release on one keeper's Keep stream (the client library's keeper.acquire/release). */
  | { kind: "keeper"; urls: string[] };

export interface CycleOptions extends WindowTiming {
  target: CycleTarget;
  concurrency: number;
  keys: number;
  ttlSeconds: number;
  /** Keeps runs apart when they share a table. */
  accountId: string;
}

export interface CycleResult {
  cycles: number;
  contended: number;
  errors: number;
  firstError?: string;
  seconds: number;
  cyclesPerSec: number;
  contendedPerSec: number;
  /** Acquire sent → release answered. */
  cycle: LatencySummary;
  /** Acquire sent → acquire answered (grant + txn for etcd). */
  acquire: LatencySummary;
  loadCpuCores: number;
}

interface LockClient {
  /** True when granted. */
  acquire(sessionId: string, runId: string): Promise<Granted | undefined>;
  release(sessionId: string, granted: Granted): Promise<void>;
  close(): Promise<void>;
}

interface Granted {
  runId: string;
  /** etcd: the lease id and the revision of the put (its fencing token). */
  leaseId?: string;
  revision?: string;
}

async function connect(options: CycleOptions): Promise<LockClient> {
  const { target, ttlSeconds, accountId } = options;
  switch (target.kind) {
    case "service": {
      // One HTTP/2 connection per server, shared by all workers, as a
      // process embedding the client would have.
      const clients = target.urls.map((baseUrl) =>
        createClient(LeaseService, createGrpcTransport({ baseUrl })),
      );
      let next = 0;
      const pick = () => clients[next++ % clients.length] as (typeof clients)[number];
      const ttl = { seconds: BigInt(ttlSeconds), nanos: 0 };
      return {
        acquire: async (sessionId, runId) => {
          const key = create(SessionKeySchema, { accountId, sessionId });
          const res = await pick().acquire({ key, runId, ttl, holder: "bench" });
          return res.acquired ? { runId } : undefined;
        },
        release: async (sessionId, granted) => {
          const key = create(SessionKeySchema, { accountId, sessionId });
          await pick().release({ key, runId: granted.runId });
        },
        close: async () => {},
      };
    }
    case "sql": {
      const sql = postgres(target.databaseUrl, {
        max: options.concurrency,
        onnotice: () => {},
      });
      return {
        // The seed's conditional UPSERT, unchanged but for bind syntax.
        acquire: async (sessionId, runId) => {
          const rows = await sql`
            WITH lease_clock AS (
              SELECT clock_timestamp() AS observed_at
            )
            INSERT INTO demo_session_lease AS held (
              account_id, session_id, run_id, expires_at
            )
            SELECT ${accountId}, ${sessionId}, ${runId},
                   observed_at + make_interval(secs => ${ttlSeconds})
            FROM lease_clock
            ON CONFLICT (account_id, session_id) DO UPDATE
            SET run_id = EXCLUDED.run_id,
                expires_at = EXCLUDED.expires_at
            WHERE held.expires_at <= (SELECT observed_at FROM lease_clock)
            RETURNING run_id`;
          return rows.length > 0 ? { runId } : undefined;
        },
        // The seed's owner-checked release.
        release: async (sessionId, granted) => {
          await sql`
            DELETE FROM demo_session_lease
            WHERE account_id = ${accountId}
              AND session_id = ${sessionId}
              AND run_id = ${granted.runId}
            RETURNING run_id`;
        },
        close: () => sql.end({ timeout: 1 }),
      };
    }
    case "store": {
      const sql = openDatabase({
        url: target.databaseUrl,
        maxConnections: options.concurrency,
        statementTimeoutMs: 5_000,
        lockTimeoutMs: 1_000,
        idleInTransactionTimeoutMs: 10_000,
        applicationName: "leasehold-bench",
      });
      const store = createLeaseStore(sql);
      const ttlMs = ttlSeconds * 1000;
      return {
        acquire: async (sessionId, runId) => {
          const res = await store.acquire({ accountId, sessionId, runId, ttlMs, holder: "bench" });
          return res.acquired ? { runId } : undefined;
        },
        release: async (sessionId, granted) => {
          await store.release({ accountId, sessionId }, granted.runId);
        },
        close: () => sql.end({ timeout: 1 }),
      };
    }
    case "keeper": {
      // One keeper for the process: every worker's acquire and release ride
      // its one stream, as a process holding many leases would do.
      const client = createLeaseClient({ baseUrls: target.urls, protocol: "grpc" });
      const keeper = await client.openKeeper({
        accountId,
        ttlMs: ttlSeconds * 1000,
        holder: "bench",
      });
      return {
        acquire: async (sessionId, runId) => {
          const res = await keeper.acquire({ key: { accountId, sessionId }, runId });
          return res.acquired ? { runId } : undefined;
        },
        release: async (sessionId, granted) => {
          await keeper.release({ key: { accountId, sessionId }, runId: granted.runId });
        },
        close: async () => {
          await keeper.close();
          client.close();
        },
      };
    }
    case "etcd": {
      const client = new Etcd3({ hosts: target.url });
      const keyOf = (sessionId: string) => Buffer.from(`/leases/${accountId}/${sessionId}`);
      return {
        acquire: async (sessionId, runId) => {
          const { ID } = await client.leaseClient.leaseGrant({ TTL: ttlSeconds });
          const key = keyOf(sessionId);
          const txn = await client.kv.txn({
            compare: [{ key, target: "Create", result: "Equal", create_revision: 0 }],
            success: [{ request_put: { key, value: Buffer.from(runId), lease: ID } }],
          });
          if (txn.succeeded) return { runId, leaseId: ID, revision: txn.header.revision };
          await client.leaseClient.leaseRevoke({ ID });
          return undefined;
        },
        // Owner-checked like the others: delete only the key this run put.
        release: async (sessionId, granted) => {
          const key = keyOf(sessionId);
          await client.kv.txn({
            compare: [{ key, target: "Mod", result: "Equal", mod_revision: granted.revision }],
            success: [{ request_delete_range: { key } }],
          });
          await client.leaseClient.leaseRevoke({ ID: granted.leaseId });
        },
        close: async () => client.close(),
      };
    }
  }
}

async function main(): Promise<void> {
  const options = loadOptions<CycleOptions>();
  const client = await connect(options);
  const sessions = Array.from({ length: options.keys }, (_, i) => `session-${i}`);
  const cycle = new Latency();
  const acquire = new Latency();
  let cycles = 0;
  let contended = 0;
  let errors = 0;
  let firstError: string | undefined;
  const window = new MeasuredWindow(options);

  const worker = async () => {
    while (!window.stopped) {
      const sessionId = sessions[Math.floor(Math.random() * sessions.length)] as string;
      const t0 = performance.now();
      try {
        const granted = await client.acquire(sessionId, randomUUID());
        const t1 = performance.now();
        if (!granted) {
          if (window.counts(t1)) contended++;
          continue;
        }
        await client.release(sessionId, granted);
        const t2 = performance.now();
        if (window.counts(t2)) {
          cycles++;
          cycle.record(t2 - t0);
          acquire.record(t1 - t0);
        }
      } catch (error) {
        errors++;
        firstError ??= String(error);
        // A failing target must not turn the loop into a busy spin.
        if (errors > 1000) throw error;
        await new Promise((r) => setTimeout(r, 10));
      }
    }
  };

  const workers = Array.from({ length: options.concurrency }, worker);
  await window.done;
  await Promise.all(workers);
  await client.close();
  const result: CycleResult = {
    cycles,
    contended,
    errors,
    firstError,
    seconds: window.seconds,
    cyclesPerSec: Math.round(cycles / window.seconds),
    contendedPerSec: Math.round((contended / window.seconds) * 10) / 10,
    cycle: cycle.summary(),
    acquire: acquire.summary(),
    loadCpuCores: Math.round(window.cpuCores * 100) / 100,
  };
  send({ phase: "result", result });
  // Pools and HTTP/2 sessions may hold timers; the result is out, so exit.
  process.exit(0);
}

await main();
