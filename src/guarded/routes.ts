// Routes of the guarded store server.

import type { ConnectRouter } from "@connectrpc/connect";
import { unaryParseErrorsAsInvalidArgument } from "../call/parse-errors.js";
import { GuardedStoreService } from "../gen/leasehold/guarded/v1/guarded_pb.js";
import { createGuardedService, type GuardedServiceDeps } from "./guarded-service.js";

export function guardedRoutes(deps: GuardedServiceDeps) {
  return (router: ConnectRouter) => {
    router.service(GuardedStoreService, createGuardedService(deps));
    // A body that does not parse is the client's mistake, as on the lease server.
    unaryParseErrorsAsInvalidArgument(router);
  };
}
