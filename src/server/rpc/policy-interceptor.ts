// The Connect adapter of the call policy (call-policy.ts): one interceptor,
// the only one the lease server's router has, that runs the policy around
// every call connect-node serves — Connect, gRPC-Web, and gRPC when the
// native path is off (--grpc-path connect). It moves messages in and out;
// every rule lives in the policy.

import { Code, ConnectError, type Interceptor, type StreamRequest } from "@connectrpc/connect";
import { createAsyncIterable } from "@connectrpc/connect/protocol";
import { requestIdHeader } from "../../protocol/headers.js";
import type { CallPolicy } from "./call-policy.js";
import { policyText } from "./error-texts.js";

/** The protocol a request speaks, from its content type. */
function protocolOf(contentType: string | null): string {
  if (contentType?.startsWith("application/grpc-web")) return "grpc-web";
  if (contentType?.startsWith("application/grpc")) return "grpc";
  return "connect";
}

export function policyInterceptor(policy: CallPolicy): Interceptor {
  return (next) => async (req) => {
    const call = policy.begin({
      service: req.service,
      method: req.method,
      protocol: protocolOf(req.header.get("content-type")),
      header: (name) => req.header.get(name),
    });
    const fail = (error: unknown): ConnectError => {
      const answer = call.end(error);
      return answer ?? ConnectError.from(error);
    };
    const cancelled = new ConnectError(policyText.cancelled, Code.Canceled);
    if (req.stream) {
      // A client that leaves, a deadline or a shutdown aborts the call, and
      // the stream may never be finished: it ends then, with the abort's
      // code, also while its checks are still awaited.
      const aborted = () => {
        const reason: unknown = req.signal.reason;
        call.end(reason instanceof ConnectError ? reason : cancelled);
      };
      if (req.signal.aborted) aborted();
      else req.signal.addEventListener("abort", aborted, { once: true });
    }

    let res: Awaited<ReturnType<typeof next>>;
    try {
      await call.admit();
      if (!req.stream) {
        await call.message(req.message);
        res = await next(req);
      } else if (req.method.methodKind === "server_streaming") {
        // One request message: checked before the handler starts.
        const messages: object[] = [];
        for await (const m of req.message) messages.push(m);
        for (const m of messages) await call.message(m);
        // Ended while its checks were awaited: no handler runs for it.
        if (call.ended) throw cancelled;
        res = await next({ ...req, message: createAsyncIterable(messages) } as StreamRequest);
      } else {
        // Client and bidi streams: every message is checked as it arrives; a
        // refused one ends the stream with its code.
        const source = req.message;
        async function* checked() {
          for await (const m of source) {
            await call.message(m);
            yield m;
          }
        }
        res = await next({ ...req, message: checked() } as StreamRequest);
      }
    } catch (error) {
      throw fail(error);
    }
    res.header.set(requestIdHeader, call.requestId);
    if (!res.stream) {
      call.end();
      return res;
    }
    // The token's expiry ends the stream: the response fails with it, which
    // aborts the handler's signal (its hub subscription ends).
    let expire: (error: ConnectError) => void = () => {};
    const expired = new Promise<never>((_, reject) => {
      expire = reject;
    });
    expired.catch(() => {});
    call.onExpired((error) => expire(error));
    const source = res.message[Symbol.asyncIterator]();
    async function* governed() {
      try {
        for (;;) {
          const r = await Promise.race([source.next(), expired]);
          if (r.done) break;
          yield r.value;
        }
        call.end();
      } catch (error) {
        throw fail(error);
      } finally {
        // Ended by the client before the server finished.
        call.end(cancelled);
      }
    }
    return { ...res, message: governed() };
  };
}
