// The one call policy of the lease server and the guarded store: what every
// call goes through, whichever path serves it (the Connect adapter's
// interceptor, policy-interceptor.ts, for Connect, gRPC-Web and connect-node's
// gRPC; the lease server's native gRPC path, src/server/rpc/grpc-native.ts and
// native-streams.ts). Written once, in order:
//
//   begin    observation (call-observer.ts: request id, latency, log line);
//            the steps' begin (tracing starts the call's span here,
//            tracing-step.ts)
//   admit    authentication (the bearer token, the method's scope, what
//            else the headers decide), from the request headers before any
//            of the body is read (the adapters ask `authenticate` first, and
//            a refused call reads nothing); a stream is then timed to end
//            with UNAUTHENTICATED at its token's expiry (past the verifier's
//            clock tolerance), without waiting for another message; extra
//            steps
//   message  each request message: refused once the token has expired
//            (nothing is renewed after that), the account and the session
//            authorizer (the server's Access, access.ts), extra steps
//   watch    the per-account Watch quota, given back when the call ends
//   end      error mapping (error-codes.ts) with the request id, observation
//            recorded, end hooks run
//   run      the handler, inside what the steps' `around` sets up (tracing:
//            the call's span, for the statements its requests join)
//
// The adapters only move bytes and messages. A step added to `steps` runs on
// every path by construction (test/call-policy.test.ts checks that), and so
// does every rule above. The texts a path answers on its own (one message
// per call, a deadline, a cancel, an expired token) are in error-texts.ts.

import type { DescMessage, DescMethod, DescService } from "@bufbuild/protobuf";
import type { Code, ConnectError } from "@connectrpc/connect";
import type { Principal } from "../auth/authn.js";
import type { ClientCertificate } from "../auth/client-certificate.js";
import { UnauthenticatedError } from "../lease/errors.js";
import { requestIdHeader } from "../protocol/headers.js";
import type { Access } from "./access.js";
import type { AccountSlots } from "./account-slots.js";
import type { CallObserver, ObservedCall } from "./call-observer.js";
import { toConnectError } from "./error-codes.js";
import { policyText } from "./error-texts.js";

/** The longest timer Node can hold: a longer grpc-timeout is clamped to it. */
export const maxTimeoutMs = 2 ** 31 - 1;

/** What a step sees of a call. */
export interface PolicyCallInfo {
  /** Full service name, e.g. leasehold.v1.LeaseService. */
  readonly service: string;
  readonly method: string;
  /** The serving path: "grpc-native", or connect-node's protocol name ("grpc", "grpc_web", "connect"). */
  readonly protocol: string;
  readonly requestId: string;
  /** The caller once known; undefined before admission and in development mode. */
  readonly principal: Principal | undefined;
  /** A request header (lower-case name), or null. */
  header(name: string): string | null;
}

/**
 * A step of the policy, run on every path. A step throws a domain error (or
 * returns a promise that rejects with one) to refuse the call; the error
 * table gives it its code.
 */
export interface PolicyStep {
  /** Once per call, first, before authentication; cannot refuse the call. */
  begin?(call: PolicyCallInfo): void;
  /** Once per call, after authentication, before its first request message. */
  admit?(call: PolicyCallInfo): void | Promise<void>;
  /**
   * Each request message, after the access check. A step that returns no
   * promise keeps a message that needs none synchronous (a KeepAlive
   * stream's later renewals).
   */
  message?(call: PolicyCallInfo, message: object): void | Promise<void>;
  /** Once, when the call ends, with its code (undefined: OK). */
  end?(call: PolicyCallInfo, code: Code | undefined): void;
  /**
   * Runs `work` (the call's handler, or a part of a stream's) inside this
   * step's context for the call, and returns what it returns.
   */
  around?<T>(call: PolicyCallInfo, work: () => T): T;
}

export interface PolicyCall extends PolicyCallInfo {
  readonly ended: boolean;
  /**
   * The handler checks each request message itself (`message`), and answers
   * a refused one in that request's answer instead of ending the stream (a
   * Keep stream: CallPolicyOptions.checkedByHandler). The adapters then pass
   * its messages on unchecked and give the handler the check.
   */
  readonly checkedByHandler: boolean;
  /** Authenticates the caller and runs the steps' admission; a stream's token expiry is scheduled. */
  admit(): Promise<void>;
  /**
   * Checks one request message. Synchronous when nothing needs a promise (a
   * KeepAlive stream's later renewals), so a stream adds none per message.
   */
  message(message: object): void | Promise<void>;
  /** Takes the caller's Watch slot for `account`; given back when the call ends. */
  enterWatch(account: string): void;
  /** Runs `hook` once when the call ends; at once when it already has. */
  onEnd(hook: () => void): void;
  /**
   * Runs `work` inside the steps' `around`, in order (the first step's
   * outermost); without such steps, just calls it. The adapters run the
   * handler, and what reaches it later from the connection, through this.
   */
  run<T>(work: () => T): T;
  /** `listener`, run through `run` whoever calls it; itself when no step has `around`. */
  bind<A extends unknown[]>(listener: (...args: A) => void): (...args: A) => void;
  /**
   * Called once, when a stream's token expires before the call ended: the
   * adapter ends the call with the given error.
   */
  onExpired(listener: (error: ConnectError) => void): void;
  /**
   * Ends the call: OK without an error, else with the error mapped to its
   * code and carrying the request id. Returns the mapped error. Later calls
   * return the first one's answer and do nothing.
   */
  end(error?: unknown): ConnectError | undefined;
}

/**
 * A call's caller, decided from its headers before its body was read
 * (`CallPolicy.authenticate`); the call begun with it is not authenticated
 * again.
 */
export interface Admission {
  readonly caller: Principal | undefined;
}

/** What a call is begun from: its method, its serving path and its request headers. */
export interface CallStart {
  service: DescService;
  method: DescMethod;
  protocol: string;
  header(name: string): string | null;
  /** The client certificate of the call's connection; undefined without one (or without TLS). */
  certificate?: () => ClientCertificate | undefined;
}

export interface CallPolicyOptions {
  observer: CallObserver;
  access: Access;
  /** Open Watch streams per account on this instance; none for a server without Watch. */
  watchSlots?: AccountSlots;
  /** Steps run after the built-in ones, in order. */
  steps?: readonly PolicyStep[];
  /**
   * Streaming methods ("package.Service/Method") whose handler runs the
   * message check on each request itself (PolicyCall.checkedByHandler).
   */
  checkedByHandler?: ReadonlySet<string>;
}

export interface CallPolicy {
  /** Starts the policy of one call (of any service: only protected ones are authenticated). */
  begin(init: CallStart & { admission?: Admission }): PolicyCall;
  /**
   * Authenticates a call from its headers alone, before its body is read.
   * Refused: the call is begun and ended with the refusal (observed, mapped,
   * carrying its request id), and the promise rejects with that answer.
   */
  authenticate(init: CallStart): Promise<Admission>;
}

/** The steps, sorted once by the hooks they have. */
interface Steps {
  all: readonly PolicyStep[];
  begin: readonly PolicyStep[];
  message: readonly PolicyStep[];
  around: readonly PolicyStep[];
}

export function createCallPolicy(options: CallPolicyOptions): CallPolicy {
  const { observer, access, watchSlots } = options;
  const all = options.steps ?? [];
  const steps: Steps = {
    all,
    begin: all.filter((s) => s.begin),
    message: all.filter((s) => s.message),
    around: all.filter((s) => s.around),
  };
  const begin = (init: CallStart & { admission?: Admission }): PolicyCall => {
    const observed = observer.begin(
      init.service.typeName,
      init.method.name,
      init.header(requestIdHeader),
    );
    const call = new Call(init, observed, access, watchSlots, steps);
    call.checkedByHandler =
      options.checkedByHandler?.has(`${init.service.typeName}/${init.method.name}`) ?? false;
    for (const step of steps.begin) step.begin?.(call);
    return call;
  };
  return {
    begin,
    authenticate: async (init) => {
      if (!access.protects(init.service.typeName)) return { caller: undefined };
      try {
        return {
          caller: await access.caller(init.method.name, init.header, init.certificate?.()),
        };
      } catch (error) {
        // The same call a refusal inside admit() would have ended.
        throw begin(init).end(error) ?? error;
      }
    },
  };
}

class Call implements PolicyCall {
  readonly service: string;
  readonly method: string;
  readonly protocol: string;
  checkedByHandler = false;
  private readonly streaming: boolean;
  private readonly input: DescMessage;
  readonly header: (name: string) => string | null;
  private readonly certificate: (() => ClientCertificate | undefined) | undefined;
  private readonly decided = new Map<string, number>();
  private readonly admission: Admission | undefined;
  private caller: Principal | undefined;
  private admitted = false;
  private finished = false;
  private answer: ConnectError | undefined;
  private expired: ConnectError | undefined;
  private expiryTimer: NodeJS.Timeout | undefined;
  private expiryListener: ((error: ConnectError) => void) | undefined;
  private endHooks: (() => void)[] = [];

  constructor(
    init: CallStart & { admission?: Admission },
    private readonly observed: ObservedCall,
    private readonly access: Access,
    private readonly watchSlots: AccountSlots | undefined,
    private readonly steps: Steps,
  ) {
    this.service = init.service.typeName;
    this.method = init.method.name;
    this.protocol = init.protocol;
    this.streaming = init.method.methodKind !== "unary";
    this.input = init.method.input;
    this.header = init.header;
    this.admission = init.admission;
    this.certificate = init.certificate;
  }

  get requestId(): string {
    return this.observed.requestId;
  }

  get principal(): Principal | undefined {
    return this.observed.principal;
  }

  get ended(): boolean {
    return this.finished;
  }

  async admit(): Promise<void> {
    if (this.admitted) return;
    this.admitted = true;
    if (this.access.protects(this.service)) {
      this.caller = this.admission
        ? this.admission.caller
        : await this.access.caller(this.method, this.header, this.certificate?.());
      this.observed.principal = this.caller;
      this.scheduleExpiry();
    }
    for (const step of this.steps.all) if (step.admit) await step.admit(this);
  }

  message(message: object): void | Promise<void> {
    if (this.expired || this.tokenExpired()) throw this.expiredError();
    let pending: Promise<unknown> | undefined;
    if (this.access.protects(this.service)) {
      const principal = this.access.check(
        this.method,
        this.input,
        message,
        this.caller,
        this.streaming ? this.decided : undefined,
      );
      if (principal instanceof Promise) {
        pending = principal.then((p) => {
          this.observed.principal = p;
          this.watchSlotFor(p);
        });
      } else {
        this.observed.principal = principal;
        this.watchSlotFor(principal);
      }
    }
    const withSteps = this.steps.message;
    if (withSteps.length === 0) return pending as Promise<void> | undefined;
    if (pending) {
      return pending.then(() => this.stepsFrom(withSteps, 0, message));
    }
    return this.stepsFrom(withSteps, 0, message);
  }

  // The message steps from `first` on, in order: synchronous until one
  // returns a promise, the rest after it settles.
  private stepsFrom(
    steps: readonly PolicyStep[],
    first: number,
    message: object,
  ): void | Promise<void> {
    for (let i = first; i < steps.length; i++) {
      const done = steps[i]?.message?.(this, message);
      if (done instanceof Promise) return done.then(() => this.stepsFrom(steps, i + 1, message));
    }
  }

  run<T>(work: () => T): T {
    const around = this.steps.around;
    if (around.length === 0) return work();
    return this.around(around, 0, work);
  }

  private around<T>(steps: readonly PolicyStep[], i: number, work: () => T): T {
    const step = steps[i];
    if (step?.around === undefined) return work();
    return step.around(this, () => this.around(steps, i + 1, work));
  }

  bind<A extends unknown[]>(listener: (...args: A) => void): (...args: A) => void {
    if (this.steps.around.length === 0) return listener;
    return (...args) => this.run(() => listener(...args));
  }

  enterWatch(account: string): void {
    // A call that already ended takes nothing (a check it awaited came back late).
    if (this.finished || !this.watchSlots) return;
    const leave = this.watchSlots.enter(account);
    this.onEnd(leave);
  }

  // A Watch holds one of its account's slots from its admitted request until
  // it ends. No account: the handler refuses the request as INVALID_ARGUMENT.
  private watchSlotFor(principal: Principal | undefined): void {
    if (this.method !== "Watch" || !principal?.account) return;
    this.enterWatch(principal.account);
  }

  onEnd(hook: () => void): void {
    if (this.finished) hook();
    else this.endHooks.push(hook);
  }

  onExpired(listener: (error: ConnectError) => void): void {
    this.expiryListener = listener;
    if (this.expired && !this.finished) listener(this.expired);
  }

  end(error?: unknown): ConnectError | undefined {
    if (this.finished) return this.answer;
    this.finished = true;
    if (this.expiryTimer) clearTimeout(this.expiryTimer);
    let code: Code | undefined;
    if (error !== undefined) {
      const ce = toConnectError(error);
      ce.metadata.set(requestIdHeader, this.observed.requestId);
      this.answer = ce;
      code = ce.code;
    }
    this.observed.end(code, this.answer);
    for (const hook of this.endHooks.splice(0)) hook();
    for (const step of this.steps.all) step.end?.(this, code);
    return this.answer;
  }

  private tokenExpired(): boolean {
    const until = this.caller?.validUntilMs;
    return until !== undefined && Date.now() >= until;
  }

  private expiredError(): ConnectError {
    this.expired ??= toConnectError(
      this.caller?.expiresWith === "certificate"
        ? new UnauthenticatedError(policyText.certificateExpired, "certificate_expired")
        : new UnauthenticatedError(policyText.tokenExpired, "expired"),
    );
    return this.expired;
  }

  // A stream ends when its token does: at `exp` plus the verifier's clock
  // tolerance (validUntilMs), by a timer, not by polling or on the next message.
  private scheduleExpiry(): void {
    const until = this.caller?.validUntilMs;
    if (!this.streaming || until === undefined || this.finished) return;
    const arm = () => {
      const left = until - Date.now();
      if (left > 0) {
        this.expiryTimer = setTimeout(arm, Math.min(left, maxTimeoutMs));
        return;
      }
      this.expiryTimer = undefined;
      if (this.finished) return;
      const error = this.expiredError();
      this.expiryListener?.(error);
    };
    arm();
  }
}

// grpc-timeout is at most 8 digits and a unit; the longest a timer holds, in
// whole seconds.
const grpcTimeoutPattern = /^(\d{1,8})([HMSmun])$/;
const grpcUnitMs: Record<string, number> = {
  H: 3_600_000,
  M: 60_000,
  S: 1_000,
  m: 1,
  u: 0.001,
  n: 0.000_001,
};
const longestGrpcTimeout = `${Math.floor(maxTimeoutMs / 1000)}S`;

/**
 * A grpc-timeout header beyond what a timer holds (grpc-go sends 2592000S for
 * 30 days) clamped to the longest one that fits; any other value as it is
 * (a malformed one is refused where it is parsed).
 */
export function clampGrpcTimeout(value: string | null): string | null {
  const m = value === null ? null : grpcTimeoutPattern.exec(value);
  if (!m) return value;
  const ms = Number(m[1]) * (grpcUnitMs[m[2] as string] ?? 0);
  return ms > maxTimeoutMs ? longestGrpcTimeout : value;
}

/** connect-timeout-ms beyond what a timer holds, clamped; any other value as it is. */
export function clampConnectTimeout(value: string | null): string | null {
  if (value === null || !/^\d{1,10}$/.test(value)) return value;
  return Number(value) > maxTimeoutMs ? String(maxTimeoutMs) : value;
}

/**
 * Clamps the timeout headers of a request in place, before connect-node reads
 * them: it would refuse nothing and arm a timer that Node fires at once for
 * anything beyond 2^31−1 ms.
 */
export function clampTimeoutHeaders(headers: Record<string, string | string[] | undefined>): void {
  const grpc = headers["grpc-timeout"];
  if (typeof grpc === "string") {
    const clamped = clampGrpcTimeout(grpc);
    if (clamped !== null) headers["grpc-timeout"] = clamped;
  }
  const connect = headers["connect-timeout-ms"];
  if (typeof connect === "string") {
    const clamped = clampConnectTimeout(connect);
    if (clamped !== null) headers["connect-timeout-ms"] = clamped;
  }
}
