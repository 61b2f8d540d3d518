// Wires the guarded store server: the document store and its service on a
// host (database, migrations, pool, listener), the one call policy with the
// store's access rules (caller-auth.ts: the lease server's authentication and
// account rule) behind the same Connect adapter as the lease server's, and a
// client of the lease server's CheckFence, which confirms every write that
// would raise a fence (every write in live mode).

import { createClient } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import { createCallerAuthenticator } from "../auth/certificate-auth.js";
import { createCallObserver } from "../call/call-observer.js";
import { clampTimeoutHeaders, createCallPolicy } from "../call/call-policy.js";
import { policyGate, policyInterceptor } from "../call/policy-interceptor.js";
import { bearerTokenInterceptor, clientTlsOptions } from "../client/transport.js";
import { LeaseService } from "../gen/leasehold/v1/lease_pb.js";
import { type RunningServer, startHost } from "../host/host.js";
import { createLogger, type Logger } from "../log/logger.js";
import { guardedStoreSets } from "../postgres/migrate.js";
import { guardedAccess } from "./caller-auth.js";
import { type GuardedConfig, readLeaseTokenFile } from "./config.js";
import { createDocumentStore } from "./document-store.js";
import { defaultGuardedLimits, type GuardedLimits } from "./guarded-service.js";
import { createGrantCheck, createLiveCheck } from "./live-check.js";
import { guardedRoutes } from "./routes.js";

// A token file is re-read at most every few seconds, so that a rotated
// token is used without a restart and a write does not cost a file read.
const tokenFileCheckMs = 5_000;

/** The current lease-server token, for the bearer interceptor. */
function leaseToken(source: GuardedConfig["leaseToken"]): (() => string) | undefined {
  if (source === undefined) return undefined;
  if ("text" in source) return () => source.text;
  let token = readLeaseTokenFile(source.file);
  let readAt = performance.now();
  return () => {
    if (performance.now() - readAt >= tokenFileCheckMs) {
      readAt = performance.now();
      try {
        token = readLeaseTokenFile(source.file);
      } catch {
        // Keep the last good token: a file being replaced may be briefly absent.
      }
    }
    return token;
  };
}

/**
 * The largest request message: a Put of the largest value, base64 in JSON
 * (4/3 of it), with room for the key, name and token. Without a bound
 * connect-es takes messages of up to 4 GiB, and a 5-byte header claiming one
 * made it allocate that much before any authentication.
 */
function requestBound(limits: GuardedLimits): number {
  return Math.ceil((limits.maxValueBytes * 4) / 3) + 64 * 1024;
}

export async function startGuardedServer(
  config: GuardedConfig,
  logger: Logger = createLogger({ name: "leasehold-guarded" }),
  limits: GuardedLimits = defaultGuardedLimits,
): Promise<RunningServer> {
  return startHost(config, logger, {
    applicationName: "leasehold-guarded",
    migrationSets: guardedStoreSets,
    build: (sql, _shutdownSignal, _databaseUrl, _counters, tls) => {
      // Our own session manager, so shutdown can close the connection to
      // the lease server instead of waiting for it to idle out.
      // Its TLS files, when the lease server is https:// with a private CA or
      // asks for client certificates: read again for new connections.
      const session = new Http2SessionManager(
        config.leaseUrl,
        undefined,
        config.leaseTls ? clientTlsOptions(config.leaseTls) : undefined,
      );
      const token = leaseToken(config.leaseToken);
      const transport = createGrpcTransport({
        baseUrl: config.leaseUrl,
        sessionManager: session,
        interceptors: token ? [bearerTokenInterceptor(token)] : [],
      });
      const leases = createClient(LeaseService, transport);
      const options = { timeoutMs: config.leaseTimeoutMs };
      const checks =
        config.fenceMode === "live"
          ? { live: createLiveCheck(leases, options) }
          : { granted: createGrantCheck(leases, options) };
      const auth = config.auth;
      const clients = config.tls?.clients;
      if (auth.keys === undefined && clients === undefined) {
        logger.warn(
          { listen: config.listenHost },
          "development mode: no authentication keys configured, calls without tokens are accepted (loopback only)",
        );
      }
      // No /metrics here: a refused certificate is in the call's log line.
      const authenticator = createCallerAuthenticator({
        tokens: auth,
        maxIdLength: limits.maxIdLength,
        clientCertificates: clients && tls && { ...clients, use: tls.use },
      });
      logger.info({ fenceMode: config.fenceMode, leaseUrl: config.leaseUrl }, "fencing");
      // The lease server's call policy and Connect adapter: the same
      // observation (request id, log line for every failure), authentication,
      // error table and request id on errors. No /metrics here, no Watch.
      const policy = createCallPolicy({
        observer: createCallObserver({ logger, accessLogSample: 0 }),
        access: guardedAccess(authenticator),
      });
      return {
        routes: guardedRoutes({ store: createDocumentStore(sql, limits), limits, checks }),
        interceptors: [policyInterceptor(policy)],
        gate: policyGate(policy),
        http: (next) => (req, res) => {
          // Before connect-node reads them, as on the lease server.
          clampTimeoutHeaders(req.headers);
          next(req, res);
        },
        readMaxBytes: requestBound(limits),
        close: async () => session.abort(),
      };
    },
  });
}
