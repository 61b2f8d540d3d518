// Who may call the guarded store (DESIGN §7): the lease server's bearer-token
// authentication (src/auth, the same keys and settings) and its account
// rule: a request's `key.account_id` must be the token's account. These are
// the store's access rules for the one call policy (src/call/call-policy.ts),
// which runs them on every call, as it runs the lease server's. Development
// mode (no keys, loopback only) takes every caller as acting for the account
// its request names. It throws domain errors; the policy's error table gives
// them their codes.

import type { Authenticator } from "../auth/authn.js";
import type { Access } from "../call/access.js";
import { GuardedStoreService } from "../gen/leasehold/guarded/v1/guarded_pb.js";
import { PermissionDeniedError } from "../lease/errors.js";
import { fencingHeaderNames } from "../protocol/headers.js";

/**
 * Refuses a GuardedStoreService call without a valid token (UNAUTHENTICATED)
 * and one whose key names another account (PERMISSION_DENIED), before its
 * handler runs: from the headers, before the body is read, when the fencing
 * header leasehold-account-id names another account; else once the request
 * message is read. Undefined `authenticator`: development mode, nothing
 * checked.
 */
export function guardedAccess(authenticator: Authenticator | undefined): Access {
  return {
    protects: (serviceName) =>
      authenticator !== undefined && serviceName === GuardedStoreService.typeName,

    async caller(methodName, header, certificate) {
      const caller = await authenticator?.authenticate(header("authorization"), certificate);
      // Every method of the service is unary and names its session in `key`.
      const method = GuardedStoreService.methods.find((m) => m.name === methodName);
      if (method?.methodKind !== "unary") {
        throw new PermissionDeniedError(`${methodName} is not open to callers`);
      }
      // A writer's fencing headers name its session: another account's is
      // refused here, so its body (a Put's value, megabytes) is never read.
      const headerAccount = header(fencingHeaderNames.accountId);
      if (caller && headerAccount && headerAccount !== caller.account) {
        throw new PermissionDeniedError(
          `${fencingHeaderNames.accountId} is not the account of the caller's token`,
        );
      }
      return caller;
    },

    check(_methodName, _input, message, caller) {
      // A missing or empty account is left to the handler's INVALID_ARGUMENT.
      const accountId = (message as { key?: { accountId?: string } }).key?.accountId;
      if (caller && accountId && accountId !== caller.account) {
        throw new PermissionDeniedError("key.account_id is not the account of the caller's token");
      }
      return caller;
    },
  };
}
