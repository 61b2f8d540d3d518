// Hosts one Leasehold server process: database (given or embedded),
// migrations, the pool, the Connect handler on the shared listener, and an
// orderly shutdown. The lease server and the guarded store differ only in
// the services they build on the pool.

import { setMaxListeners } from "node:events";
import type http from "node:http";
import type http2 from "node:http2";
import { Code, ConnectError, type ConnectRouter, type Interceptor } from "@connectrpc/connect";
import { type ConnectNodeAdapterOptions, connectNodeAdapter } from "@connectrpc/connect-node";
import type { Counter } from "prom-client";
import { defaultDatabaseConnectTimeoutMs, type HostConfig } from "../config/host-config.js";
import type { Logger } from "../log/logger.js";
import { probeDatabase } from "../postgres/connect-probe.js";
import { type EmbeddedDatabase, startEmbeddedPostgres } from "../postgres/embedded-postgres.js";
import { type MigrationSet, migrate } from "../postgres/migrate.js";
import { createSyncReplicationCancelledCounter, openDatabase, type Sql } from "../postgres/pool.js";

import { type Listener, listen, type StreamHandler } from "./listener.js";
import { createRpcEntry, type HeaderGate } from "./rpc-entry.js";
import { createTlsCredentials, type TlsCredentials } from "./tls-credentials.js";

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

export type NodeHandler = (
  req: http.IncomingMessage | http2.Http2ServerRequest,
  res: http.ServerResponse | http2.Http2ServerResponse,
) => void;

/** What a server builds once its pool is open. */
export interface HostedServices {
  routes: (router: ConnectRouter) => void;
  interceptors?: Interceptor[];
  /** Wraps the Connect handler, e.g. to answer /metrics beside it. */
  http?: (next: NodeHandler) => NodeHandler;
  /** Largest request message in bytes (Connect's readMaxBytes). */
  readMaxBytes?: number;
  /**
   * Decides a routed call from its headers before its body is read (the call
   * policy's authentication, `policyGate`); a refused call's body is never read.
   */
  gate?: HeaderGate;
  /** The first step of a shutdown, before streams end (health turns NOT_SERVING). */
  beginShutdown?: () => void;
  /** Serves HTTP/2 streams itself before the Connect adapter sees them (the native gRPC path). */
  streamHandler?: StreamHandler;
  /** Answers requests for paths that are not RPCs (the lease server's web page). */
  fallback?: ConnectNodeAdapterOptions["fallback"];
  /** Stops the services' own work; runs after requests drain, before the pool closes. */
  close?: () => Promise<void>;
}

export interface HostOptions {
  /** application_name of the pool's connections, as pg_stat_activity shows it. */
  applicationName: string;
  /** The migration sets this server applies at start, in order. */
  migrationSets: readonly MigrationSet[];
  /**
   * Builds the services on the open pool. `shutdownSignal` is aborted at
   * shutdown, so long-lived handlers can end; `tls` holds the server's TLS
   * files as they are reloaded (its identity map, with client certificates).
   */
  build(
    sql: Sql,
    shutdownSignal: AbortSignal,
    databaseUrl: string,
    database: PoolCounters,
    tls: TlsCredentials | undefined,
  ): HostedServices | Promise<HostedServices>;
}

/** Counters the pool's notice handler keeps, for the server's /metrics. */
export interface PoolCounters {
  syncReplicationCancelled: Counter;
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
      port: config.embeddedPort,
      movableDataDir: config.dataDirIsDefault === true,
      onNotice: (line) => logger.warn(line),
      onLog: (line) => logger.debug({ postgres: line.trim() }, "embedded postgres"),
    });
    databaseUrl = embedded.url;
    logger.info({ dataDir: embedded.dataDir, port: embedded.port }, "started embedded PostgreSQL");
  } else {
    await probeDatabase(
      databaseUrl,
      config.databaseConnectTimeoutMs ?? defaultDatabaseConnectTimeoutMs,
    );
  }
  let sql: Sql | undefined;
  let services: HostedServices | undefined;
  let listener: Listener | undefined;
  const tls = config.tls ? createTlsCredentials(config.tls, logger) : undefined;
  let stopWatchingTls: (() => void) | undefined;
  try {
    const applied = await migrate(databaseUrl, options.migrationSets);
    if (applied.length > 0) {
      logger.info(
        { migrations: applied.map((m) => `${m.set}/${String(m.version).padStart(4, "0")}`) },
        "applied migrations",
      );
    }
    const counters: PoolCounters = {
      syncReplicationCancelled: createSyncReplicationCancelledCounter(),
    };
    sql = openDatabase({
      url: databaseUrl,
      maxConnections: config.poolSize,
      statementTimeoutMs: config.statementTimeoutMs,
      lockTimeoutMs: config.lockTimeoutMs,
      idleInTransactionTimeoutMs: config.idleInTransactionTimeoutMs,
      applicationName: options.applicationName,
      notices: { logger, syncReplicationCancelled: counters.syncReplicationCancelled },
    });
    const shutdown = new AbortController();
    // Every in-flight call links its own signal to this one; a busy server
    // has far more than Node's default of 10 listeners, and that is no leak.
    setMaxListeners(0, shutdown.signal);
    services = await options.build(sql, shutdown.signal, databaseUrl, counters, tls);
    // connect-es's own bound when none is given.
    const readMaxBytes = services.readMaxBytes ?? 0xffffffff;
    const acceptUnknownJsonFields = config.jsonUnknownFields === "accept";
    const entry = createRpcEntry({
      readMaxBytes,
      acceptUnknownJsonFields,
      readTimeoutMs: config.readTimeoutMs,
      gate: services.gate,
    });
    const adapter = connectNodeAdapter({
      routes: entry.routes(services.routes),
      interceptors: services.interceptors,
      shutdownSignal: shutdown.signal,
      readMaxBytes,
      // The backstop of rpc-entry.ts's check, for what it does not see (a
      // compressed body, a Connect GET's query): protobuf-es refuses the field.
      jsonOptions: { ignoreUnknownFields: acceptUnknownJsonFields },
      fallback: entry.fallback(services.fallback),
      contextValues: (req) => entry.contextValues(req),
    });
    const handler = entry.node(adapter);
    listener = await listen({
      host: config.listenHost,
      port: config.listenPort,
      handler: services.http ? services.http(handler) : handler,
      maxConcurrentStreams: config.maxStreamsPerConnection,
      streamHandler: services.streamHandler,
      tls: tls && { credentials: tls, clientCertificates: config.tls?.clients !== undefined },
      handshakeTimeoutMs: config.handshakeTimeoutMs,
      idleTimeoutMs: config.idleTimeoutMs,
    });
    stopWatchingTls = tls?.watch();
    const host = listener.host.includes(":") ? `[${listener.host}]` : listener.host;
    const url = `${config.tls ? "https" : "http"}://${host}:${listener.port}`;
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
          // Health first, so balancers stop sending; then streams end with
          // UNAVAILABLE (clients move to another instance; leases stay), the
          // listener stops accepting and drains, and the pool closes last.
          openServices.beginShutdown?.();
          shutdown.abort(
            new ConnectError(
              "the server is shutting down: reconnect to another instance",
              Code.Unavailable,
            ),
          );
          stopWatchingTls?.();
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
    stopWatchingTls?.();
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
