// Keeps an AccountView current: List for the authoritative state, then
// Watch (server streaming, which browsers can do over the Connect protocol)
// for every change. When the stream fails or ends (a server restart, a
// network change) it lists again and re-watches, backing off up to 5 s.

import { Code, ConnectError } from "@connectrpc/connect";
import type { Lease } from "../../src/gen/leasehold/v1/lease_pb.js";
import type { AccountView } from "./account-view.js";
import { describeError, type LeaseClient } from "./api.js";

export type FeedStatus =
  | { kind: "connecting" }
  /** List answered; the Watch stream is being opened. */
  | { kind: "listed" }
  /** Listed, and the Watch stream is open. */
  | { kind: "live" }
  /** The last attempt failed with `code`; the next one starts at `retryAt` (performance.now()). */
  | { kind: "retrying"; code: Code; message: string; retryAt: number };

export interface FeedOptions {
  client: LeaseClient;
  accountId: string;
  view: AccountView;
  /** Called after every change of the view or of the status. */
  onChange: (status: FeedStatus) => void;
  signal: AbortSignal;
}

const pageSize = 500;
const firstBackoffMs = 500;
const maxBackoffMs = 5000;

export async function runAccountFeed(options: FeedOptions): Promise<void> {
  const { client, accountId, view, onChange, signal } = options;
  let backoff = firstBackoffMs;
  while (!signal.aborted) {
    onChange({ kind: "connecting" });
    let error: unknown;
    try {
      view.replace(await listAll(client, accountId, signal), performance.now());
      onChange({ kind: "listed" });
      const stream = client.watch(
        { key: { accountId, sessionId: "" }, includeRenewals: true },
        { signal },
      );
      let first = true;
      for await (const message of stream) {
        const now = performance.now();
        if (message.kind.case === "snapshot") view.replace(message.kind.value.leases, now);
        else if (message.kind.case === "event") view.apply(message.kind.value, now);
        if (first) {
          // The stream answered: the next failure starts over with a short wait.
          first = false;
          backoff = firstBackoffMs;
        }
        onChange({ kind: "live" });
      }
      error = new ConnectError("the server ended the stream", Code.Unavailable);
    } catch (e) {
      error = e;
    }
    if (signal.aborted) return;
    const ce = ConnectError.from(error);
    onChange({
      kind: "retrying",
      code: ce.code,
      message: describeError(ce),
      retryAt: performance.now() + backoff,
    });
    await sleep(backoff, signal);
    backoff = Math.min(backoff * 2, maxBackoffMs);
  }
}

async function listAll(
  client: LeaseClient,
  accountId: string,
  signal: AbortSignal,
): Promise<Lease[]> {
  const leases: Lease[] = [];
  let pageToken = "";
  do {
    const page = await client.list({ accountId, pageSize, pageToken }, { signal });
    leases.push(...page.leases);
    pageToken = page.nextPageToken;
  } while (pageToken !== "");
  return leases;
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
    function done() {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    }
  });
}

/**
 * Loads the recent audit trail of one session into the view (History, one
 * page). A failure leaves the view as it was: the live feed does not depend
 * on it, and its error is the caller's to show or ignore.
 */
export async function loadHistory(
  client: LeaseClient,
  key: { accountId: string; sessionId: string },
  view: AccountView,
  signal?: AbortSignal,
): Promise<void> {
  const answer = await client.history({ key, pageSize: historyPageSize }, { signal });
  view.addHistory(answer.events);
}

const historyPageSize = 20;
