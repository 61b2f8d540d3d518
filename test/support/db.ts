// A fresh, migrated database per test file, cloned from the run's template.
// Databases are not dropped: an embedded run deletes its whole data folder at
// the end, and with DATABASE_URL a failed test's data stays for inspection.

import { randomBytes } from "node:crypto";
import postgres, { type TransactionSql } from "postgres";
import { inject } from "vitest";
import { openDatabase, type Sql } from "../../src/postgres/pool.js";
import { startTcpProxy, type TcpProxy } from "./tcp-proxy.js";

export interface TestDatabase {
  url: string;
  /** A pool like the server's (bigint, camelCase, timeouts). */
  sql: Sql;
  /** A pool with its own connections and the given size. */
  connect(max?: number, options?: { lockTimeoutMs?: number }): Sql;
  close(): Promise<void>;
}

export async function createTestDatabase(): Promise<TestDatabase> {
  const adminUrl = inject("adminUrl");
  const name = `leasehold_test_${randomBytes(6).toString("hex")}`;
  const admin = postgres(adminUrl, { max: 1, onnotice: () => {} });
  // CREATE DATABASE … TEMPLATE fails while another session is copying the
  // same template; test files start together, so retry that one error.
  for (let attempt = 0; ; attempt++) {
    try {
      await admin.unsafe(`CREATE DATABASE ${name} TEMPLATE ${inject("templateDatabase")}`);
      break;
    } catch (error) {
      if ((error as { code?: string }).code !== "55006" || attempt > 50) throw error;
      await new Promise((r) => setTimeout(r, 50 + Math.random() * 100));
    }
  }
  await admin.end();
  const u = new URL(adminUrl);
  u.pathname = `/${name}`;
  const url = u.toString();
  const pools: Sql[] = [];
  const connect = (max = 10, options: { lockTimeoutMs?: number } = {}) => {
    const sql = openDatabase({
      url,
      maxConnections: max,
      statementTimeoutMs: 10_000,
      lockTimeoutMs: options.lockTimeoutMs ?? 1_000,
      idleInTransactionTimeoutMs: 20_000,
      applicationName: "leasehold-test",
    });
    pools.push(sql);
    return sql;
  };
  const sql = connect();
  return {
    url,
    sql,
    connect,
    close: async () => {
      await Promise.all(pools.map((p) => p.end({ timeout: 1 })));
    },
  };
}

/** A transaction left open on purpose: it keeps its locks until `end`. */
export interface OpenTransaction {
  /** Commits the transaction and closes its connection. */
  end(): Promise<void>;
}

/**
 * Runs `statements` in a transaction on a connection of its own and returns
 * once they are done, with the transaction still open: another transaction
 * holding a row or advisory lock, as a stuck client would.
 */
export async function openTransaction(
  db: TestDatabase,
  statements: (tx: TransactionSql<{ bigint: bigint }>) => Promise<unknown>,
  options: { lockTimeoutMs?: number } = {},
): Promise<OpenTransaction> {
  const sql = db.connect(1, options);
  let finish!: () => void;
  const finished = new Promise<void>((resolve) => {
    finish = resolve;
  });
  let ready!: () => void;
  const isReady = new Promise<void>((resolve) => {
    ready = resolve;
  });
  const tx = sql.begin(async (t) => {
    await statements(t);
    ready();
    await finished;
  });
  // A failed statement ends the transaction before it is ready: report that.
  await Promise.race([isReady, tx]);
  return {
    end: async () => {
      finish();
      await tx;
      await sql.end({ timeout: 1 });
    },
  };
}

/**
 * A TCP proxy in front of the database of `url` (to drop or stall its
 * connections) and a pool of four connections through it, with the
 * server's timeouts; the caller closes both.
 */
export async function openThroughProxy(
  url: string,
  applicationName: string,
): Promise<{ proxy: TcpProxy; sql: Sql }> {
  const proxy = await startTcpProxy(`http://${new URL(url).host}`);
  const proxied = new URL(url);
  proxied.host = new URL(proxy.url).host;
  const sql = openDatabase({
    url: proxied.toString(),
    maxConnections: 4,
    statementTimeoutMs: 5_000,
    lockTimeoutMs: 1_000,
    idleInTransactionTimeoutMs: 5_000,
    applicationName,
  });
  return { proxy, sql };
}
