// A Leasehold worker in TypeScript that holds several sessions' leases on one
// keeper (docs/keepers.md): one heartbeat keeps them all, their acquires and
// releases ride the keeper's one stream, and every run stops the moment the
// keeper can no longer be vouched for (DESIGN.md, L2). Each step is one JSON
// object per line on stdout.
//
//     npx tsx examples/typescript/keeper.ts --account acme --sessions shard-1,shard-2,shard-3
//
// Flags: --server URL (repeat for several instances; default LEASEHOLD_SERVER
// or http://127.0.0.1:7070), --token JWT (default LEASEHOLD_TOKEN), --ttl MS
// (default 10000), --lock-delay MS (default 0), --work MS (how long each run
// works; default 3000). Outside this repository the import is
// `@leasehold/client` (npm pack ./packages/client).

import { parseArgs } from "node:util";
import {
  createLeaseClient,
  type LeaseLostError,
  NotAcquiredError,
} from "../../src/client/index.js";

const { values } = parseArgs({
  options: {
    server: { type: "string", multiple: true },
    token: { type: "string" },
    account: { type: "string" },
    sessions: { type: "string" },
    ttl: { type: "string", default: "10000" },
    "lock-delay": { type: "string", default: "0" },
    work: { type: "string", default: "3000" },
  },
});
const say = (event: Record<string, unknown>) =>
  process.stdout.write(
    `${JSON.stringify(event, (_k, v) => (typeof v === "bigint" ? v.toString() : v))}\n`,
  );

const accountId = values.account;
const sessions = values.sessions?.split(",").filter((s) => s !== "") ?? [];
if (accountId === undefined || sessions.length === 0) {
  process.stderr.write("usage: keeper.ts --account A --sessions S1,S2,… [--server URL]\n");
  process.exit(2);
}

const leases = createLeaseClient({
  baseUrls: values.server ?? [process.env.LEASEHOLD_SERVER ?? "http://127.0.0.1:7070"],
  token: values.token ?? process.env.LEASEHOLD_TOKEN,
  onEvent: (event) => {
    if (event.type === "keeper-failed")
      say({ event: "keeper-stream-failed", error: event.error.message });
  },
});

const keeper = await leases.openKeeper({
  accountId,
  ttlMs: Number(values.ttl),
  lockDelayMs: Number(values["lock-delay"]),
  holder: `example-${process.pid}`,
});
say({ event: "keeper-open", keeperId: keeper.id, remainingMs: Math.round(keeper.remainingMs()) });
// Ctrl-C: close the keeper, which stops every run and releases every lease.
process.once("SIGINT", () => void keeper.close());

const workMs = Number(values.work);
const results = await Promise.allSettled(
  sessions.map((sessionId) =>
    keeper.runExclusive({ accountId, sessionId }, async ({ signal, fencingToken, runId }) => {
      say({ event: "held", sessionId, runId, fencingToken });
      // The work: anything that honours `signal`, and presents `fencingToken`
      // with every write to a guarded resource (ctx.headers(), ctx.callOptions()).
      await new Promise<void>((resolve) => {
        const done = setTimeout(resolve, workMs);
        signal.addEventListener("abort", () => {
          clearTimeout(done);
          resolve();
        });
      });
      if (signal.aborted) {
        const reason = signal.reason as LeaseLostError;
        say({ event: "lost", sessionId, reason: reason.lossReason, message: reason.message });
        return "lost";
      }
      say({ event: "done", sessionId });
      return "done";
    }),
  ),
);
for (const [i, result] of results.entries()) {
  if (result.status === "rejected") {
    const error = result.reason as Error;
    say({
      event: "not-acquired",
      sessionId: sessions[i],
      message: error.message,
      lockDelayUntil:
        error instanceof NotAcquiredError ? error.lockDelayUntil?.toISOString() : undefined,
    });
  }
}
await keeper.close();
say({ event: "keeper-closed", keeperId: keeper.id });
leases.close();
