// The fence check for PostgreSQL-backed resources (DESIGN S7, §5): a thin
// wrapper over the `leasehold_fence` SQL function of migrations/fence/0001_fence.sql,
// so the TypeScript resources and those written in other languages run the
// very same statement.

import type postgres from "postgres";
import { InvalidArgumentError, StaleFencingTokenError } from "../lease/errors.js";
import type { SessionKey } from "../lease/types.js";
import { classifyDatabaseError } from "../postgres/database-errors.js";
import type { Sql } from "../postgres/pool.js";

/** A transaction of a pool opened by `openDatabase`. */
export type Transaction = postgres.TransactionSql<{ bigint: bigint }>;

/** The SQLSTATE `leasehold_fence` raises for a stale token; DETAIL holds the highest token. */
export const staleTokenSqlState = "LHF01";

/**
 * S7: accepts `token` for `key` if it is at least the highest token this
 * resource has seen for the key, records it, and returns the new highest.
 * Otherwise throws StaleFencingTokenError, leaving `tx` unable to commit.
 *
 * Call it inside the transaction that performs the guarded write, before the
 * write: the session's fence row stays locked until `tx` ends, which makes
 * the check and the write one atomic step for every writer of the session.
 */
export async function fence(tx: Transaction, key: SessionKey, token: bigint): Promise<bigint> {
  if (token <= 0n) {
    throw new InvalidArgumentError(
      "fencing_token",
      `must be a positive fencing token, got ${token}`,
    );
  }
  try {
    const rows = await tx<{ highest: bigint }[]>`
      SELECT leasehold_fence(${key.accountId}, ${key.sessionId}, ${token}) AS highest`;
    const highest = rows[0]?.highest;
    if (highest === undefined) throw new Error("leasehold_fence returned no row");
    return highest;
  } catch (error) {
    throw fenceError(error, token);
  }
}

/** The highest token this resource has seen for `key`; 0 when it has seen none. */
export async function highestToken(sql: Sql | Transaction, key: SessionKey): Promise<bigint> {
  try {
    const rows = await sql<{ highestToken: bigint }[]>`
      SELECT highest_token FROM leasehold_fences
      WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
    return rows[0]?.highestToken ?? 0n;
  } catch (error) {
    throw classifyDatabaseError(error);
  }
}

function fenceError(error: unknown, token: bigint): unknown {
  const { code, detail } = error as { code?: unknown; detail?: unknown };
  if (code === staleTokenSqlState && typeof detail === "string" && /^\d+$/.test(detail)) {
    return new StaleFencingTokenError(token, BigInt(detail));
  }
  return classifyDatabaseError(error);
}
