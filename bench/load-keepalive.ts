// Load generator for Leasehold's side of scenario 3: the KeepAlive scenario
// of bench/keepalive.ts, run as its own process. That scenario brings its own
// embedded PostgreSQL (with pg_stat_statements, to count renewal batches) and
// server process, and measures their CPU, memory and statements itself.

import { type KeepAliveBenchResult, run } from "./keepalive.js";
import { loadOptions, send } from "./load-protocol.js";

export interface LeaseholdKeepAliveOptions {
  leases: number;
  streams: number;
  ttlMs: number;
  renewEveryMs: number;
  /** 0: each lease every renewEveryMs; above 0: saturation, this many in flight per stream. */
  inflightPerStream: number;
  measureMs: number;
  /** Another checkout's bin/leasehold.js (--server-cli); default this one. */
  serverCli?: string;
}

export type { KeepAliveBenchResult };

const options = loadOptions<LeaseholdKeepAliveOptions>();
const result = await run({
  ...options,
  acquireSeconds: 0,
  log: (line) => process.stderr.write(`${line}\n`),
});
send({ phase: "result", result });
process.exit(0);
