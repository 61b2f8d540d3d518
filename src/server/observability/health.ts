// The server's health: SERVING while a periodic cheap query reaches the
// database, NOT_SERVING while it does not and from the start of a shutdown.
// rpc/health-service.ts serves it as grpc.health.v1, which load balancers and
// orchestrators poll (Check) or hold (Watch); statuses are that protocol's.

import { HealthCheckResponse_ServingStatus as ServingStatus } from "../../gen/grpc/health/v1/health_pb.js";
import type { Logger } from "../../log/logger.js";

export { ServingStatus };

export interface HealthMonitor {
  status(): ServingStatus;
  /** Calls `listener` on every change of status until the returned function is called. */
  onChange(listener: (status: ServingStatus) => void): () => void;
  /** NOT_SERVING for good: the server is going away. */
  shutdown(): void;
  close(): Promise<void>;
}

export interface HealthMonitorOptions {
  /** Resolves when the database answers; rejects or hangs past the interval when not. */
  probe: () => Promise<void>;
  intervalMs: number;
  logger: Logger;
  onStatus?: (serving: boolean) => void;
}

/** Probes once before returning, so the first answer is already a real one. */
export async function startHealthMonitor(options: HealthMonitorOptions): Promise<HealthMonitor> {
  const listeners = new Set<(status: ServingStatus) => void>();
  let status = ServingStatus.UNKNOWN;
  let stopped = false;
  const set = (next: ServingStatus) => {
    if (next === status) return;
    const previous = status;
    status = next;
    options.onStatus?.(next === ServingStatus.SERVING);
    if (previous !== ServingStatus.UNKNOWN || next !== ServingStatus.SERVING) {
      const log = next === ServingStatus.SERVING ? options.logger.info : options.logger.warn;
      log.call(options.logger, { status: ServingStatus[next] }, "health changed");
    }
    for (const listener of listeners) listener(next);
  };

  const probeOnce = async () => {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error("probe timed out")), options.intervalMs * 2);
    });
    try {
      await Promise.race([options.probe(), timeout]);
      if (!stopped) set(ServingStatus.SERVING);
    } catch (error) {
      if (!stopped) {
        if (status !== ServingStatus.NOT_SERVING) {
          options.logger.warn({ err: error }, "database probe failed");
        }
        set(ServingStatus.NOT_SERVING);
      }
    } finally {
      clearTimeout(timer);
    }
  };

  await probeOnce();
  // Sequential probes: a slow database never piles them up.
  let running: Promise<void> = Promise.resolve();
  const timer = setInterval(() => {
    running = running.then(probeOnce);
  }, options.intervalMs);
  timer.unref();

  return {
    status: () => status,
    onChange: (listener) => {
      listeners.add(listener);
      return () => listeners.delete(listener);
    },
    shutdown: () => {
      set(ServingStatus.NOT_SERVING);
      stopped = true;
    },
    close: async () => {
      stopped = true;
      clearInterval(timer);
      await running;
      listeners.clear();
    },
  };
}
