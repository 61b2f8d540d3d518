// Routes of the lease server: one plain function from a router to services,
// over the one service implementation that the native gRPC path serves too.

import { Code, ConnectError, type ConnectRouter, type ServiceImpl } from "@connectrpc/connect";
import { LeaseService } from "../../gen/leasehold/v1/lease_pb.js";
import { type AuditServiceDeps, createAuditService } from "./audit-service.js";
import { createFenceService } from "./fence-service.js";
import { createKeepService, type KeepServiceDeps } from "./keep-service.js";
import { createLeaseService, type LeaseServiceDeps } from "./lease-service.js";
import { createStreamService, type StreamServiceDeps } from "./stream-service.js";

export type LeaseServiceImplDeps = LeaseServiceDeps &
  AuditServiceDeps &
  StreamServiceDeps &
  KeepServiceDeps;

/** The one implementation of LeaseService, behind the Connect adapter and the native gRPC path. */
export function leaseServiceImpl(deps: LeaseServiceImplDeps): ServiceImpl<typeof LeaseService> {
  return {
    ...createLeaseService(deps),
    ...createFenceService(deps),
    ...createAuditService(deps),
    ...createStreamService(deps),
    ...createKeepService(deps),
    revokeKeeper: async () => {
      throw new ConnectError("RevokeKeeper is not served by this server", Code.Unimplemented);
    },
  };
}

export function leaseRoutes(impl: ServiceImpl<typeof LeaseService>) {
  return (router: ConnectRouter) => {
    router.service(LeaseService, impl);
  };
}
