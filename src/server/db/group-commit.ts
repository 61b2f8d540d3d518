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

export interface GroupCommitOptions<I, R> {
  /** Runs one statement for `items` (distinct keys); resolves with a result per item, in order. */
  run(items: readonly I[]): Promise<R[]>;
  /** The key an item decides on. */
  keyOf(item: I): string;
  /** Rows per statement; a longer queue goes out over several statements. */
  maxBatch: number;
  /** Statements of this kind in flight at once. */
  maxInFlight: number;
}

export interface GroupCommitStats {
  /** Statements sent. */
  statements: number;
  /** Items decided (the sum of batch sizes). */
  items: number;
  /** Items waiting for a statement now. */
  queued: number;
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
}

export function createGroupCommit<I, R>(options: GroupCommitOptions<I, R>): GroupCommit<I, R> {
  const { run, keyOf, maxBatch, maxInFlight } = options;
  let queue: Queued<I, R>[] = [];
  let inFlight = 0;
  const stats: GroupCommitStats = { statements: 0, items: 0, queued: 0 };

  function take(): Queued<I, R>[] {
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
      run(batch.map((q) => q.item)).then(
        (results) => {
          inFlight -= 1;
          for (let i = 0; i < batch.length; i++) {
            // run() answers every item; a missing answer is a bug, reported to its caller.
            const q = batch[i] as Queued<I, R>;
            if (i < results.length) q.resolve(results[i] as R);
            else
              q.reject(new Error("group commit: the statement returned fewer results than items"));
          }
          flush();
        },
        (error: unknown) => {
          inFlight -= 1;
          for (const q of batch) q.reject(error);
          flush();
        },
      );
    }
  }

  return {
    stats,
    submit(item) {
      return new Promise<R>((resolve, reject) => {
        queue.push({ item, key: keyOf(item), resolve, reject });
        stats.queued = queue.length;
        flush();
      });
    },
  };
}
