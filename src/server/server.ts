// Wires the lease server: the lease store and its services on a host
// (database, migrations, pool, listener). `main` and the tests both use it.

import type { ServerConfig } from "./config.js";
import { type RunningServer, startHost } from "./host.js";
import { createLeaseStore } from "./lease-store.js";
import { createLogger, type Logger } from "./logger.js";
import { leaseRoutes } from "./routes.js";

export type { RunningServer };

export async function startServer(
  config: ServerConfig,
  logger: Logger = createLogger(),
): Promise<RunningServer> {
  return startHost(config, logger, {
    applicationName: "leasehold",
    build: (sql) => ({
      routes: leaseRoutes({ store: createLeaseStore(sql), limits: config.limits }),
    }),
  });
}
