// Group commit for one kind of statement (DESIGN §3, the unary fast path):
// while a statement of this kind is in flight, new calls queue; when it
// returns, everything queued goes out as ONE multi-row statement. At low
// load a call goes out at once: no timer, no added latency. Under load the
// batch grows with the statement's latency, so the commit rate stays low
// while calls per second rise.
//
// A key appears at most once per statement: `ON CONFLICT DO UPDATE` cannot
// touch a row twice in one statement, and two calls for one key must be
// decided one after the other anyway. A second call for a key already in the
// forming batch waits for the next one, keeping its place in the queue.
//
// Reads (`shareByKey`) are different: calls of one key waiting for the same
// statement all arrived before it was sent, so its one reading of the key is
// a correct answer for each of them, and they share it. A call that arrives
// after a statement was sent waits for the next one, as every call does, so
// it never gets an answer read before it arrived. Without this, N Gets of a
// hot key took N statements one after the other, the queue rescanned for each.
//
// With tracing on (`tracer`), a call's trace context is taken when it joins
// the queue, and each statement is a span linked to every call it decides
// (statement-tracer.ts); off, the tracer is undefined and that is all it
// costs.

import { runTraced, type StatementTracer } from "./statement-tracer.js";

export interface GroupCommitOptions<I, R> {
  /** Runs one statement for `items` (distinct keys); resolves with a result per item, in order. */
  run(items: readonly I[]): Promise<R[]>;
  /** The key an item decides on. */
  keyOf(item: I): string;
  /** Rows per statement; a longer queue goes out over several statements. */
  maxBatch: number;
  /** Statements of this kind in flight at once. */
  maxInFlight: number;
  /** Calls of one key waiting for the same statement share its answer (reads only). */
  shareByKey?: boolean;
  /** Tracing of the statements, named `operation` (unset: tracing off). */
  tracer?: StatementTracer;
  operation?: string;
}

export interface GroupCommitStats {
  /** Statements sent. */
  statements: number;
  /** Items decided (the sum of batch sizes). */
  items: number;
  /** Items waiting for a statement now. */
  queued: number;
  /** Calls answered with another call's row of the same statement (shareByKey). */
  shared: number;
}

export interface GroupCommit<I, R> {
  submit(item: I): Promise<R>;
  readonly stats: GroupCommitStats;
}

interface Queued<I, R> {
  item: I;
  key: string;
  resolve(result: R): void;
  reject(error: unknown): void;
  /** Calls of the same key that share this one's answer (shareByKey). */
  sharing?: Queued<I, R>[];
  /** The call's trace context, when tracing is on and the call is traced. */
  link?: object;
}

export function createGroupCommit<I, R>(options: GroupCommitOptions<I, R>): GroupCommit<I, R> {
  const { run, keyOf, maxBatch, maxInFlight, tracer } = options;
  const operation = options.operation ?? "statement";
  let queue: Queued<I, R>[] = [];
  let inFlight = 0;
  const stats: GroupCommitStats = { statements: 0, items: 0, queued: 0, shared: 0 };

  /** The queue's distinct keys, up to maxBatch; a repeated key rides on its first call. */
  function takeShared(): Queued<I, R>[] {
    const batch: Queued<I, R>[] = [];
    const rest: Queued<I, R>[] = [];
    const first = new Map<string, Queued<I, R>>();
    for (const q of queue) {
      const leader = first.get(q.key);
      if (leader) {
        if (leader.sharing) leader.sharing.push(q);
        else leader.sharing = [q];
      } else if (batch.length < maxBatch) {
        first.set(q.key, q);
        batch.push(q);
      } else {
        rest.push(q);
      }
    }
    queue = rest;
    return batch;
  }

  function take(): Queued<I, R>[] {
    if (options.shareByKey) return takeShared();
    // The common case: the whole queue fits and has no repeated key.
    if (queue.length <= maxBatch) {
      const keys = new Set<string>();
      for (const q of queue) keys.add(q.key);
      if (keys.size === queue.length) {
        const batch = queue;
        queue = [];
        return batch;
      }
    }
    const batch: Queued<I, R>[] = [];
    const rest: Queued<I, R>[] = [];
    const keys = new Set<string>();
    for (const q of queue) {
      if (batch.length < maxBatch && !keys.has(q.key)) {
        keys.add(q.key);
        batch.push(q);
      } else {
        rest.push(q);
      }
    }
    queue = rest;
    return batch;
  }

  function flush(): void {
    while (inFlight < maxInFlight && queue.length > 0) {
      const batch = take();
      stats.queued = queue.length;
      stats.statements += 1;
      stats.items += batch.length;
      inFlight += 1;
      const items = batch.map((q) => q.item);
      runTraced(
        tracer,
        operation,
        items.length,
        () => linksOf(batch),
        () => run(items),
      ).then(
        (results) => {
          inFlight -= 1;
          for (let i = 0; i < batch.length; i++) {
            // run() answers every item; a missing answer is a bug, reported to its caller.
            const q = batch[i] as Queued<I, R>;
            if (i < results.length) {
              q.resolve(results[i] as R);
              for (const s of q.sharing ?? []) s.resolve(results[i] as R);
              stats.shared += q.sharing?.length ?? 0;
            } else {
              const error = new Error(
                "group commit: the statement returned fewer results than items",
              );
              q.reject(error);
              for (const s of q.sharing ?? []) s.reject(error);
            }
          }
          flush();
        },
        (error: unknown) => {
          inFlight -= 1;
          for (const q of batch) {
            q.reject(error);
            for (const s of q.sharing ?? []) s.reject(error);
          }
          flush();
        },
      );
    }
  }

  // Every call a statement decides, the ones sharing an answer included.
  function linksOf(batch: readonly Queued<I, R>[]): object[] {
    const links: object[] = [];
    for (const q of batch) {
      if (q.link) links.push(q.link);
      for (const s of q.sharing ?? []) if (s.link) links.push(s.link);
    }
    return links;
  }

  return {
    stats,
    submit(item) {
      return new Promise<R>((resolve, reject) => {
        const queued: Queued<I, R> = { item, key: keyOf(item), resolve, reject };
        if (tracer !== undefined) queued.link = tracer.link();
        queue.push(queued);
        stats.queued = queue.length;
        flush();
      });
    },
  };
}
