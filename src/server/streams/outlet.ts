// Where a long-lived stream's messages go. A KeepAlive session and a watcher
// hand their messages to one outlet (`pipe`), and that loop — when to take
// what, a snapshot before changes, the end of the stream, what the hub's
// close does, waiting while the consumer does not read — is written once, in
// the hub. The serving paths only supply the outlet: the native gRPC path
// writes frames to its HTTP/2 stream (rpc/native-streams.ts), the Connect
// adapter reads the messages as its handler's async iterable
// (rpc/stream-service.ts).

/** The consumer of one stream's messages. */
export interface Outlet<T> {
  /**
   * Delivers messages, in order. False when the consumer holds as much as
   * it should: nothing more is written until the listener given to
   * `onDrain` is called.
   */
  write(messages: readonly T[]): boolean;
  /** Called once, when the consumer has room again after a write returned false. */
  onDrain(listener: () => void): void;
  /**
   * The stream is over: OK without an error, else with it. Called at most
   * once, also while a write waits for room; what was written before is
   * delivered first.
   */
  end(error?: unknown): void;
}

/**
 * Runs scheduled work in slices of `slice` callbacks: the first once the
 * code that scheduled it is done (a microtask), each further one after a
 * turn of the event loop. Work scheduled twice before it runs runs once.
 */
export function createSliceScheduler(slice: number): (work: () => void) => void {
  const queue = new Set<() => void>();
  let scheduled = false;
  const run = () => {
    let n = 0;
    try {
      for (const work of queue) {
        queue.delete(work);
        work();
        if (++n >= slice) break;
      }
    } finally {
      // A throwing write must not leave every later fan-out unscheduled.
      if (queue.size > 0) setImmediate(run);
      else scheduled = false;
    }
  };
  return (work) => {
    queue.add(work);
    if (!scheduled) {
      scheduled = true;
      queueMicrotask(run);
    }
  };
}
