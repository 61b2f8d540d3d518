// One group of scenario 4's watchers, in a process of its own (started by
// load-watch.ts, which drives the releases and reads the results). Watches
// `accountId` from `watchers` streams over `connections` HTTP/2 connections
// through the client library, and notes when each RELEASED arrives, on the
// machine's clock so the driver can compare it with its own.
//
// Lines on stdout: {"type":"ready"} once every watcher has its snapshot,
// {"type":"complete","session":S} once every watcher of the group has S's
// RELEASED, and {"type":"result",…} after the driver writes "stop" on stdin.

import { setMaxListeners } from "node:events";
import { createLeaseClient } from "../src/client/index.js";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { epochMs } from "./load-protocol.js";

export interface WatcherGroupOptions {
  urls: string[];
  watchers: number;
  connections: number;
  accountId: string;
}

export interface WatcherGroupResult {
  type: "result";
  /** Per released session: when each watcher of the group had it (ms since the epoch). */
  receipts: [string, number[]][];
  /** Snapshots after the first: the server could not vouch for the stream. */
  resyncs: number;
  errors: number;
  firstError?: string;
}

export type WatcherGroupMessage =
  | { type: "ready" }
  | { type: "failed"; error: string }
  | { type: "complete"; session: string }
  | WatcherGroupResult;

const say = (message: WatcherGroupMessage) => process.stdout.write(`${JSON.stringify(message)}\n`);

async function main(): Promise<void> {
  const options = JSON.parse(process.argv[2] ?? "") as WatcherGroupOptions;
  const clients = Array.from({ length: options.connections }, (_, i) =>
    createLeaseClient({
      baseUrl: options.urls[i % options.urls.length] as string,
      protocol: "grpc",
    }),
  );
  const stop = new AbortController();
  setMaxListeners(options.watchers + 10, stop.signal);
  const receipts = new Map<string, number[]>();
  let resyncs = 0;
  let errors = 0;
  let firstError: string | undefined;
  let subscribed = 0;

  const watch = async (i: number) => {
    const client = clients[i % clients.length] as (typeof clients)[number];
    let snapshots = 0;
    try {
      for await (const res of client.watch(
        { key: { accountId: options.accountId, sessionId: "" } },
        { signal: stop.signal },
      )) {
        const now = epochMs();
        if (res.kind.case === "snapshot") {
          if (snapshots++ === 0 && ++subscribed === options.watchers) say({ type: "ready" });
          else if (snapshots > 1) resyncs++;
          continue;
        }
        const event = res.kind.case === "event" ? res.kind.value : undefined;
        if (event?.type !== EventType.RELEASED) continue;
        const session = event.key?.sessionId ?? "";
        let times = receipts.get(session);
        if (!times) {
          times = [];
          receipts.set(session, times);
        }
        times.push(now);
        if (times.length === options.watchers) say({ type: "complete", session });
      }
    } catch (error) {
      if (stop.signal.aborted) return;
      // A watcher refused before its snapshot (a limit, say) would leave the
      // driver waiting for the group forever.
      if (snapshots === 0) say({ type: "failed", error: String(error) });
      errors++;
      firstError ??= String(error);
    }
  };
  const watches = Array.from({ length: options.watchers }, (_, i) => watch(i));

  process.stdin.once("data", async () => {
    stop.abort();
    await Promise.all(watches);
    // Hundreds of kB: exit once the pipe has taken all of it.
    const result: WatcherGroupMessage = {
      type: "result",
      receipts: [...receipts],
      resyncs,
      errors,
      firstError,
    };
    process.stdout.write(`${JSON.stringify(result)}\n`, () => process.exit(0));
  });
}

await main();
