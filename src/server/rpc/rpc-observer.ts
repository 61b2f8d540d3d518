// One JSON log line and one latency observation per RPC: request id,
// account, method, code and latency. The outermost interceptor, so it sees
// every answer, authentication failures included. It logs chosen fields
// only, never headers: a bearer token cannot reach the log.

import { randomUUID } from "node:crypto";
import { Code, ConnectError, createContextKey, type Interceptor } from "@connectrpc/connect";
import { codeToString } from "@connectrpc/connect/protocol-connect";
import { requestIdHeader } from "../../protocol/headers.js";
import type { Logger } from "../observability/logger.js";
import type { LeaseMetrics } from "../observability/metrics.js";
import { principalKey } from "./auth-interceptor.js";

/** The request id of the current call (from x-request-id, else generated). */
export const requestIdKey = createContextKey("", { description: "leasehold request id" });

const requestIdPattern = /^[A-Za-z0-9._:-]{1,128}$/;

// Probes arrive every few seconds from every load balancer: logged at debug.
const quietServices = new Set(["grpc.health.v1.Health"]);

export function rpcObserver(logger: Logger, metrics: LeaseMetrics): Interceptor {
  return (next) => async (req) => {
    const started = performance.now();
    const given = req.header.get(requestIdHeader);
    const requestId = given !== null && requestIdPattern.test(given) ? given : randomUUID();
    req.contextValues.set(requestIdKey, requestId);
    const method = `${req.service.typeName}/${req.method.name}`;
    let recorded = false;
    const record = (code: Code | undefined, error?: ConnectError) => {
      if (recorded) return;
      recorded = true;
      const seconds = (performance.now() - started) / 1000;
      const codeName = code === undefined ? "ok" : codeToString(code);
      metrics.rpcDuration.observe({ method, code: codeName }, seconds);
      const principal = req.contextValues.get(principalKey);
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
      else if (quietServices.has(req.service.typeName)) logger.debug(fields, "rpc");
      else logger.info(fields, "rpc");
    };
    const fail = (error: unknown): ConnectError => {
      const ce = ConnectError.from(error);
      ce.metadata.set(requestIdHeader, requestId);
      record(ce.code, ce);
      return ce;
    };

    let res: Awaited<ReturnType<typeof next>>;
    try {
      res = await next(req);
    } catch (error) {
      throw fail(error);
    }
    res.header.set(requestIdHeader, requestId);
    if (!res.stream) {
      record(undefined);
      return res;
    }
    // A client that leaves, a deadline or a shutdown aborts the call, and the
    // stream may never be finished: record it then, with the abort's code.
    req.signal.addEventListener(
      "abort",
      () => {
        const reason: unknown = req.signal.reason;
        record(reason instanceof ConnectError ? reason.code : Code.Canceled);
      },
      { once: true },
    );
    const source = res.message;
    async function* observed() {
      try {
        yield* source;
        record(undefined);
      } catch (error) {
        throw fail(error);
      } finally {
        // Ended by the client before the server finished.
        record(Code.Canceled);
      }
    }
    return { ...res, message: observed() };
  };
}
