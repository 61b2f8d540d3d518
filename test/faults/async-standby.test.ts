// The documented negative of DESIGN §8: a failover to an ASYNCHRONOUS
// standby can forget grants that clients were told about and rewind the
// fencing-token sequence, which breaks S1 (the forgotten holder still runs
// while the key is granted again) and S6 (the new grant's token is not
// larger than the old one's: it reuses a token already handed out).
//
// The standby's lag is made deterministic, not left to timing: it is
// stopped (fast shutdown) before the grants, so it has none of them. A
// standby that lags for any other reason (a slow disk, a partition, a
// busy replay) loses the same way, only fewer commits.
//
// PostgreSQL WAL-logs a sequence 32 values ahead of its last value
// (SEQ_LOG_VALS), so a standby knows values up to 32 past the last one it
// saw used; the test draws more than that while the standby is away, so
// the promoted standby hands out values the lost grants already had.

import { Code, ConnectError } from "@connectrpc/connect";
import postgres from "postgres";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { durationFromMs } from "../../src/client/index.js";
import { allMigrationSets, migrate } from "../../src/postgres/migrate.js";
import { grpcClient, type ServerProcess, spawnServer } from "../support/server.js";
import {
  type PrimaryEndpoint,
  type ReplicatedDatabase,
  startPrimaryEndpoint,
  startReplicatedDatabase,
} from "./replication.js";

const databaseName = "leasehold_async";
const account = "async-standby";

/** Retries while the server answers UNAVAILABLE (no writable database yet), up to a bound. */
async function untilAvailable<T>(call: () => Promise<T>, boundMs = 30_000): Promise<T> {
  const giveUpAt = performance.now() + boundMs;
  for (;;) {
    try {
      return await call();
    } catch (error) {
      if (ConnectError.from(error).code !== Code.Unavailable || performance.now() > giveUpAt) {
        throw error;
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

describe("failover to an asynchronous standby (what synchronous replication prevents)", () => {
  let database: ReplicatedDatabase;
  let server: ServerProcess;
  let endpoint: PrimaryEndpoint | undefined;

  beforeAll(async () => {
    database = await startReplicatedDatabase({ synchronous: false });
    const admin = postgres(database.directUrlFor("postgres"), { max: 1, onnotice: () => {} });
    await admin.unsafe(`CREATE DATABASE ${databaseName}`);
    await admin.end();
    endpoint = await startPrimaryEndpoint(database);
    const url = endpoint.urlFor(databaseName);
    await migrate(url, allMigrationSets);
    server = await spawnServer(url);
  });

  afterAll(async () => {
    await server?.stop();
    await endpoint?.close();
    await database?.close();
  });

  it("S1 and S6 break: a grant the primary acknowledged is lost, and its token is handed out again", async () => {
    const client = grpcClient(server.url);
    const key = (sessionId: string) => ({ accountId: account, sessionId });
    const ttl = durationFromMs(600_000);

    // A grant the standby has replayed: where the sequence stood for it.
    const seen = await client.acquire({ key: key("seen"), ttl });
    expect(seen.acquired).toBe(true);
    await database.waitForStandbyReplay();
    await database.stopStandby();

    // Acknowledged by the primary alone: asynchronous commit does not wait.
    const acknowledged: bigint[] = [];
    for (let i = 0; i < 40; i++) {
      const granted = await client.acquire({ key: key(`lost-${i}`), ttl });
      expect(granted.acquired).toBe(true);
      acknowledged.push(granted.lease?.fencingToken ?? 0n);
    }
    const victim = await client.acquire({ key: key("victim"), ttl, holder: "desktop" });
    expect(victim.acquired, "the primary grants and answers").toBe(true);
    const victimToken = victim.lease?.fencingToken ?? 0n;
    acknowledged.push(victimToken);

    await database.killPrimary();
    await database.startStandby();
    await database.promoteStandby();
    endpoint?.follow();

    // The server follows the endpoint to the promoted standby…
    const after = await untilAvailable(() => client.get({ key: key("victim") }));
    // …which never heard of the grant the desktop holds for ten minutes.
    expect(after.held, "the acknowledged grant is missing on the new primary").toBe(false);
    for (let i = 0; i < 40; i++) {
      const gone = await client.get({ key: key(`lost-${i}`) });
      expect(gone.held, `acknowledged grant lost-${i} is missing too`).toBe(false);
    }

    // S1 broken: the key is granted to another run while the desktop's lease runs.
    const rival = await client.acquire({ key: key("victim"), ttl, holder: "browser" });
    expect(rival.acquired, "a second holder is granted the key").toBe(true);
    const rivalToken = rival.lease?.fencingToken ?? 0n;
    // S6 broken: the sequence was rewound, so the later grant's token is not larger…
    expect(rivalToken <= victimToken, `token ${rivalToken} after ${victimToken}`).toBe(true);
    // …and it is one a lost grant already carries: a fenced resource that saw
    // the desktop's writes refuses the browser, or accepts both.
    expect(acknowledged, "the new token was handed out before the failover").toContain(rivalToken);
    expect(rivalToken > (seen.lease?.fencingToken ?? 0n)).toBe(true);
  });
});
