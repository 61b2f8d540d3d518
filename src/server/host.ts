// Hosts one Leasehold server process: database (given or embedded),
// migrations, the pool, the Connect handler on the shared listener, and an
// orderly shutdown. The lease server and the guarded store differ only in
// the services they build on the pool.

import { setMaxListeners } from "node:events";
import type { ConnectRouter, Interceptor } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import type { HostConfig } from "./config.js";
import { openDatabase, type Sql } from "./db.js";
import { type EmbeddedDatabase, startEmbeddedPostgres } from "./embedded-postgres.js";
import { type Listener, listen } from "./listener.js";
import type { Logger } from "./logger.js";
import { migrate } from "./migrate.js";

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

/** What a server builds once its pool is open. */
export interface HostedServices {
  routes: (router: ConnectRouter) => void;
  interceptors?: Interceptor[];
  /** Stops the services' own work; runs after requests drain, before the pool closes. */
  close?: () => Promise<void>;
}

export interface HostOptions {
  /** application_name of the pool's connections, as pg_stat_activity shows it. */
  applicationName: string;
  /** Aborted at shutdown, so long-lived handlers can end. */
  build(sql: Sql, shutdownSignal: AbortSignal): HostedServices | Promise<HostedServices>;
}

export async function startHost(
  config: HostConfig,
  logger: Logger,
  options: HostOptions,
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
  let services: HostedServices | undefined;
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
      applicationName: options.applicationName,
    });
    const shutdown = new AbortController();
    // Every in-flight call links its own signal to this one; a busy server
    // has far more than Node's default of 10 listeners, and that is no leak.
    setMaxListeners(0, shutdown.signal);
    services = await options.build(sql, shutdown.signal);
    const handler = connectNodeAdapter({
      routes: services.routes,
      interceptors: services.interceptors,
      shutdownSignal: shutdown.signal,
    });
    listener = await listen({ host: config.listenHost, port: config.listenPort, handler });
    const host = listener.host.includes(":") ? `[${listener.host}]` : listener.host;
    const url = `http://${host}:${listener.port}`;
    const shown = redact(databaseUrl);
    logger.info({ url, database: shown, embedded: embedded !== undefined }, "serving");
    const openSql = sql;
    const openListener = listener;
    const openServices = services;
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
          await openServices.close?.();
          await openSql.end({ timeout: 5 });
          await embedded?.stop();
          logger.info("stopped");
        })();
        return closing;
      },
    };
  } catch (error) {
    await listener?.close(0);
    await services?.close?.();
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
