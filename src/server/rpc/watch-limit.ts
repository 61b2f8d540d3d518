// Open Watch streams per account (DESIGN §7), enforced around the Watch
// handler as an interceptor: a slot is taken when the stream starts and given
// back when it ends, however it ends. Runs after authentication, so the
// account is the caller's.

import type { Interceptor, StreamResponse } from "@connectrpc/connect";
import type { AccountSlots } from "../streams/stream-limits.js";
import { principalKey } from "./auth-interceptor.js";

export function watchLimitInterceptor(serviceName: string, slots: AccountSlots): Interceptor {
  return (next) => async (req) => {
    if (req.service.typeName !== serviceName || req.method.name !== "Watch") return next(req);
    const account = req.contextValues.get(principalKey)?.account;
    // No account: the handler rejects the request as INVALID_ARGUMENT.
    if (account === undefined) return next(req);
    const leave = slots.enter(account);
    // The slot is given back when the call ends, whichever way: its signal
    // aborts on a client that leaves, a deadline or a shutdown, even when
    // nobody finishes the response stream.
    req.signal.addEventListener("abort", leave, { once: true });
    let res: Awaited<ReturnType<typeof next>>;
    try {
      res = await next(req);
    } catch (error) {
      leave();
      throw error;
    }
    if (!res.stream) {
      leave();
      return res;
    }
    const source = res.message;
    async function* held() {
      try {
        yield* source;
      } finally {
        leave();
      }
    }
    return { ...res, message: held() } as StreamResponse;
  };
}
