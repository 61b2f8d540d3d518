// What every call records, whichever path served it (the Connect adapter's
// interceptor or the native gRPC path): its request id (from x-request-id,
// else generated), a latency observation by method and code, and a JSON log
// line — always for a failure, and for a success at the configured sample
// rate (a line per call costs the server more than the call on a busy
// instance). Chosen fields only, never headers: a bearer token cannot reach
// the log.

import { randomUUID } from "node:crypto";
import { Code, type ConnectError } from "@connectrpc/connect";
import { codeToString } from "@connectrpc/connect/protocol-connect";
import type { Principal } from "../auth/authn.js";
import type { Logger } from "../log/logger.js";

const requestIdPattern = /^[A-Za-z0-9._:-]{1,128}$/;

// Probes arrive every few seconds from every load balancer: logged at debug.
const quietServices = new Set(["grpc.health.v1.Health"]);

export interface ObservedCall {
  readonly requestId: string;
  /** Set once the caller is known, for the log line. */
  principal: Principal | undefined;
  /** Records the end of the call, once (later calls are ignored); no code means OK. */
  end(code?: Code, error?: ConnectError): void;
}

export interface CallObserver {
  begin(service: string, method: string, requestIdHeader: string | null): ObservedCall;
}

/** The histogram a call's latency is observed in, labelled by method and code. */
export interface CallMetrics {
  rpcDuration: { labels(method: string, code: string): { observe(seconds: number): void } };
}

export interface CallObserverOptions {
  logger: Logger;
  /**
   * The call latency histogram, by method and code (the lease server's
   * leasehold_rpc_duration_seconds). A server without /metrics passes none.
   */
  metrics?: CallMetrics;
  /** Share of successful calls logged, 0 to 1; failures are always logged. */
  accessLogSample: number;
}

export function createCallObserver(options: CallObserverOptions): CallObserver {
  const { logger, metrics, accessLogSample } = options;
  // One histogram child per method and code: labelled lookups hash their labels on every call.
  const histograms = new Map<string, { observe(seconds: number): void }>();
  const histogram = (method: string, code: string) => {
    if (!metrics) return undefined;
    const k = `${method} ${code}`;
    let h = histograms.get(k);
    if (!h) {
      h = metrics.rpcDuration.labels(method, code);
      histograms.set(k, h);
    }
    return h;
  };

  return {
    begin(service, methodName, given) {
      const started = performance.now();
      const requestId = given !== null && requestIdPattern.test(given) ? given : randomUUID();
      const method = `${service}/${methodName}`;
      let ended = false;
      const call: ObservedCall = {
        requestId,
        principal: undefined,
        end(code, error) {
          if (ended) return;
          ended = true;
          const seconds = (performance.now() - started) / 1000;
          const codeName = code === undefined ? "ok" : codeToString(code);
          histogram(method, codeName)?.observe(seconds);
          const failed = code !== undefined;
          if (!failed && (accessLogSample <= 0 || Math.random() >= accessLogSample)) return;
          const principal = call.principal;
          const fields = {
            requestId,
            method,
            account: principal?.account,
            subject: principal?.subject || undefined,
            code: codeName,
            latencyMs: Math.round(seconds * 1e6) / 1e3,
            // The message of a client error helps; a server error's cause goes
            // to the log, never to the client.
            error: error?.rawMessage,
            err: code === Code.Internal || code === Code.Unknown ? error?.cause : undefined,
          };
          if (code === Code.Internal || code === Code.Unknown) logger.error(fields, "rpc failed");
          else if (quietServices.has(service)) logger.debug(fields, "rpc");
          else logger.info(fields, "rpc");
        },
      };
      return call;
    },
  };
}
