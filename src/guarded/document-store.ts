// All SQL of the guarded store's documents. A write runs the fence check
// and the document upsert in one transaction (S7), so the token that passed
// the check is the token recorded with the value.

import { ResourceExhaustedError } from "../lease/errors.js";
import type { SessionKey } from "../lease/types.js";
import { classifyDatabaseError } from "../postgres/database-errors.js";
import type { Sql } from "../postgres/pool.js";
import { LimitName } from "../protocol/errors.js";
import { fence, highestToken } from "./fence.js";

/** A document as stored, without its value; times in microseconds since the epoch. */
export interface DocumentRecord {
  accountId: string;
  sessionId: string;
  name: string;
  /** The token of the run that wrote this version. */
  fencingToken: bigint;
  size: bigint;
  updatedAtUs: bigint;
}

export interface DocumentStore {
  /**
   * Writes a document if `token` passes the session's fence (S7), else throws
   * StaleFencingTokenError and writes nothing.
   */
  put(
    key: SessionKey,
    name: string,
    value: Uint8Array,
    token: bigint,
  ): Promise<{ document: DocumentRecord; highestToken: bigint }>;
  /** One document with its value, if it exists. */
  get(key: SessionKey, name: string): Promise<(DocumentRecord & { value: Uint8Array }) | undefined>;
  /** Every document of a session by name, and the highest token seen for it. */
  list(key: SessionKey): Promise<{ documents: DocumentRecord[]; highestToken: bigint }>;
  /** The highest token seen for a session (0: none), read without a lock. */
  highestToken(key: SessionKey): Promise<bigint>;
}

export interface DocumentLimits {
  /** Bounds List, which has no paging: a session is a handful of files, not a bucket. */
  maxDocumentsPerSession: number;
}

export function createDocumentStore(sql: Sql, limits: DocumentLimits): DocumentStore {
  const infoColumns = sql`
    account_id, session_id, name, fencing_token, octet_length(value)::bigint AS size,
    (extract(epoch FROM updated_at) * 1000000)::bigint AS updated_at_us`;

  const run = async <T>(statement: () => Promise<T>): Promise<T> => {
    try {
      return await statement();
    } catch (error) {
      throw classifyDatabaseError(error);
    }
  };

  return {
    put: (key, name, value, token) =>
      run(() =>
        sql.begin(async (tx) => {
          // S7: first the fence. It keeps the session's fence row locked
          // until commit, so no other writer of the session can check in
          // between this check and this write.
          const highest = await fence(tx, key, token);
          // Counted under that lock, so concurrent writers of new names
          // cannot all slip under the limit.
          const [counted] = await tx<{ others: bigint; exists: boolean }[]>`
            SELECT count(*) FILTER (WHERE name <> ${name}) AS others,
                   bool_or(name = ${name}) AS exists
            FROM guarded_documents
            WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
          if (!counted?.exists && (counted?.others ?? 0n) >= limits.maxDocumentsPerSession) {
            throw new ResourceExhaustedError(
              `a session holds at most ${limits.maxDocumentsPerSession} documents`,
              LimitName.documentsPerSession,
              limits.maxDocumentsPerSession,
            );
          }
          const [document] = await tx<DocumentRecord[]>`
            INSERT INTO guarded_documents AS d
              (account_id, session_id, name, value, fencing_token, updated_at)
            VALUES (${key.accountId}, ${key.sessionId}, ${name}, ${value}, ${token},
                    clock_timestamp())
            ON CONFLICT (account_id, session_id, name) DO UPDATE SET
              value = EXCLUDED.value,
              fencing_token = EXCLUDED.fencing_token,
              updated_at = EXCLUDED.updated_at
            RETURNING ${infoColumns}`;
          if (!document) throw new Error("document upsert returned no row");
          return { document, highestToken: highest };
        }),
      ),

    get: (key, name) =>
      run(async () => {
        const rows = await sql<(DocumentRecord & { value: Uint8Array })[]>`
          SELECT ${infoColumns}, value FROM guarded_documents
          WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
            AND name = ${name}`;
        return rows[0];
      }),

    list: (key) =>
      run(() =>
        // One snapshot, so the highest token and the documents agree.
        sql.begin("isolation level repeatable read read only", async (tx) => {
          const documents = await tx<DocumentRecord[]>`
            SELECT ${infoColumns} FROM guarded_documents
            WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
            ORDER BY name`;
          return { documents: [...documents], highestToken: await highestToken(tx, key) };
        }),
      ),

    highestToken: (key) => highestToken(sql, key),
  };
}
