// The Connect adapter of the call policy (call-policy.ts): one interceptor,
// the only one the lease server's and the guarded store's routers have, that runs the policy around
// every call connect-node serves — Connect, gRPC-Web, and gRPC when the
// native path is off (--grpc-path connect). It moves messages in and out;
// every rule lives in the policy.
//
// connect-node reads a unary request's body whole before any interceptor
// runs, so the caller is authenticated earlier, from the headers, where the
// request enters (`policyGate`, which src/host/rpc-entry.ts runs before the
// adapter sees the request): a refused call's body is never read. The
// interceptor's call then starts from that admission.

import {
  Code,
  ConnectError,
  type ContextValues,
  createContextKey,
  createContextValues,
  type Interceptor,
  type StreamRequest,
} from "@connectrpc/connect";
import { createAsyncIterable } from "@connectrpc/connect/protocol";
import { requestIdHeader } from "../protocol/headers.js";
import type { Admission, CallPolicy, CallStart, PolicyCall } from "./call-policy.js";
import {
  clientCertificateKey,
  clientCertificateOfRequest,
  type NodeRequest,
} from "./client-certificate-context.js";
import { policyText } from "./error-texts.js";

/** The protocol a request speaks, from its content type. */
function protocolOf(contentType: string | null): string {
  if (contentType?.startsWith("application/grpc-web")) return "grpc-web";
  if (contentType?.startsWith("application/grpc")) return "grpc";
  return "connect";
}

/**
 * The call policy's message check, for a handler that checks each request
 * itself (PolicyCall.checkedByHandler); undefined for every other call.
 */
export const requestCheckKey = createContextKey<
  ((message: object) => void | Promise<void>) | undefined
>(undefined, { description: "leasehold request check" });

const admissionKey = createContextKey<Admission | undefined>(undefined, {
  description: "leasehold call admission",
});

/**
 * Authenticates a call from its request headers, before its body is read:
 * resolves with the context values its handler starts with (the admission,
 * which the interceptor's call takes over), or rejects with the refusal the
 * caller is answered with.
 */
export function policyGate(
  policy: CallPolicy,
): (
  init: Omit<CallStart, "protocol" | "certificate"> & { request: NodeRequest },
) => Promise<ContextValues> {
  return async ({ request, ...init }) => {
    const certificate = clientCertificateOfRequest(request);
    const admission = await policy.authenticate({
      ...init,
      protocol: protocolOf(init.header("content-type")),
      certificate: () => certificate,
    });
    const values = createContextValues();
    values.set(admissionKey, admission);
    values.set(clientCertificateKey, certificate);
    return values;
  };
}

export function policyInterceptor(policy: CallPolicy): Interceptor {
  return (next) => async (req) => {
    const call = policy.begin({
      service: req.service,
      method: req.method,
      protocol: protocolOf(req.header.get("content-type")),
      header: (name) => req.header.get(name),
      certificate: () => req.contextValues.get(clientCertificateKey),
      admission: req.contextValues.get(admissionKey),
    });
    const fail = (error: unknown): ConnectError => {
      const answer = call.end(error);
      return answer ?? ConnectError.from(error);
    };
    // Made only for a stream that ends cancelled: a unary call never needs it.
    let cancelledOnce: ConnectError | undefined;
    const cancelled = () =>
      (cancelledOnce ??= new ConnectError(policyText.cancelled, Code.Canceled));
    if (req.stream) {
      // A client that leaves, a deadline or a shutdown aborts the call, and
      // the stream may never be finished: it ends then, with the abort's
      // code, also while its checks are still awaited.
      const aborted = () => {
        const reason: unknown = req.signal.reason;
        call.end(reason instanceof ConnectError ? reason : cancelled());
      };
      if (req.signal.aborted) aborted();
      else req.signal.addEventListener("abort", aborted, { once: true });
    }

    let res: Awaited<ReturnType<typeof next>>;
    try {
      await call.admit();
      if (!req.stream) {
        await call.message(req.message);
        res = await call.run(() => next(req));
      } else if (req.method.methodKind === "server_streaming") {
        // One request message: checked before the handler starts.
        const messages: object[] = [];
        for await (const m of req.message) messages.push(m);
        for (const m of messages) await call.message(m);
        // Ended while its checks were awaited: no handler runs for it.
        if (call.ended) throw cancelled();
        res = await call.run(() =>
          next({ ...req, message: createAsyncIterable(messages) } as StreamRequest),
        );
      } else if (call.checkedByHandler) {
        // The handler checks each message and answers a refused one itself.
        req.contextValues.set(requestCheckKey, (m: object) => call.message(m));
        res = await call.run(() => next(req));
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
        res = await call.run(() => next({ ...req, message: checked() } as StreamRequest));
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
    const source = untilExpired(res.message, call, req.signal, cancelled());
    async function* governed() {
      try {
        yield* source;
        call.end();
      } catch (error) {
        throw fail(error);
      } finally {
        // Ended by the client before the server finished.
        call.end(cancelled());
      }
    }
    return { ...res, message: governed() };
  };
}

/**
 * The response messages of `source` until the call's token expires; then a
 * pending or later read fails with the expiry. Each read runs through the
 * policy's `run` (a stream handler's code runs when its messages are read,
 * so that is where it joins the call's trace). One promise per message and
 * nothing kept per message (a race against one long-lived promise would
 * keep a reaction per message until the stream ends).
 */
function untilExpired<T>(
  source: AsyncIterable<T>,
  call: PolicyCall,
  signal: AbortSignal,
  cancelled: ConnectError,
): AsyncIterable<T> {
  const it = source[Symbol.asyncIterator]();
  // Made once: no function per message.
  const read = () => it.next();
  let expired: ConnectError | undefined;
  let rejectPending: ((error: unknown) => void) | undefined;
  call.onExpired((error) => {
    expired = error;
    rejectPending?.(error);
  });
  // A call that ends while the handler is suspended at a message nobody
  // reads (its client left) still finishes the handler, so that what it
  // holds (a watcher, a KeepAlive session) is given back. A handler busy
  // with a read ends by its own signal, with that signal's code (e.g. a
  // shutdown's UNAVAILABLE): returning it early would end the stream OK.
  call.onEnd(() => {
    if (rejectPending === undefined) void it.return?.()?.catch(() => {});
  });
  const iterator: AsyncIterator<T> = {
    next: () => {
      if (expired) return Promise.reject(expired);
      // Aborted (client gone, deadline, shutdown): the stream ends with the
      // abort's code, not as if the handler had finished.
      if (signal.aborted) {
        const reason: unknown = signal.reason;
        return Promise.reject(reason instanceof ConnectError ? reason : cancelled);
      }
      return new Promise<IteratorResult<T>>((resolve, reject) => {
        rejectPending = reject;
        call.run(read).then(
          (r) => {
            rejectPending = undefined;
            resolve(r);
          },
          (error: unknown) => {
            rejectPending = undefined;
            reject(error);
          },
        );
      });
    },
    return: (value?: unknown) => {
      // Not awaited: a read still pending in the handler ends with its signal.
      void it.return?.(value)?.catch(() => {});
      return Promise.resolve({ done: true, value: value as T });
    },
  };
  return { [Symbol.asyncIterator]: () => iterator };
}
