// Prometheus metrics (prom-client), served at /metrics. One registry per
// server, so several servers in one process (tests) keep separate counts.
// Counters count what this instance did; sum them across instances.

import type http from "node:http";
import type http2 from "node:http2";
import { Counter, collectDefaultMetrics, Gauge, Histogram, Registry } from "prom-client";
import type { Logger } from "../../log/logger.js";
import type { LossCause } from "../../protocol/errors.js";

export interface LeaseMetrics {
  readonly registry: Registry;
  /** RPC latency by method and code; a stream counts from its start to its end. */
  readonly rpcDuration: Histogram<"method" | "code">;
  readonly grants: Counter;
  readonly renewals: Counter;
  readonly releases: Counter;
  readonly revocations: Counter;
  /** Leases that ran past their deadline, as this instance found out (a takeover). */
  readonly expiries: Counter;
  /** Renewals refused because the run no longer held the lease, by cause. */
  readonly losses: Counter<"reason">;
  readonly quotaRejections: Counter;
  /** Calls refused for their client certificate (mutual TLS), by failure; `unmapped`: not in the identity map. */
  readonly clientCertificatesRefused: Counter<"reason">;
  /** Statements of the lease service waiting for or holding a pool connection. */
  readonly queriesInFlight: Gauge;
  /** 1 while the health probe reaches the database. */
  readonly databaseUp: Gauge;
  /** Time from a change's commit to its delivery on this instance. */
  readonly notificationLag: Histogram;
  lost(reason: LossCause): void;
}

export interface MetricsOptions {
  poolSize: number;
  /** The pool's counter, made before the registry (src/postgres/pool.ts). */
  syncReplicationCancelled?: Counter;
  /** Counts valid leases; called at most once per `heldCacheMs` per scrape. */
  countHeld: () => Promise<number>;
  heldCacheMs?: number;
  logger: Logger;
}

export function createMetrics(options: MetricsOptions): LeaseMetrics {
  const registry = new Registry();
  // prom-client's Node.js and process metrics, named after Prometheus's
  // conventions: its own names already say "process_" or "nodejs_", so the
  // prefix is the service alone (no leasehold_process_process_…), and its
  // three gauges that end in _total (a suffix for counters) are dropped:
  // sum(leasehold_nodejs_active_handles) and the like give the same figure.
  // docs/operations.md lists the former names.
  collectDefaultMetrics({ register: registry, prefix: "leasehold_" });
  for (const kind of ["handles", "requests", "resources"]) {
    registry.removeSingleMetric(`leasehold_nodejs_active_${kind}_total`);
  }
  const metric = { registers: [registry] };
  if (options.syncReplicationCancelled) registry.registerMetric(options.syncReplicationCancelled);

  const rpcDuration = new Histogram({
    ...metric,
    name: "leasehold_rpc_duration_seconds",
    help: "RPC latency by method and code (streams: their whole life)",
    labelNames: ["method", "code"] as const,
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60, 300],
  });
  const counter = (name: string, help: string) => new Counter({ ...metric, name, help });
  const losses = new Counter({
    ...metric,
    name: "leasehold_lease_losses_total",
    help: "renewals refused because the run no longer held the lease, by cause",
    labelNames: ["reason"] as const,
  });

  // A scrape must not scan the table every time several scrapers ask.
  const heldCacheMs = options.heldCacheMs ?? 5_000;
  let heldAt = Number.NEGATIVE_INFINITY;
  new Gauge({
    ...metric,
    name: "leasehold_leases_held",
    help: "valid leases of every account (read from the database, cached briefly)",
    async collect() {
      if (performance.now() - heldAt < heldCacheMs) return;
      try {
        this.set(await options.countHeld());
        heldAt = performance.now();
      } catch (error) {
        options.logger.warn({ err: error }, "could not count held leases for /metrics");
      }
    },
  });
  new Gauge({
    ...metric,
    name: "leasehold_db_pool_size",
    help: "configured database connections of this instance",
  }).set(options.poolSize);

  return {
    registry,
    rpcDuration,
    grants: counter("leasehold_lease_grants_total", "leases granted (retries excluded)"),
    renewals: counter("leasehold_lease_renewals_total", "successful renewals"),
    releases: counter("leasehold_lease_releases_total", "leases released by their run"),
    revocations: counter("leasehold_lease_revocations_total", "leases ended by Revoke"),
    expiries: counter(
      "leasehold_lease_expiries_total",
      "expired leases replaced by a grant on this instance",
    ),
    losses,
    quotaRejections: counter(
      "leasehold_quota_rejections_total",
      "acquires refused by the per-account lease quota",
    ),
    clientCertificatesRefused: new Counter({
      ...metric,
      name: "leasehold_client_certificates_refused_total",
      help: "calls refused for their client certificate, by reason (unmapped: not in the identity map)",
      labelNames: ["reason"],
    }),
    queriesInFlight: new Gauge({
      ...metric,
      name: "leasehold_db_queries_in_flight",
      help: "lease statements waiting for or using a pool connection",
    }),
    databaseUp: new Gauge({
      ...metric,
      name: "leasehold_db_up",
      help: "1 while the health probe reaches the database",
    }),
    notificationLag: new Histogram({
      ...metric,
      name: "leasehold_notification_lag_seconds",
      help: "time from a lease change's commit to its delivery on this instance",
      buckets: [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
    }),
    lost: (reason) => losses.inc({ reason }),
  };
}

/** What the notification channel reports of itself (notifier.ts's stats). */
export interface NotificationStats {
  readonly published: number;
  readonly received: number;
  readonly dropped: number;
  readonly reconnects: number;
  readonly listenFailures: number;
  readonly listening: boolean;
}

/**
 * Adds the notification channel's figures to the registry, read at each
 * scrape: whether this instance listens (0 means it is deaf to other
 * instances' changes until it listens again), and its running counts.
 */
export function registerNotificationMetrics(metrics: LeaseMetrics, stats: NotificationStats): void {
  const metric = { registers: [metrics.registry] };
  new Gauge({
    ...metric,
    name: "leasehold_notification_listening",
    help: "1 while the LISTEN connection is in place (0: other instances' changes are missed)",
    collect() {
      this.set(stats.listening ? 1 : 0);
    },
  });
  const counted = (name: string, help: string, read: () => number) => {
    let reported = 0;
    new Counter({
      ...metric,
      name,
      help,
      collect() {
        const now = read();
        if (now > reported) this.inc(now - reported);
        reported = now;
      },
    });
  };
  counted(
    "leasehold_notifications_published_total",
    "lease changes this instance queued for the others (sent, unless later dropped)",
    () => stats.published,
  );
  counted(
    "leasehold_notifications_received_total",
    "lease changes received from other instances",
    () => stats.received,
  );
  counted(
    "leasehold_notifications_dropped_total",
    "notification payloads (each one or more changes) dropped while publishing failed",
    () => stats.dropped,
  );
  counted(
    "leasehold_notification_reconnects_total",
    "times the LISTEN connection was lost and replaced",
    () => stats.reconnects,
  );
  counted(
    "leasehold_notification_listen_failures_total",
    "attempts to LISTEN that failed",
    () => stats.listenFailures,
  );
}

/** Answers GET /metrics in the Prometheus text format; false for any other request. */
export function serveMetrics(
  metrics: LeaseMetrics,
  req: http.IncomingMessage | http2.Http2ServerRequest,
  res: http.ServerResponse | http2.Http2ServerResponse,
): boolean {
  const path = (req.url ?? "").split("?")[0];
  if (path !== "/metrics") return false;
  if (req.method !== "GET" && req.method !== "HEAD") {
    res.writeHead(405, { allow: "GET, HEAD" });
    res.end();
    return true;
  }
  metrics.registry.metrics().then(
    (text) => {
      res.writeHead(200, { "content-type": metrics.registry.contentType });
      res.end(req.method === "HEAD" ? "" : text);
    },
    () => {
      res.writeHead(500);
      res.end();
    },
  );
  return true;
}
