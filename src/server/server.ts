// Wires a lease server together: database (given or embedded), migrations,
// the pool, the services and the listener. `main` and the tests both use it.

import { connectNodeAdapter } from "@connectrpc/connect-node";
import type { ServerConfig } from "./config.js";
import { openDatabase, type Sql } from "./db.js";
import { type EmbeddedDatabase, startEmbeddedPostgres } from "./embedded-postgres.js";
import { createLeaseStore } from "./lease-store.js";
import { type Listener, listen } from "./listener.js";
import { createLogger, type Logger } from "./logger.js";
import { migrate } from "./migrate.js";
import { leaseRoutes } from "./routes.js";

export interface RunningServer {
  /** Base URL for clients, e.g. http://127.0.0.1:7070 */
  readonly url: string;
  readonly port: number;
  /** The database in use (password removed). */
  readonly databaseUrl: string;
  readonly sql: Sql;
  /** Ends streams, drains requests, closes the pool and any embedded database. */
  close(): Promise<void>;
}

export async function startServer(
  config: ServerConfig,
  logger: Logger = createLogger(),
): Promise<RunningServer> {
  let embedded: EmbeddedDatabase | undefined;
  let databaseUrl = config.databaseUrl;
  if (databaseUrl === undefined) {
    embedded = await startEmbeddedPostgres({
      dataDir: config.dataDir,
      onLog: (line) => logger.debug({ postgres: line.trim() }, "embedded postgres"),
    });
    databaseUrl = embedded.url;
    logger.info({ dataDir: embedded.dataDir, port: embedded.port }, "started embedded PostgreSQL");
  }
  let sql: Sql | undefined;
  let listener: Listener | undefined;
  try {
    const applied = await migrate(databaseUrl);
    if (applied.length > 0) logger.info({ versions: applied }, "applied migrations");
    sql = openDatabase({
      url: databaseUrl,
      maxConnections: config.poolSize,
      statementTimeoutMs: config.statementTimeoutMs,
      lockTimeoutMs: config.lockTimeoutMs,
      idleInTransactionTimeoutMs: config.idleInTransactionTimeoutMs,
      applicationName: "leasehold",
    });
    const store = createLeaseStore(sql);
    const shutdown = new AbortController();
    const handler = connectNodeAdapter({
      routes: leaseRoutes({ store, limits: config.limits }),
      shutdownSignal: shutdown.signal,
    });
    listener = await listen({ host: config.listenHost, port: config.listenPort, handler });
    const host = listener.host.includes(":") ? `[${listener.host}]` : listener.host;
    const url = `http://${host}:${listener.port}`;
    const shown = redact(databaseUrl);
    logger.info({ url, database: shown, embedded: embedded !== undefined }, "serving");
    const openSql = sql;
    const openListener = listener;
    let closing: Promise<void> | undefined;
    return {
      url,
      port: listener.port,
      databaseUrl: shown,
      sql,
      close: () => {
        closing ??= (async () => {
          shutdown.abort();
          await openListener.close(config.shutdownGraceMs);
          await openSql.end({ timeout: 5 });
          await embedded?.stop();
          logger.info("stopped");
        })();
        return closing;
      },
    };
  } catch (error) {
    await listener?.close(0);
    await sql?.end({ timeout: 1 });
    await embedded?.stop();
    throw error;
  }
}

function redact(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = "***";
    return u.toString();
  } catch {
    return "(unparseable DATABASE_URL)";
  }
}
