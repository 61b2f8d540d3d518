// One replica of a service that must run on exactly one replica at a time
// (a scheduler, a cron, a compactor): it campaigns in an election, does the
// leader's work while it leads — every write fenced with the term — and
// campaigns again when its term ends. Start it three times and stop the
// leader (Ctrl-C, kill -STOP, a cut network): another one takes over, with
// a higher term, only after the old one has stopped acting.
//
//   npx tsx examples/typescript/election.ts --server http://127.0.0.1:7070 --name replica-1
//
// In your own project, import from "@leasehold/client" instead.

import { setTimeout as sleep } from "node:timers/promises";
import { parseArgs } from "node:util";
import {
  createLeaseClient,
  type Leadership,
  LeaseLostError,
  runElection,
} from "../../src/client/index.js";

const { values } = parseArgs({
  options: {
    server: { type: "string", multiple: true, default: ["http://127.0.0.1:7070"] },
    account: { type: "string", default: "acme" },
    election: { type: "string", default: "scheduler" },
    name: { type: "string", default: `replica-${process.pid}` },
  },
});

const client = createLeaseClient({
  baseUrls: values.server,
  token: process.env.LEASEHOLD_TOKEN, // a JWT for the account, when the servers require one
});
const stop = new AbortController();
process.once("SIGINT", () => stop.abort());
process.once("SIGTERM", () => stop.abort());

/** The leader's work: runs until the term ends, and never past it. */
async function lead(leadership: Leadership): Promise<void> {
  while (!leadership.signal.aborted) {
    // A write to a fenced resource carries the term: leadership.headers()
    // for a plain HTTP call, leadership.callOptions() for a Connect client
    // with fencingInterceptor(). Both throw once the term is over (L2).
    let headers: Headers;
    try {
      headers = leadership.headers();
    } catch (error) {
      // The term ended before its signal said so (the local deadline
      // passed while this process could not run): campaign again.
      if (error instanceof LeaseLostError) return;
      throw error;
    }
    console.log(`${values.name}: tick as leader, term ${headers.get("leasehold-fencing-token")}`);
    await sleep(1_000, undefined, { signal: leadership.signal }).catch(() => undefined);
  }
}

await runElection(
  client,
  {
    accountId: values.account,
    election: values.election,
    value: values.name,
    ttlMs: 5_000,
    onStartedLeading: (term) => console.log(`${values.name}: leading, term ${term}`),
    // Called exactly once per term, whatever ended it; before a successor
    // can be granted, unless an operator revoked the term (fences refuse
    // the old term then).
    onStoppedLeading: (term, reason) =>
      console.log(`${values.name}: stopped leading term ${term} (${reason.kind})`),
    onNewLeader: (leader) =>
      console.log(`${values.name}: the leader is ${leader.value}, term ${leader.term}`),
  },
  lead,
  { signal: stop.signal },
);
client.close();
