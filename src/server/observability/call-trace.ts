// The traced call whose code is running, for the batched statements its
// requests join (observability/tracing.ts): an AsyncLocalStorage, entered
// only when tracing is on. Apart from tracing.ts so that what imports it
// (the change feed) loads none of the OpenTelemetry SDK.

import { AsyncLocalStorage } from "node:async_hooks";
import type { SpanContext } from "@opentelemetry/api";

// One for the process: a server without tracing never enters it.
const callSpan = new AsyncLocalStorage<SpanContext>();
let entered = false;

/** Runs `work` as part of the call whose span has `context`. */
export function withinCall<T>(context: SpanContext, work: () => T): T {
  entered = true;
  return callSpan.run(context, work);
}

/** The span context of the call whose code is running, if traced. */
export function currentCall(): SpanContext | undefined {
  return callSpan.getStore();
}

/**
 * Calls `work(arg)` outside any call (a change committed by one call that
 * wakes another call's waiting Acquire must not link that attempt to the
 * first). Without tracing in the process, it only calls it.
 */
export function outsideCalls<A>(work: (arg: A) => void, arg: A): void {
  if (entered) callSpan.exit(work, arg);
  else work(arg);
}
