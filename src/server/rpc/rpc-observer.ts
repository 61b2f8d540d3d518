// The Connect adapter's side of the call observer (call-observer.ts): the
// outermost interceptor, so it sees every answer, authentication failures
// included, with the code the error interceptor gave it.

import { Code, ConnectError, createContextKey, type Interceptor } from "@connectrpc/connect";
import { requestIdHeader } from "../../protocol/headers.js";
import { principalKey } from "./auth-interceptor.js";
import type { CallObserver } from "./call-observer.js";

/** The request id of the current call (from x-request-id, else generated). */
export const requestIdKey = createContextKey("", { description: "leasehold request id" });

export function rpcObserver(observer: CallObserver): Interceptor {
  return (next) => async (req) => {
    const call = observer.begin(
      req.service.typeName,
      req.method.name,
      req.header.get(requestIdHeader),
    );
    req.contextValues.set(requestIdKey, call.requestId);
    const record = (code?: Code, error?: ConnectError) => {
      call.principal = req.contextValues.get(principalKey);
      call.end(code, error);
    };
    const fail = (error: unknown): ConnectError => {
      const ce = ConnectError.from(error);
      ce.metadata.set(requestIdHeader, call.requestId);
      record(ce.code, ce);
      return ce;
    };

    let res: Awaited<ReturnType<typeof next>>;
    try {
      res = await next(req);
    } catch (error) {
      throw fail(error);
    }
    res.header.set(requestIdHeader, call.requestId);
    if (!res.stream) {
      record();
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
        record();
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
