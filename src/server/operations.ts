// The operational surface around the lease routes: authentication and
// authorization, request logs and metrics, gRPC health and reflection,
// /metrics, the lease quota and retention. startServer builds it once its
// pool is open and tears it down after the listener has drained.

import type http from "node:http";
import type http2 from "node:http2";
import type { ConnectRouter, Interceptor } from "@connectrpc/connect";
import { Health } from "../gen/grpc/health/v1/health_pb.js";
import { LeaseService } from "../gen/leasehold/v1/lease_pb.js";
import { authInterceptor } from "./rpc/auth-interceptor.js";
import { createAuthenticator } from "./auth/authn.js";
import type { ServerConfig } from "./config/server-config.js";
import { openDatabase, type Sql } from "./db/pool.js";
import { createEventStore, type EventStore } from "./db/event-store.js";
import { createHealthService, type HealthMonitor, startHealthMonitor } from "./observability/health.js";
import { createLeaseCounts } from "./db/lease-counts.js";
import type { LeaseStore } from "./db/lease-store.js";
import type { Logger } from "./observability/logger.js";
import { withMetrics } from "./observability/metered-store.js";
import { createMetrics, type LeaseMetrics, serveMetrics } from "./observability/metrics.js";
import { unaryParseErrorsAsInvalidArgument } from "./rpc/parse-errors.js";
import { withLeaseQuota } from "./lease/quota.js";
import { reflectionRoutes } from "./rpc/reflection.js";
import { createRetention, type Maintenance, startMaintenance } from "./db/retention.js";
import { rpcObserver } from "./rpc/rpc-observer.js";
import { aclTableAuthorizer, ownAccountAuthorizer } from "./auth/session-authorizer.js";
import { createAccountSlots } from "./streams/stream-limits.js";
import { watchLimitInterceptor } from "./rpc/watch-limit.js";

type NodeHandler = (
  req: http.IncomingMessage | http2.Http2ServerRequest,
  res: http.ServerResponse | http2.Http2ServerResponse,
) => void;

export interface Operations {
  metrics: LeaseMetrics;
  health: HealthMonitor;
  maintenance: Maintenance;
  events: EventStore;
  interceptors: Interceptor[];
  /** The lease store with the quota and metrics around it. */
  wrapStore(store: LeaseStore): LeaseStore;
  /** Health and reflection, added after the lease routes; then fixes every unary handler's parse errors. */
  routes(router: ConnectRouter): void;
  /** Serves /metrics, else hands the request to `next`. */
  http(next: NodeHandler): NodeHandler;
  /** Health turns NOT_SERVING: the first step of a shutdown. */
  beginShutdown(): void;
  close(): Promise<void>;
}

export async function startOperations(
  config: ServerConfig,
  databaseUrl: string,
  sql: Sql,
  logger: Logger,
): Promise<Operations> {
  const { limits, ops } = config;
  const counts = createLeaseCounts(sql);
  const metrics = createMetrics({ poolSize: config.poolSize, countHeld: counts.heldTotal, logger });

  // The probe has its own connection: a pool busy with lease work is not
  // an unreachable database.
  const probeSql = openDatabase({
    url: databaseUrl,
    maxConnections: 1,
    statementTimeoutMs: ops.healthIntervalMs,
    lockTimeoutMs: config.lockTimeoutMs,
    idleInTransactionTimeoutMs: config.idleInTransactionTimeoutMs,
    applicationName: "leasehold-health",
    connectTimeoutSeconds: Math.max(1, Math.ceil(ops.healthIntervalMs / 1000)),
  });
  const health = await startHealthMonitor({
    probe: async () => {
      await probeSql`SELECT 1`;
    },
    intervalMs: ops.healthIntervalMs,
    logger,
    onStatus: (up) => metrics.databaseUp.set(up ? 1 : 0),
  });

  const auth = ops.auth;
  if (auth.keys === undefined) {
    logger.warn(
      { listen: config.listenHost },
      "development mode: no authentication keys configured, calls without tokens are accepted (loopback only)",
    );
  }
  const interceptors: Interceptor[] = [
    rpcObserver(logger, metrics),
    authInterceptor({
      protectedServices: new Set([LeaseService.typeName]),
      authenticator: auth.keys
        ? createAuthenticator(auth, auth.keys, limits.maxIdLength)
        : undefined,
      authorizer:
        auth.sessionAuthorizer === "acl-table" ? aclTableAuthorizer(sql) : ownAccountAuthorizer,
      adminScope: auth.adminScope,
      fenceScope: auth.fenceScope,
      limits,
    }),
    watchLimitInterceptor(
      LeaseService.typeName,
      createAccountSlots(
        limits.maxWatchersPerAccount,
        "Watch streams",
        "--max-watchers-per-account",
      ),
    ),
  ];

  const maintenance = startMaintenance(
    createRetention(sql, ops.retention),
    ops.retention.intervalMs,
    logger,
  );

  return {
    metrics,
    health,
    maintenance,
    events: createEventStore(sql),
    interceptors,
    wrapStore: (store) =>
      withMetrics(
        withLeaseQuota(store, counts, limits.maxLeasesPerAccount, () =>
          metrics.quotaRejections.inc(),
        ),
        metrics,
      ),
    routes: (router) => {
      router.service(
        Health,
        createHealthService(health, () => [
          ...new Set(router.handlers.map((h) => h.service.typeName)),
        ]),
      );
      reflectionRoutes(router, () => [...new Set(router.handlers.map((h) => h.service))]);
      unaryParseErrorsAsInvalidArgument(router);
    },
    http: (next) => (req, res) => {
      if (!serveMetrics(metrics, req, res)) next(req, res);
    },
    beginShutdown: () => health.shutdown(),
    close: async () => {
      await maintenance.stop();
      await health.close();
      await probeSql.end({ timeout: 1 });
    },
  };
}
