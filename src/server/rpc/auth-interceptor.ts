// The Connect adapter's side of access control (access.ts): one interceptor
// that checks every LeaseService call, streams included, before any handler
// runs. It throws domain errors; the error interceptor outside it gives them
// their codes.

import { createContextKey, type Interceptor, type StreamRequest } from "@connectrpc/connect";
import { createAsyncIterable } from "@connectrpc/connect/protocol";
import type { Principal } from "../auth/authn.js";
import type { Access } from "./access.js";

/** The authenticated caller of the current call; undefined outside protected services. */
export const principalKey = createContextKey<Principal | undefined>(undefined, {
  description: "leasehold principal",
});

export function authInterceptor(access: Access): Interceptor {
  return (next) => async (req) => {
    if (!access.protects(req.service.typeName)) return next(req);
    const methodName = req.method.name;
    const caller = await access.caller(methodName, req.header.get("authorization"));
    req.contextValues.set(principalKey, caller);
    const check = async (message: object, decided?: Map<string, number>) => {
      const principal = await access.check(methodName, req.method.input, message, caller, decided);
      if (!caller) req.contextValues.set(principalKey, principal);
    };

    if (!req.stream) {
      await check(req.message);
      return await next(req);
    }
    if (req.method.methodKind === "server_streaming") {
      // One request message: check it before the handler starts.
      const messages: object[] = [];
      for await (const m of req.message) messages.push(m);
      for (const m of messages) await check(m);
      return await next({
        ...req,
        message: createAsyncIterable(messages),
      } as StreamRequest);
    }
    // Client and bidi streams: every message is checked as it arrives; a
    // denied one ends the stream with its code.
    const decided = new Map<string, number>();
    const source = req.message;
    async function* checked() {
      for await (const m of source) {
        await check(m, decided);
        yield m;
      }
    }
    return await next({ ...req, message: checked() } as StreamRequest);
  };
}
