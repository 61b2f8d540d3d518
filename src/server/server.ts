// The composition root of the lease server: every part is built here, in
// the order it depends on, and nowhere else. `main` (cli/serve.ts), the tests
// and the benchmarks all start a server through startServer.
//
// The host (src/host/host.ts) supplies the database (given or embedded), runs
// the migrations and opens the pool; `buildLeaseServer` then assembles, in
// this order: metrics and health; the change feed (with the notification
// channel to other instances); the lease store and its decorators; the
// streaming side (expiry tracker, renewal batcher, KeepAlive, Watch and
// waiting Acquire); authentication; the interceptors; the routes.

import { randomUUID } from "node:crypto";
import { Code, ConnectError } from "@connectrpc/connect";
import type { TracerProvider } from "@opentelemetry/api";
import { createCallerAuthenticator } from "../auth/certificate-auth.js";
import { aclTableAuthorizer, ownAccountAuthorizer } from "../auth/session-authorizer.js";
import { createAccountSlots } from "../call/account-slots.js";
import { createCallObserver } from "../call/call-observer.js";
import { clampTimeoutHeaders, createCallPolicy, type PolicyStep } from "../call/call-policy.js";
import { unaryParseErrorsAsInvalidArgument } from "../call/parse-errors.js";
import { policyGate, policyInterceptor } from "../call/policy-interceptor.js";
import { checkExposure } from "../config/ops-config.js";
import { Health } from "../gen/grpc/health/v1/health_pb.js";
import { LeaseService } from "../gen/leasehold/v1/lease_pb.js";
import {
  type HostedServices,
  type PoolCounters,
  type RunningServer,
  startHost,
} from "../host/host.js";
import { resetOnMoreData, resetStalled } from "../host/request-end.js";
import type { TlsCredentials } from "../host/tls-credentials.js";
import type { LeaseStore } from "../lease/types.js";
import { createLogger, type Logger } from "../log/logger.js";
import { leaseServerSets } from "../postgres/migrate.js";
import { openDatabase, type Sql } from "../postgres/pool.js";
import { LimitName } from "../protocol/errors.js";
import type { ServerConfig } from "./config/server-config.js";
import { createEventStore } from "./db/event-store.js";
import { createKeeperStore } from "./db/keeper-store.js";
import { createLeaseCounts } from "./db/lease-counts.js";
import { createLeaseStore, type LeaseStoreStats } from "./db/lease-store.js";
import { createRetention, startMaintenance } from "./db/retention.js";
import { createSessionAclTable } from "./db/session-acl.js";
import { createStaticHandler } from "./http/static.js";
import { startHealthMonitor } from "./observability/health.js";
import { withMetrics } from "./observability/metered-store.js";
import {
  createMetrics,
  registerNotificationMetrics,
  serveMetrics,
} from "./observability/metrics.js";
import { createAccess } from "./rpc/access.js";
import { createNativeGrpc } from "./rpc/grpc-native.js";
import { createHealthService } from "./rpc/health-service.js";
import { nativeStreams } from "./rpc/native-streams.js";
import { reflectionRoutes } from "./rpc/reflection.js";
import { leaseRoutes, leaseServiceImpl } from "./rpc/routes.js";
import { tracingStep } from "./rpc/tracing-step.js";
import { type ChangeFeed, createChangeFeed } from "./streams/change-feed.js";
import { createExpiryTracker, type ExpiryTracker } from "./streams/expiry-tracker.js";
import { createKeepAliveHub, type KeepAliveHub } from "./streams/keepalive.js";
import { createNotifier, type Notifier } from "./streams/notifier.js";
import { withKeeperPublishing, withPublishing } from "./streams/publishing-store.js";
import { createRenewalBatcher, type RenewalBatcher } from "./streams/renewal-batcher.js";
import { createWaiters, type Waiters } from "./streams/waiters.js";
import { createWatchHub, type WatchHub } from "./streams/watch-hub.js";

export type { RunningServer };

/** The parts of an instance that tests and benchmarks read (their stats) or drive. */
export interface Streaming {
  /** The store the services use, decorators included. */
  readonly store: LeaseStore;
  /** Statements and rows of the group-committed kinds. */
  readonly storeStats: LeaseStoreStats;
  readonly feed: ChangeFeed;
  readonly notifier: Notifier | undefined;
  readonly tracker: ExpiryTracker;
  readonly batcher: RenewalBatcher;
  readonly keepAlive: KeepAliveHub;
  readonly watch: WatchHub;
  readonly waiters: Waiters;
}

export interface LeaseServer extends RunningServer {
  readonly streaming: Streaming;
}

/** What a server is built with beyond its configuration (tests and embedders). */
export interface LeaseServerExtensions {
  /** Steps added to the call policy, run on every path after the built-in ones. */
  policySteps?: readonly PolicyStep[];
  /**
   * With tracing on (--tracing on), the provider spans go to instead of one
   * built from the OTEL_* variables (a test's in-memory exporter); the
   * server does not shut it down. Ignored with tracing off.
   */
  tracerProvider?: TracerProvider;
}

export async function startServer(
  config: ServerConfig,
  logger: Logger = createLogger(),
  extensions: LeaseServerExtensions = {},
): Promise<LeaseServer> {
  // Also here, not only in parseServerConfig: callers may build a config.
  checkExposure(config.listenHost, config.ops.auth, config.tls);
  let streaming: Streaming | undefined;
  const running = await startHost(config, logger, {
    applicationName: "leasehold",
    migrationSets: leaseServerSets,
    build: async (sql, shutdownSignal, databaseUrl, poolCounters, tls) => {
      const built = await buildLeaseServer(
        config,
        logger,
        sql,
        databaseUrl,
        shutdownSignal,
        extensions,
        poolCounters,
        tls,
      );
      streaming = built.streaming;
      return built.services;
    },
  });
  if (!streaming) throw new Error("the lease server started without its streaming side");
  return Object.assign(running, { streaming });
}

async function buildLeaseServer(
  config: ServerConfig,
  logger: Logger,
  sql: Sql,
  databaseUrl: string,
  shutdownSignal: AbortSignal,
  extensions: LeaseServerExtensions,
  poolCounters: PoolCounters,
  tls: TlsCredentials | undefined,
): Promise<{ services: HostedServices; streaming: Streaming }> {
  const { limits, ops, streams: tuning } = config;
  // Tracing (observability/tracing.ts), only when on: off, its module (the
  // OpenTelemetry SDK) is not even loaded, and nothing below holds a tracer.
  const tracing = config.tracing.enabled
    ? (await import("./observability/tracing.js")).createTracing({
        exporters: config.tracing.exporters,
        provider: extensions.tracerProvider,
      })
    : undefined;
  if (tracing) {
    logger.info(
      { exporters: extensions.tracerProvider ? ["given"] : config.tracing.exporters },
      "tracing on",
    );
  }
  const counts = createLeaseCounts(sql);
  const metrics = createMetrics({
    poolSize: config.poolSize,
    countHeld: counts.heldTotal,
    logger,
    syncReplicationCancelled: poolCounters.syncReplicationCancelled,
  });

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
  const stopHealth = async () => {
    await health.close();
    await probeSql.end({ timeout: 1 });
  };

  const notifier = tuning.notifications
    ? createNotifier({
        url: databaseUrl,
        statementTimeoutMs: config.statementTimeoutMs,
        instanceId: randomUUID(),
        tickMs: tuning.notifyTickMs,
        pingIntervalMs: tuning.listenCheckIntervalMs,
        logger,
      })
    : undefined;
  if (notifier) registerNotificationMetrics(metrics, notifier.stats);
  const feed = createChangeFeed({
    notifier,
    logger,
    onRemoteChange: (change) => {
      // An expiry carries its deadline, not a commit time.
      if (change.type === "expired") return;
      const lagUs = tracker.databaseNowUs() - change.atUs;
      metrics.notificationLag.observe(Math.max(0, Number(lagUs) / 1e6));
    },
  });

  // The store every service uses. From the inside out: the SQL, with the
  // per-account quota inside the acquire statement and concurrent calls
  // group-committed; each write published to the change feed once its
  // statement has committed (never inside it, DESIGN §3); outcomes counted
  // for /metrics. Waiting acquires and batched renewals go through all of it.
  const sqlStore = createLeaseStore(sql, {
    maxLeasesPerAccount: limits.maxLeasesPerAccount,
    maxLeasesPerKeeper: limits.maxLeasesPerKeeper,
    // Twice the statement timeout: a statement the database runs (lock
    // waits included) has answered by then, one on a dead connection has not.
    unansweredAfterMs: 2 * config.statementTimeoutMs,
    tracer: tracing?.statements,
  });
  const store = withMetrics(withPublishing(sqlStore, feed), metrics);
  // Keepers (docs/keepers.md): a close or revoke published like a release or revoke.
  const keepers = withKeeperPublishing(
    createKeeperStore(sql, { maxKeepersPerAccount: limits.maxKeepersPerAccount }),
    feed,
  );

  const tracker = createExpiryTracker({ store, feed, logger });
  const batcher = createRenewalBatcher({
    store,
    tickMs: tuning.renewTickMs,
    tracer: tracing?.statements,
  });
  const keepAlive = createKeepAliveHub({
    batcher,
    feed,
    maxLeasesPerStream: limits.maxLeasesPerStream,
    maxPendingAnswers: limits.maxStreamBacklog,
  });
  const watch = createWatchHub({
    store,
    feed,
    tracker,
    logger,
    bufferLength: limits.watchBufferLength,
    recheckIntervalMs: tuning.recheckIntervalMs,
  });
  const waiters = createWaiters({
    store,
    feed,
    tracker,
    logger,
    recheckIntervalMs: tuning.recheckIntervalMs,
  });
  const stopStreaming = async () => {
    // A stream still open now (the listener's grace ran out, or it was
    // opened as the server stopped) ends as a shutdown ends every stream:
    // UNAVAILABLE, so that its client moves to another instance.
    const reason =
      shutdownSignal.reason instanceof ConnectError
        ? shutdownSignal.reason
        : new ConnectError(
            "the server is shutting down: reconnect to another instance",
            Code.Unavailable,
          );
    keepAlive.close(reason);
    watch.close(reason);
    waiters.close();
    batcher.close();
    tracker.close();
    // Publishes what is queued, then stops listening.
    await feed.close();
    // Exports the spans still buffered.
    await tracing?.shutdown();
  };
  // Receivers subscribe before changes start to flow.
  try {
    await tracker.start();
    keepAlive.start();
    watch.start();
    waiters.start();
    await feed.start();
  } catch (error) {
    await stopStreaming();
    await stopHealth();
    throw error;
  }

  const auth = ops.auth;
  if (auth.keys === undefined && config.tls?.clients === undefined) {
    logger.warn(
      { listen: config.listenHost },
      "development mode: no authentication keys configured, calls without tokens are accepted (loopback only)",
    );
  }
  // The one call policy (src/call/call-policy.ts), run by every path: the Connect
  // adapter's one interceptor and the native gRPC path. Open Watch streams
  // per account on this instance are counted there, whichever path serves them.
  const watchSlots = createAccountSlots(
    limits.maxWatchersPerAccount,
    "Watch streams",
    LimitName.watchersPerAccount,
  );
  const observer = createCallObserver({ logger, metrics, accessLogSample: ops.accessLogSample });
  const access = createAccess({
    protectedServices: new Set([LeaseService.typeName]),
    authenticator: createCallerAuthenticator({
      tokens: auth,
      maxIdLength: limits.maxIdLength,
      clientCertificates: config.tls?.clients && tls && { ...config.tls.clients, use: tls.use },
      onRefused: (failure) => metrics.clientCertificatesRefused.inc({ reason: failure }),
    }),
    authorizer:
      auth.sessionAuthorizer === "acl-table"
        ? aclTableAuthorizer(createSessionAclTable(sql))
        : ownAccountAuthorizer,
    adminScope: auth.adminScope,
    fenceScope: auth.fenceScope,
    limits,
  });
  // Tracing first: its span covers the other steps, and its `around` holds
  // the handler and everything after it.
  const policy = createCallPolicy({
    observer,
    access,
    watchSlots,
    // A Keep stream answers a refused request in that request's answer.
    checkedByHandler: new Set([`${LeaseService.typeName}/Keep`]),
    steps: [
      ...(tracing ? [tracingStep(tracing, { sessionKeys: config.tracing.sessionKeys })] : []),
      ...(extensions.policySteps ?? []),
    ],
  });
  const interceptors = [policyInterceptor(policy)];

  // One implementation of LeaseService: the Connect adapter serves it to
  // every protocol, and the native path serves it to gRPC clients (its unary
  // methods as they are; KeepAlive and Watch over the same hubs:
  // grpc-native.ts, native-streams.ts).
  const impl = leaseServiceImpl({
    store,
    events: createEventStore(sql),
    limits,
    waiters,
    keepAlive,
    watch,
    keepers,
  });

  const maintenance = startMaintenance(
    createRetention(sql, ops.retention),
    ops.retention.intervalMs,
    logger,
  );

  return {
    streaming: {
      store,
      storeStats: sqlStore.stats,
      feed,
      notifier,
      tracker,
      batcher,
      keepAlive,
      watch,
      waiters,
    },
    services: {
      routes: (router) => {
        leaseRoutes(impl)(router);
        const routed = () => [...new Set(router.handlers.map((h) => h.service))];
        router.service(
          Health,
          createHealthService(health, () => routed().map((s) => s.typeName)),
        );
        reflectionRoutes(router, routed);
        unaryParseErrorsAsInvalidArgument(router);
      },
      interceptors,
      streamHandler:
        config.grpcPath === "native"
          ? createNativeGrpc({
              services: [
                {
                  desc: LeaseService,
                  impl,
                  streams: nativeStreams({
                    keepAlive,
                    watch,
                    limits,
                    keep: { store, keepers, limits, waiters },
                  }),
                },
              ],
              policy,
              maxMessageBytes: limits.maxMessageBytes,
              readTimeoutMs: config.readTimeoutMs,
              unread: { resetOnMoreData, resetStalled },
              shutdownSignal,
            })
          : undefined,
      http: (next) => (req, res) => {
        if (serveMetrics(metrics, req, res)) return;
        // Before connect-node reads them: it would arm a timer Node fires at
        // once for a timeout beyond 2^31−1 ms.
        clampTimeoutHeaders(req.headers);
        next(req, res);
      },
      readMaxBytes: limits.maxMessageBytes,
      gate: policyGate(policy),
      // Health turns NOT_SERVING first, so balancers stop sending.
      beginShutdown: () => health.shutdown(),
      fallback: createStaticHandler({
        root: config.webDir,
        onError: (error) => logger.error({ err: error }, "serving the web page failed"),
      }),
      // Streams have ended by now; queued changes are published before the
      // pool closes.
      close: async () => {
        await stopStreaming();
        await maintenance.stop();
        await stopHealth();
      },
    },
  };
}
