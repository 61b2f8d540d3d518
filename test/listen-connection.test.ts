// The self-healing LISTEN connection of the notification channel
// (streams/listen-connection.ts, DESIGN §3, L1) on a real PostgreSQL: it hands
// on what is published on its channel, keeps the echoes of its own pings to
// itself, and replaces a connection whose socket goes silent without closing
// (the case postgres.js never notices), so the instance hears changes again.
// The silent socket is a TCP proxy that holds every byte; the pings go
// straight to the database, as the publishing connection sends them.

import { randomUUID } from "node:crypto";
import { describe, expect, it } from "vitest";
import { createLogger } from "../src/log/logger.js";
import {
  createListenConnection,
  type ListenConnection,
  type ListenStats,
} from "../src/server/streams/listen-connection.js";
import { useTestDatabase } from "./support/fixture.js";
import { startTcpProxy } from "./support/tcp-proxy.js";
import { waitFor } from "./support/wait.js";

const { db, defer } = useTestDatabase();

interface Listening {
  connection: ListenConnection;
  stats: ListenStats;
  payloads: string[];
  pingsSent: string[];
  events: ("listening" | "lost")[];
  publish(payload: string): Promise<void>;
}

async function listen(url: string, pingIntervalMs: number): Promise<Listening> {
  const channel = `listen_test_${randomUUID().replaceAll("-", "")}`;
  const publish = async (payload: string) => {
    await db.sql`SELECT pg_notify(${channel}, ${payload})`;
  };
  const stats: ListenStats = { reconnects: 0, listenFailures: 0, listening: false };
  const payloads: string[] = [];
  const pingsSent: string[] = [];
  const events: ("listening" | "lost")[] = [];
  const connection = createListenConnection({
    url,
    channel,
    logger: createLogger({ level: "silent" }),
    pingIntervalMs,
    pingPayload: (nonce) => `ping ${nonce}`,
    sendPing: async (payload) => {
      pingsSent.push(payload);
      await publish(payload);
    },
    stats,
  });
  defer(() => connection.close());
  await connection.start({
    onPayload: (payload) => payloads.push(payload),
    onListening: () => events.push("listening"),
    onConnectionLost: () => events.push("lost"),
  });
  return { connection, stats, payloads, pingsSent, events, publish };
}

describe("L1: the LISTEN connection of the notification channel", () => {
  it("hands on every payload published on its channel, not its ping echoes, and keeps a connection that answers", async () => {
    const l = await listen(db.url, 50);
    expect(l.stats.listening).toBe(true);
    await l.publish("first");
    // A ping goes out only after the echo of the one before came back (or
    // 5 s passed): four within 4 s means the echoes arrive.
    await waitFor(() => l.pingsSent.length >= 4, {
      what: "four pings, each after the echo of the one before",
      timeoutMs: 4_000,
    });
    await l.publish("second");
    await waitFor(() => l.payloads.includes("second"), { what: "the second payload" });
    expect(l.payloads).toEqual(["first", "second"]);
    expect(l.stats).toEqual({ reconnects: 0, listenFailures: 0, listening: true });
    expect(l.events).toEqual(["listening"]);
  });

  it("replaces a connection that goes silent without closing, and hears the channel again", async () => {
    const proxy = await startTcpProxy(`http://${new URL(db.url).host}`);
    defer(() => proxy.close());
    const proxied = new URL(db.url);
    proxied.host = new URL(proxy.url).host;
    const l = await listen(proxied.toString(), 200);
    await l.publish("before");
    await waitFor(() => l.payloads.includes("before"), { what: "the payload before the stall" });

    // The socket stays open, but nothing comes through: only the unanswered
    // ping can tell.
    proxy.stall();
    await waitFor(() => l.events.includes("lost"), {
      what: "the silent connection given up after an unanswered ping",
    });
    expect(l.stats.listening).toBe(false);
    expect(l.stats.reconnects).toBe(1);
    await l.publish("while deaf");

    proxy.pass();
    await waitFor(() => l.stats.listening, { what: "LISTEN in place again" });
    expect(l.events).toEqual(["listening", "lost", "listening"]);
    await l.publish("after");
    await waitFor(() => l.payloads.includes("after"), { what: "the payload after the repair" });
    // What was published while nobody listened is gone (the receivers
    // resynchronise on onListening instead), and nothing came twice.
    expect(l.payloads).toEqual(["before", "after"]);
    expect(l.payloads.some((p) => p.startsWith("ping "))).toBe(false);
  });
});
