// Routes of the lease server: one plain function from a router to services.

import type { ConnectRouter } from "@connectrpc/connect";
import { LeaseService } from "../../gen/leasehold/v1/lease_pb.js";
import { type AuditServiceDeps, createAuditService } from "./audit-service.js";
import { createFenceService } from "./fence-service.js";
import { createLeaseService, type LeaseServiceDeps } from "./lease-service.js";
import { createStreamService, type StreamServiceDeps } from "./stream-service.js";

export function leaseRoutes(deps: LeaseServiceDeps & AuditServiceDeps & StreamServiceDeps) {
  return (router: ConnectRouter) => {
    router.service(LeaseService, {
      ...createLeaseService(deps),
      ...createFenceService(deps),
      ...createAuditService(deps),
      ...createStreamService(deps),
    });
  };
}
