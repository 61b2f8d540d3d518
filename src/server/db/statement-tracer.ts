// Tracing of the batched statements (the group commit's and the renewal
// batcher's): the interface the tracing code (observability/tracing.ts)
// implements, and the one choice every batch makes with it. Off, the tracer
// is undefined and a batch runs its statement plainly; on, a statement that
// decides at least one traced call runs as a span linked to those calls.

/**
 * Traces batched statements (observability/tracing.ts); unset when tracing
 * is off.
 */
export interface StatementTracer {
  /** The traced call whose code runs now, to be linked from the statement that decides it. */
  link(): object | undefined;
  /** Runs one statement of `rows` rows as a span linked to `links` (the calls it decides). */
  statement<T>(
    operation: string,
    links: readonly object[],
    rows: number,
    run: () => Promise<T>,
  ): Promise<T>;
}

/**
 * Runs a batch's statement of `rows` rows, named `operation`: inside a span
 * linked to `links()` (the traced calls it decides) when tracing is on and
 * there are any, else plainly. `links` is asked only when tracing is on.
 */
export function runTraced<T>(
  tracer: StatementTracer | undefined,
  operation: string,
  rows: number,
  links: () => readonly object[],
  run: () => Promise<T>,
): Promise<T> {
  if (tracer === undefined) return run();
  const linked = links();
  return linked.length === 0 ? run() : tracer.statement(operation, linked, rows, run);
}
