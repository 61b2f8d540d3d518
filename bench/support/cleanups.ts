// What a benchmark command started (PostgreSQL, servers, etcd), stopped in
// reverse order at the end or on SIGINT/SIGTERM, so an interrupted run
// leaves no process behind.

export interface Cleanups {
  /** Registers how to stop something just started. */
  push(stop: () => Promise<void>): void;
  /** Stops everything registered, newest first; a failing stop does not keep the others. */
  run(): Promise<void>;
}

/** A cleanup stack; on a signal it logs `interrupted: stopping …` with `what`, runs, and exits 130. */
export function cleanupsOnSignal(log: (line: string) => void, what: string): Cleanups {
  const stops: (() => Promise<void>)[] = [];
  const run = async () => {
    for (const stop of stops.splice(0).reverse()) await stop().catch(() => {});
  };
  const onSignal = () => {
    log(`interrupted: stopping ${what}`);
    void run().then(() => process.exit(130));
  };
  process.once("SIGINT", onSignal);
  process.once("SIGTERM", onSignal);
  return { push: (stop) => void stops.push(stop), run };
}
