// The page's live view of an account (web/src/account-feed.ts) run in Node
// against real servers: List, then Watch, and both again after the server
// it talks to goes away and comes back.

import { describe, expect, it } from "vitest";
import { EventType } from "../src/gen/leasehold/v1/lease_pb.js";
import { type FeedStatus, loadHistory, runAccountFeed } from "../web/src/account-feed.js";
import { AccountView } from "../web/src/account-view.js";
import { createLeaseClient } from "../web/src/api.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { ms } from "./support/streams.js";

const { server: other, connect: api, startServer } = useTestServer();

describe("the page's account feed", () => {
  it("L1: after its server restarts, the feed lists and watches again: a grant made meanwhile appears, later ones stream in", async () => {
    let server = await startServer();
    const port = server.port;
    const view = new AccountView();
    const statuses: FeedStatus["kind"][] = [];
    const waiters = new Set<() => void>();
    const until = (predicate: () => boolean) =>
      new Promise<void>((resolve) => {
        const check = () => {
          if (!predicate()) return;
          waiters.delete(check);
          resolve();
        };
        waiters.add(check);
        check();
      });
    const stop = new AbortController();
    const { accountId } = freshKey();
    const feed = runAccountFeed({
      client: createLeaseClient(server.url, () => ""),
      accountId,
      view,
      signal: stop.signal,
      onChange: (status) => {
        statuses.push(status.kind);
        for (const wake of waiters) wake();
      },
    });
    try {
      await until(() => statuses.at(-1) === "live");

      await server.close();
      await until(() => statuses.at(-1) === "retrying");
      // Made through another instance while the feed's server is away.
      const meanwhile = await api.acquire({
        key: { accountId, sessionId: "meanwhile" },
        ttl: { seconds: 60n },
        holder: "desktop",
      });
      server = await startServer(["--listen", `127.0.0.1:${port}`]);
      await until(() => view.sessions.has("meanwhile") && statuses.at(-1) === "live");
      expect(view.sessions.get("meanwhile")?.lease.runId).toBe(meanwhile.lease?.runId);

      const later = await api.acquire({
        key: { accountId, sessionId: "later" },
        ttl: { seconds: 60n },
        holder: "phone",
      });
      await until(() => view.sessions.has("later"));
      expect(view.sessions.get("later")?.lease.runId).toBe(later.lease?.runId);
      expect(view.transitions[0]?.sessionId).toBe("later");
    } finally {
      stop.abort();
      await feed;
      await server.close();
    }
  });

  it("a page opened after a session's runs shows them, from History, newest first", async () => {
    const key = freshKey("history");
    const first = await api.acquire({ key, ttl: ms(30_000), holder: "desktop" });
    await api.release({ key, runId: first.lease?.runId ?? "" });
    const second = await api.acquire({ key, ttl: ms(30_000), holder: "browser" });
    const view = new AccountView();
    await loadHistory(
      createLeaseClient(other.url, () => ""),
      key,
      view,
    );
    expect(view.transitions.map((t) => [EventType[t.type], t.runId, t.holder])).toEqual([
      ["ACQUIRED", second.lease?.runId, "browser"],
      ["RELEASED", first.lease?.runId, "desktop"],
      ["ACQUIRED", first.lease?.runId, "desktop"],
    ]);
  });
});
