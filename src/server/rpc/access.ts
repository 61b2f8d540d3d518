// Authentication and authorization of LeaseService calls, the same for every
// path that serves them (the Connect adapter's interceptor, the native gRPC
// path). Order: the credentials (the bearer token, the client certificate:
// UNAUTHENTICATED; a certificate the identity map does not name:
// PERMISSION_DENIED), the method's scope
// (Revoke needs the admin scope), the account named in each request message
// (it must be the caller's), then the session authorizer, before any lease
// logic runs. One exception to the account rule: a guarded resource's token
// (the fence scope) may call CheckFence on any account's sessions, since the
// resource serves writers of every account; it reaches nothing else.
// Denials say which rule failed and never anything about another account.
// It throws domain errors; the error table gives them their codes.

import type { DescMessage } from "@bufbuild/protobuf";
import type { Authenticator, Principal } from "../../auth/authn.js";
import type { SessionAction, SessionAuthorizer } from "../../auth/session-authorizer.js";
import type { Access } from "../../call/access.js";
import { PermissionDeniedError } from "../../lease/errors.js";
import type { Limits } from "../../lease/limits.js";
import { checkId } from "../../lease/validation.js";

/** Every method of LeaseService and the session action it performs. */
const actions: Record<string, SessionAction> = {
  Acquire: "acquire",
  Renew: "renew",
  KeepAlive: "renew",
  Release: "release",
  Get: "read",
  List: "read",
  History: "read",
  CheckFence: "read",
  Watch: "watch",
  RequestHandoff: "handoff",
  Revoke: "revoke",
  // A Keep stream's own action is decided per request (keepTarget below);
  // this one is only what the method's scope check sees.
  Keep: "renew",
  RevokeKeeper: "revoke",
};

// Methods whose request may name every session of an account at once.
const accountWide = new Set(["List", "Watch"]);

// A KeepAlive stream asks the authorizer once per session, then trusts the
// answer this long: a renewal every few seconds must not cost a query each.
const streamDecisionMs = 30_000;

export interface AccessOptions {
  /** Services whose calls need a token, by full name. */
  protectedServices: ReadonlySet<string>;
  /** Undefined: development mode, every call is an anonymous principal. */
  authenticator: Authenticator | undefined;
  authorizer: SessionAuthorizer;
  adminScope: string;
  /** The scope that opens CheckFence on every account (and nothing else). */
  fenceScope: string;
  limits: Limits;
}

export function createAccess(options: AccessOptions): Access {
  const { authenticator, authorizer, adminScope, fenceScope, limits } = options;
  return {
    protects: (serviceName) => options.protectedServices.has(serviceName),

    async caller(methodName, header, certificate) {
      const action = actions[methodName];
      if (action === undefined) {
        throw new PermissionDeniedError(`${methodName} is not open to callers`);
      }
      const caller = authenticator
        ? await authenticator.authenticate(header("authorization"), certificate)
        : undefined;
      if (caller && action === "revoke" && !caller.scopes.has(adminScope)) {
        throw new PermissionDeniedError(`${methodName} needs the scope ${adminScope}`);
      }
      return caller;
    },

    check(methodName, input, message, caller, decided) {
      let action = actions[methodName] as SessionAction;
      let target: Target | undefined;
      if (methodName === "Keep") {
        // Each request of a Keep stream names its account its own way: the
        // open's account_id, an acquire's, release's or get's key (K1: all
        // of the keeper's account, which the open checked). A heartbeat or
        // a close names none: it acts on the keeper the open admitted.
        const keep = keepTarget(message);
        if (keep === undefined) return caller;
        action = keep.action;
        target = keep.target;
      } else {
        target = targetOf(message, input);
      }
      if (target === undefined || target.accountId === "") return caller;
      checkId(target.accountField, target.accountId, limits);
      if (caller && methodName === "CheckFence" && caller.scopes.has(fenceScope)) {
        // A resource checking a writer's token: not a user of the account,
        // so neither the account rule nor the session authorizer applies.
        if (target.sessionId !== "") checkId(target.sessionField, target.sessionId, limits);
        return caller;
      }
      if (caller && target.accountId !== caller.account) {
        throw new PermissionDeniedError(
          `${target.accountField} is not the account of the caller's token`,
        );
      }
      const principal = caller ?? anonymous(target.accountId);
      const sessionId = target.sessionId;
      // An empty session is "every session" only where the method allows
      // it; elsewhere the handler rejects it as INVALID_ARGUMENT.
      if (sessionId === "" && !accountWide.has(methodName)) return principal;
      if (sessionId !== "") checkId(target.sessionField, sessionId, limits);
      // A stream's decisions are remembered per action and session (a Keep
      // stream asks for several actions; a read allowed is no acquire allowed).
      const decision = methodName === "Keep" ? `${action}\u0000${sessionId}` : sessionId;
      const until = decided?.get(decision);
      if (until !== undefined && until > performance.now()) return principal;
      return authorizer.allows(principal, sessionId, action).then((allowed) => {
        if (!allowed) {
          throw new PermissionDeniedError(
            sessionId === ""
              ? `not allowed to ${action} every session of the account`
              : `not allowed to ${action} this session`,
          );
        }
        if (decided) {
          // Newest last; at most as many as the leases a stream may carry,
          // the oldest forgotten first (asked again if it comes back).
          decided.delete(decision);
          decided.set(decision, performance.now() + streamDecisionMs);
          if (decided.size > limits.maxLeasesPerStream) {
            const oldest = decided.keys().next().value;
            if (oldest !== undefined) decided.delete(oldest);
          }
        }
        return principal;
      });
    },
  };
}

interface Target {
  accountId: string;
  accountField: string;
  sessionId: string;
  sessionField: string;
}

/** Where a request message of each type names its account: asked once per type, not per message. */
const targetFields = new WeakMap<DescMessage, "key" | "accountId" | "none">();

function targetFieldOf(input: DescMessage): "key" | "accountId" | "none" {
  let field = targetFields.get(input);
  if (field === undefined) {
    field = input.fields.some((f) => f.localName === "key")
      ? "key"
      : input.fields.some((f) => f.localName === "accountId")
        ? "accountId"
        : "none";
    targetFields.set(input, field);
  }
  return field;
}

/** The account and session a request message names: its `key`, or List's `account_id`. */
function targetOf(message: object, input: DescMessage): Target | undefined {
  const m = message as { key?: { accountId?: string; sessionId?: string }; accountId?: unknown };
  const field = targetFieldOf(input);
  if (field === "key") {
    return {
      accountId: m.key?.accountId ?? "",
      accountField: "key.account_id",
      sessionId: m.key?.sessionId ?? "",
      sessionField: "key.session_id",
    };
  }
  if (field === "accountId" && typeof m.accountId === "string") {
    return {
      accountId: m.accountId,
      accountField: "account_id",
      sessionId: "",
      sessionField: "",
    };
  }
  return undefined;
}

/** What one request of a Keep stream names, and the session action it performs. */
function keepTarget(message: object): { target: Target; action: SessionAction } | undefined {
  const op = (message as { op?: { case?: string; value?: unknown } }).op;
  const value = op?.value as
    | { accountId?: string; key?: { accountId?: string; sessionId?: string } }
    | undefined;
  if (op?.case === "open") {
    return {
      action: "renew",
      target: {
        accountId: value?.accountId ?? "",
        accountField: "open.account_id",
        sessionId: "",
        sessionField: "",
      },
    };
  }
  const action: SessionAction | undefined =
    op?.case === "acquire"
      ? "acquire"
      : op?.case === "release"
        ? "release"
        : op?.case === "get"
          ? "read"
          : undefined;
  if (action === undefined || op?.case === undefined) return undefined;
  return {
    action,
    target: {
      accountId: value?.key?.accountId ?? "",
      accountField: `${op.case}.key.account_id`,
      sessionId: value?.key?.sessionId ?? "",
      sessionField: `${op.case}.key.session_id`,
    },
  };
}

function anonymous(account: string): Principal {
  return { account, subject: "", scopes: new Set(), anonymous: true };
}
