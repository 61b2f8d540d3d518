// Who may call the guarded store (DESIGN §7): the lease server's bearer-token
// authentication (its authn module, the same keys and settings) and its
// account rule: a request's `key.account_id` must be the token's account.
// Development mode (no keys, loopback only) takes every caller as acting for
// the account its request names. It throws domain errors; the error
// interceptor outside it gives them their codes.

import type { Interceptor } from "@connectrpc/connect";
import type { Authenticator } from "../auth/authn.js";
import { GuardedStoreService } from "../gen/leasehold/guarded/v1/guarded_pb.js";
import { PermissionDeniedError } from "../lease/errors.js";

/**
 * Refuses a GuardedStoreService call without a valid token (UNAUTHENTICATED)
 * and one whose key names another account (PERMISSION_DENIED), before its
 * handler runs. Undefined `authenticator`: development mode.
 */
export function callerAuthInterceptor(authenticator: Authenticator | undefined): Interceptor {
  return (next) => async (req) => {
    if (req.service.typeName !== GuardedStoreService.typeName || !authenticator) return next(req);
    const caller = await authenticator.authenticate(req.header.get("authorization"));
    // Every method of the service is unary and names its session in `key`.
    if (req.stream) throw new PermissionDeniedError(`${req.method.name} is not open to callers`);
    // A missing or empty account is left to the handler's INVALID_ARGUMENT.
    const accountId = (req.message as { key?: { accountId?: string } }).key?.accountId;
    if (accountId && accountId !== caller.account) {
      throw new PermissionDeniedError("key.account_id is not the account of the caller's token");
    }
    return next(req);
  };
}
