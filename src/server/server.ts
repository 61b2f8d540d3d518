// Wires the lease server: the lease store and its services on a host
// (database, migrations, pool, listener), with the streaming side
// (streaming.ts) and the operational surface (operations.ts) around them.
// `main` and the tests both use it.

import type { ServerConfig } from "./config/server-config.js";
import { type RunningServer, startHost } from "./http/host.js";
import { createLeaseStore } from "./db/lease-store.js";
import { createLogger, type Logger } from "./observability/logger.js";
import { registerNotificationMetrics } from "./observability/metrics.js";
import { startOperations } from "./operations.js";
import { checkExposure } from "./config/ops-config.js";
import { leaseRoutes } from "./rpc/routes.js";
import { createStaticHandler } from "./http/static.js";
import { type Streaming, startStreaming } from "./streams/streaming.js";

export type { RunningServer };

export interface LeaseServer extends RunningServer {
  /** Feed, hubs and batcher of this instance (tests and benchmarks read their stats). */
  readonly streaming: Streaming;
}

export async function startServer(
  config: ServerConfig,
  logger: Logger = createLogger(),
): Promise<LeaseServer> {
  // Also here, not only in parseServerConfig: callers may build a config.
  checkExposure(config.listenHost, config.ops.auth);
  let streaming: Streaming | undefined;
  const running = await startHost(config, logger, {
    applicationName: "leasehold",
    build: async (sql, _shutdownSignal, databaseUrl) => {
      const ops = await startOperations(config, databaseUrl, sql, logger);
      try {
        streaming = await startStreaming({
          sql,
          databaseUrl,
          // Published after commit, then quota and metrics around it, so
          // that waiting acquires and batched renewals pass through both.
          store: createLeaseStore(sql),
          wrap: ops.wrapStore,
          tuning: config.streams,
          limits: config.limits,
          logger,
          statementTimeoutMs: config.statementTimeoutMs,
          onRemoteChangeLag: (seconds) => ops.metrics.notificationLag.observe(seconds),
        });
      } catch (error) {
        await ops.close();
        throw error;
      }
      const live = streaming;
      if (live.notifier) registerNotificationMetrics(ops.metrics, live.notifier.stats);
      return {
        routes: (router) => {
          leaseRoutes({
            store: live.store,
            events: ops.events,
            limits: config.limits,
            waiters: live.waiters,
            keepAlive: live.keepAlive,
            watch: live.watch,
          })(router);
          ops.routes(router);
        },
        interceptors: ops.interceptors,
        http: ops.http,
        readMaxBytes: config.limits.maxMessageBytes,
        maxStreamsPerConnection: config.limits.maxStreamsPerConnection,
        beginShutdown: ops.beginShutdown,
        fallback: createStaticHandler({
          root: config.webDir,
          onError: (error) => logger.error({ err: error }, "serving the web page failed"),
        }),
        // Streams have ended by now; queued changes are published before
        // the pool closes.
        close: async () => {
          await live.close();
          await ops.close();
        },
      };
    },
  });
  if (!streaming) throw new Error("the lease server started without its streaming side");
  return Object.assign(running, { streaming });
}
