// gRPC health (grpc.health.v1) over the health monitor (observability/health.ts).

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ServiceImpl } from "@connectrpc/connect";
import {
  type Health,
  HealthCheckResponseSchema,
  HealthListResponseSchema,
  HealthCheckResponse_ServingStatus as ServingStatus,
} from "../../gen/grpc/health/v1/health_pb.js";
import type { HealthMonitor } from "../observability/health.js";

/**
 * The Health service over the monitor. `services` are the names a client
 * may ask about besides "" (the server as a whole); they share its status.
 */
export function createHealthService(
  monitor: HealthMonitor,
  services: () => readonly string[],
): ServiceImpl<typeof Health> {
  const known = (name: string) => name === "" || services().includes(name);
  const response = (status: ServingStatus) => create(HealthCheckResponseSchema, { status });
  return {
    check: (req) => {
      if (!known(req.service)) {
        throw new ConnectError(`unknown service ${JSON.stringify(req.service)}`, Code.NotFound);
      }
      return response(monitor.status());
    },
    list: () =>
      create(HealthListResponseSchema, {
        statuses: Object.fromEntries(
          ["", ...services()].map((name) => [name, response(monitor.status())]),
        ),
      }),
    async *watch(req, context) {
      if (!known(req.service)) {
        // The protocol keeps the call open for a service that may appear;
        // this server's services are fixed, so the answer is final.
        yield response(ServingStatus.SERVICE_UNKNOWN);
        await new Promise<void>((resolve) => {
          if (context.signal.aborted) resolve();
          context.signal.addEventListener("abort", () => resolve(), { once: true });
        });
        throw ConnectError.from(context.signal.reason, Code.Unavailable);
      }
      const pending: ServingStatus[] = [monitor.status()];
      let wake: (() => void) | undefined;
      const stop = monitor.onChange((status) => {
        pending.push(status);
        wake?.();
      });
      const onAbort = () => wake?.();
      context.signal.addEventListener("abort", onAbort);
      try {
        while (true) {
          const status = pending.shift();
          if (status !== undefined) {
            yield response(status);
            continue;
          }
          // Shutdown (or the client leaving): end with the reason, which
          // the server gives as UNAVAILABLE so clients move elsewhere.
          if (context.signal.aborted)
            throw ConnectError.from(context.signal.reason, Code.Unavailable);
          await new Promise<void>((resolve) => {
            wake = resolve;
          });
          wake = undefined;
        }
      } finally {
        stop();
        context.signal.removeEventListener("abort", onAbort);
      }
    },
  };
}
