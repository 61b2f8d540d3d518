// The fence check of a PostgreSQL-backed resource (S7): the SQL function
// `leasehold_fence` and its TypeScript wrapper, on a real database with
// concurrent transactions on independent connections.

import { randomUUID } from "node:crypto";
import fc from "fast-check";
import { beforeAll, describe, expect, it } from "vitest";
import { fence, highestToken, type Transaction } from "../../src/guarded/fence.js";
import { InvalidArgumentError, StaleFencingTokenError } from "../../src/lease/errors.js";
import type { Sql } from "../../src/postgres/pool.js";
import { useTestDatabase } from "../support/fixture.js";
import { waitFor } from "../support/wait.js";

const { db } = useTestDatabase();

beforeAll(async () => {
  // The resource's own data: one row per accepted write, in commit order.
  await db.sql`
    CREATE TABLE resource_writes (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      account_id text NOT NULL,
      session_id text NOT NULL,
      token bigint NOT NULL
    )`;
});

const newKey = () => ({ accountId: "acct", sessionId: `s-${randomUUID()}` });

/** One guarded write: the fence check, then the resource's write, in one transaction. */
async function guardedWrite(
  sql: Sql,
  key: { accountId: string; sessionId: string },
  token: bigint,
  beforeWrite?: (tx: Transaction) => Promise<void>,
): Promise<bigint> {
  return sql.begin(async (tx) => {
    const highest = await fence(tx, key, token);
    await beforeWrite?.(tx);
    await tx`INSERT INTO resource_writes (account_id, session_id, token)
             VALUES (${key.accountId}, ${key.sessionId}, ${token})`;
    return highest;
  }) as Promise<bigint>;
}

async function writes(key: { accountId: string; sessionId: string }): Promise<bigint[]> {
  const rows = await db.sql<{ token: bigint }[]>`
    SELECT token FROM resource_writes
    WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId} ORDER BY id`;
  return rows.map((r) => r.token);
}

async function rejection(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    () => expect.fail("expected a rejection"),
    (error: unknown) => error,
  );
}

describe("leasehold_fence", () => {
  it("S7: a resource that has never seen a key accepts its first token", async () => {
    const key = newKey();
    expect(await highestToken(db.sql, key)).toBe(0n);
    expect(await guardedWrite(db.sql, key, 41n)).toBe(41n);
    expect(await highestToken(db.sql, key)).toBe(41n);
    expect(await writes(key)).toEqual([41n]);
  });

  it("S7: the same token passes again (one run writes many times) and a higher one advances", async () => {
    const key = newKey();
    await guardedWrite(db.sql, key, 5n);
    expect(await guardedWrite(db.sql, key, 5n)).toBe(5n);
    expect(await guardedWrite(db.sql, key, 9n)).toBe(9n);
    expect(await writes(key)).toEqual([5n, 5n, 9n]);
  });

  it("S7: a lower token is refused with the highest seen, and its transaction's write is undone", async () => {
    const key = newKey();
    await guardedWrite(db.sql, key, 7n);
    const error = await rejection(guardedWrite(db.sql, key, 6n));
    expect(error).toBeInstanceOf(StaleFencingTokenError);
    expect(error).toMatchObject({ presented: 6n, highest: 7n });
    expect(await writes(key)).toEqual([7n]);
    expect(await highestToken(db.sql, key)).toBe(7n);
  });

  it("S7: a refused token leaves the transaction unable to commit, even if the caller ignores the error", async () => {
    const key = newKey();
    await guardedWrite(db.sql, key, 3n);
    const error = await rejection(
      db.sql.begin(async (tx) => {
        await fence(tx, key, 2n).catch(() => undefined);
        await tx`INSERT INTO resource_writes (account_id, session_id, token)
                 VALUES (${key.accountId}, ${key.sessionId}, 2)`;
      }),
    );
    // The failed fence statement aborted the transaction: the INSERT after it
    // could not run (25P02) and the commit reports the refusal.
    expect(error).toMatchObject({ code: "LHF01" });
    expect(await writes(key)).toEqual([3n]);
  });

  it("S7: sessions are fenced independently", async () => {
    const a = newKey();
    const b = newKey();
    await guardedWrite(db.sql, a, 100n);
    expect(await guardedWrite(db.sql, b, 1n)).toBe(1n);
    expect(await highestToken(db.sql, a)).toBe(100n);
  });

  it("S7: the SQL function itself refuses a token ≤ 0 and NULL arguments", async () => {
    const key = newKey();
    for (const token of [0n, -1n]) {
      const error = await rejection(
        db.sql`SELECT leasehold_fence(${key.accountId}, ${key.sessionId}, ${token})`,
      );
      expect(error).toMatchObject({ code: "22023" });
    }
    const error = await rejection(db.sql`SELECT leasehold_fence(${key.accountId}, NULL, 1)`);
    expect(error).toMatchObject({ code: "22004" });
    expect(await highestToken(db.sql, key)).toBe(0n);
  });

  it("S7: the wrapper refuses a token ≤ 0 as invalid input before any SQL", async () => {
    const error = await rejection(db.sql.begin((tx) => fence(tx, newKey(), 0n)));
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect(error).toMatchObject({ field: "fencing_token" });
  });

  it("S7: the check is atomic with the write — a newer token waits until the older token's transaction ends", async () => {
    const key = newKey();
    const older = db.connect(1);
    const newer = db.connect(1);
    let releaseOlder: () => void = () => {};
    const olderMayWrite = new Promise<void>((resolve) => {
      releaseOlder = resolve;
    });
    let olderChecked: () => void = () => {};
    const olderHasChecked = new Promise<void>((resolve) => {
      olderChecked = resolve;
    });
    // Run A (token 10) passes the fence, then is slow to write.
    const a = guardedWrite(older, key, 10n, async () => {
      olderChecked();
      await olderMayWrite;
    });
    await olderHasChecked;
    // Run B (token 11) checks now: it must wait for A's transaction instead
    // of slipping its write in between A's check and A's write.
    const [{ pid }] = (await newer`SELECT pg_backend_pid() AS pid`) as unknown as [{ pid: number }];
    const b = guardedWrite(newer, key, 11n);
    const first = await Promise.race([
      waitUntilBlockedOnLock(pid).then(() => "B waits for A"),
      b.then(() => "B wrote while A was between its check and its write"),
    ]);
    releaseOlder();
    expect(first).toBe("B waits for A");
    expect(await a).toBe(10n);
    expect(await b).toBe(11n);
    // Without the lock A's late write would land after B's and win.
    expect(await writes(key)).toEqual([10n, 11n]);
  });

  it("S7: under concurrent writers with random tokens, accepted writes commit in token order", async () => {
    const key = newKey();
    const pools = Array.from({ length: 8 }, () => db.connect(1));
    const tokens = Array.from({ length: 200 }, () => BigInt(1 + Math.floor(Math.random() * 60)));
    const outcomes = await Promise.all(
      pools.map(async (pool, p) => {
        const mine = tokens.filter((_, i) => i % pools.length === p);
        const accepted: bigint[] = [];
        let refused = 0;
        for (const token of mine) {
          try {
            await guardedWrite(pool, key, token);
            accepted.push(token);
          } catch (error) {
            if (!(error instanceof StaleFencingTokenError)) throw error;
            expect(error.highest).toBeGreaterThan(token);
            refused++;
          }
        }
        return { accepted, refused };
      }),
    );
    const log = await writes(key);
    expect(log.length).toBe(outcomes.reduce((n, o) => n + o.accepted.length, 0));
    expect(log.length + outcomes.reduce((n, o) => n + o.refused, 0)).toBe(tokens.length);
    for (let i = 1; i < log.length; i++) {
      expect(log[i] as bigint).toBeGreaterThanOrEqual(log[i - 1] as bigint);
    }
    expect(await highestToken(db.sql, key)).toBe(log.at(-1));
  });

  it("S7 (property): a token is accepted exactly when it is ≥ every token accepted before", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.bigInt({ min: 1n, max: 30n }), { minLength: 1, maxLength: 25 }),
        async (sequence) => {
          const key = newKey();
          let model = 0n;
          for (const token of sequence) {
            const outcome = await guardedWrite(db.sql, key, token).then(
              (highest) => ({ accepted: true, highest }),
              (error: unknown) => {
                if (!(error instanceof StaleFencingTokenError)) throw error;
                return { accepted: false, highest: error.highest };
              },
            );
            expect(outcome.accepted).toBe(token >= model);
            if (outcome.accepted) model = token;
            expect(outcome.highest).toBe(model);
          }
          expect(await writes(key)).toEqual(sequence.filter((t, i) => t >= max(sequence, i)));
        },
      ),
      { numRuns: 40 },
    );
  });
});

// The highest of the tokens before index i (0 when none).
function max(tokens: bigint[], i: number): bigint {
  let highest = 0n;
  for (const t of tokens.slice(0, i)) if (t > highest) highest = t;
  return highest;
}

// Waits on the database's own view of the backend, not on a guessed sleep.
async function waitUntilBlockedOnLock(pid: number): Promise<void> {
  await waitFor(
    async () => {
      const rows = await db.sql<{ waitEventType: string | null }[]>`
        SELECT wait_event_type FROM pg_stat_activity WHERE pid = ${pid}`;
      return rows[0]?.waitEventType === "Lock";
    },
    { what: `backend ${pid} to wait on a lock`, intervalMs: 5 },
  );
}
