// Wires the lease server: the lease store and its services on a host
// (database, migrations, pool, listener), with the operational surface
// around them (operations.ts). `main` and the tests both use it.

import type { ServerConfig } from "./config.js";
import { type RunningServer, startHost } from "./host.js";
import { createLeaseStore } from "./lease-store.js";
import { createLogger, type Logger } from "./logger.js";
import { startOperations } from "./operations.js";
import { checkExposure } from "./ops-config.js";
import { leaseRoutes } from "./routes.js";

export type { RunningServer };

export async function startServer(
  config: ServerConfig,
  logger: Logger = createLogger(),
): Promise<RunningServer> {
  // Also here, not only in parseServerConfig: callers may build a config.
  checkExposure(config.listenHost, config.ops.auth);
  return startHost(config, logger, {
    applicationName: "leasehold",
    build: async (sql, _shutdownSignal, databaseUrl) => {
      const ops = await startOperations(config, databaseUrl, sql, logger);
      const store = ops.wrapStore(createLeaseStore(sql));
      return {
        routes: (router) => {
          leaseRoutes({ store, events: ops.events, limits: config.limits })(router);
          ops.routes(router);
        },
        interceptors: ops.interceptors,
        http: ops.http,
        readMaxBytes: config.limits.maxMessageBytes,
        maxStreamsPerConnection: config.limits.maxStreamsPerConnection,
        beginShutdown: ops.beginShutdown,
        close: ops.close,
      };
    },
  });
}
