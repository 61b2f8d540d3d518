// Tracing as a step of the call policy (call-policy.ts), so that it reaches
// every path by construction: a span per call, unary or streaming, started
// when the call begins (continuing the caller's W3C traceparent) and ended
// with the call, carrying the method, the serving path, the request id, the
// account and the outcome; the session id only with --trace-session-keys
// (session ids may name users' work). The handler runs inside the span
// (`around`), so the batched statements its requests join link to it
// (observability/tracing.ts). Installed only when tracing is on.

import { codeToString } from "@connectrpc/connect/protocol-connect";
import { type Span, SpanStatusCode } from "@opentelemetry/api";
import type { PolicyCallInfo, PolicyStep } from "../../call/call-policy.js";
import type { Tracing } from "../observability/tracing.js";

interface Traced {
  span: Span;
  /** The first request message was seen (its key names the session). */
  keyed: boolean;
}

// Server-side, these codes are the server's failure; the others answer
// what the client sent or asked (OpenTelemetry's RPC conventions).
const serverErrors = new Set([
  "unknown",
  "deadline_exceeded",
  "unimplemented",
  "internal",
  "unavailable",
  "data_loss",
]);

// Probes arrive every few seconds from every load balancer: a trace each
// would bury the calls that matter (they are logged at debug for the same reason).
const untraced = new Set(["grpc.health.v1.Health"]);

export interface TracingStepOptions {
  /** Record the session id of a call's (first) request (--trace-session-keys). */
  sessionKeys: boolean;
}

export function tracingStep(tracing: Tracing, options: TracingStepOptions): PolicyStep {
  const calls = new WeakMap<PolicyCallInfo, Traced>();
  return {
    begin(call) {
      if (untraced.has(call.service)) return;
      const span = tracing.startCall(`${call.service}/${call.method}`, call.header, {
        "rpc.system.name": call.protocol === "connect" ? "connectrpc" : "grpc",
        "rpc.method": `${call.service}/${call.method}`,
        "leasehold.protocol": call.protocol,
        "leasehold.request_id": call.requestId,
      });
      calls.set(call, { span, keyed: false });
    },
    message(call, message) {
      const traced = calls.get(call);
      if (traced === undefined || traced.keyed) return;
      traced.keyed = true;
      const key = (message as { key?: { accountId?: unknown; sessionId?: unknown } }).key;
      if (typeof key?.accountId === "string" && key.accountId !== "") {
        traced.span.setAttribute("leasehold.account_id", key.accountId);
      }
      if (options.sessionKeys && typeof key?.sessionId === "string" && key.sessionId !== "") {
        traced.span.setAttribute("leasehold.session_id", key.sessionId);
      }
    },
    end(call, code) {
      const traced = calls.get(call);
      if (traced === undefined) return;
      calls.delete(call);
      const { span } = traced;
      // The authenticated account wins over the one a request named.
      const account = call.principal?.account;
      if (account) span.setAttribute("leasehold.account_id", account);
      const name = code === undefined ? "ok" : codeToString(code);
      span.setAttribute("rpc.status_code", statusName(name));
      if (code !== undefined && serverErrors.has(name)) {
        span.setStatus({ code: SpanStatusCode.ERROR, message: name });
      }
      span.end();
    },
    around(call, work) {
      const traced = calls.get(call);
      return traced === undefined ? work() : tracing.within(traced.span, work);
    },
  };
}

/** gRPC's name of a code ("CANCELLED", "FAILED_PRECONDITION"), from Connect's ("canceled"). */
function statusName(connectName: string): string {
  return connectName === "canceled" ? "CANCELLED" : connectName.toUpperCase();
}
