// Limits answered with RESOURCE_EXHAUSTED and a clear message (DESIGN §7):
// message size, concurrent streams per connection, the per-account lease
// quota (exact when acquires come one at a time, and within its documented
// overshoot when they race), and the stream limits' enforcement API.

import http2 from "node:http2";
import net from "node:net";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import { beforeAll, describe, expect, it } from "vitest";
import { createAccountSlots } from "../src/call/account-slots.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { LimitName } from "../src/protocol/errors.js";
import type { RunningServer } from "../src/server/server.js";
import { createStreamLeases } from "../src/server/streams/stream-limits.js";
import { failure, seconds } from "./support/calls.js";
import { useTestServer } from "./support/fixture.js";
import { storedState, untilExpired } from "./support/leases.js";
import { FLAG, FRAME, h2Frame, headerBlock, preface, readFrames } from "./support/raw-http2.js";
import { connectClient, grpcClient, type LeaseClient } from "./support/server.js";

const quota = 5;

/** The LIMIT_EXCEEDED detail of a RESOURCE_EXHAUSTED: the bound it names and its value. */
function limitOf(error: ConnectError) {
  const info = error.findDetails(ErrorInfoSchema).find((d) => d.reason === "LIMIT_EXCEEDED");
  return info && { limit: info.metadata.limit, max: info.metadata.max };
}
const { db, client, startServer, startGuardedServer } = useTestServer({
  args: ["--max-leases-per-account", String(quota), "--max-message-bytes", "4096"],
});

describe("message size", () => {
  it("a request above --max-message-bytes is RESOURCE_EXHAUSTED and changes nothing", async () => {
    const before = await storedState(db.sql);
    const error = await failure(
      client.acquire({
        key: { accountId: "big", sessionId: "s" },
        ttl: seconds(10),
        holder: "h".repeat(8000),
      }),
    );
    expect(error.code).toBe(Code.ResourceExhausted);
    expect(error.rawMessage).toMatch(/message size .* is larger than configured readMaxBytes 4096/);
    expect(await storedState(db.sql)).toEqual(before);
  });
});

describe("per-account lease quota", () => {
  it("S1: the quota-th lease is granted, the next is refused; a retry and a takeover still pass; an end frees a slot", async () => {
    const accountId = "quota-seq";
    const key = (i: number) => ({ accountId, sessionId: `s${i}` });
    const runs: string[] = [];
    for (let i = 0; i < quota; i++) {
      const a = await client.acquire({ key: key(i), ttl: seconds(60) });
      expect(a.acquired).toBe(true);
      runs.push(a.lease?.runId ?? "");
    }
    const refused = await failure(client.acquire({ key: key(quota), ttl: seconds(60) }));
    expect(refused.code).toBe(Code.ResourceExhausted);
    expect(refused.rawMessage).toMatch(
      /holds 5 leases, the most its quota \(--max-leases-per-account\) allows/,
    );
    expect(limitOf(refused)).toEqual({ limit: "max-leases-per-account", max: "5" });
    // An idempotent retry of a held lease is not a new lease.
    const retry = await client.acquire({ key: key(0), runId: runs[0], ttl: seconds(60) });
    expect(retry.acquired).toBe(true);
    // Another account is not affected.
    expect(
      (
        await client.acquire({
          key: { accountId: "quota-other", sessionId: "s" },
          ttl: seconds(60),
        })
      ).acquired,
    ).toBe(true);
    await client.release({ key: key(1), runId: runs[1] ?? "" });
    expect((await client.acquire({ key: key(quota), ttl: seconds(60) })).acquired).toBe(true);
  });

  it("an expired lease no longer counts", async () => {
    const accountId = "quota-exp";
    for (let i = 0; i < quota - 1; i++) {
      await client.acquire({ key: { accountId, sessionId: `s${i}` }, ttl: seconds(60) });
    }
    const short = { accountId, sessionId: "short" };
    await client.acquire({ key: short, ttl: create(DurationSchema, { nanos: 100_000_000 }) });
    const refused = await failure(
      client.acquire({ key: { accountId, sessionId: "x" }, ttl: seconds(60) }),
    );
    expect(refused.code).toBe(Code.ResourceExhausted);
    await untilExpired(db.sql, short);
    expect(
      (await client.acquire({ key: { accountId, sessionId: "x" }, ttl: seconds(60) })).acquired,
    ).toBe(true);
  });

  it("racing acquires overshoot by at most one lease per concurrent acquire, and nothing passes after", async () => {
    const accountId = "quota-race";
    const racers = 12;
    const results = await Promise.allSettled(
      Array.from({ length: racers }, (_, i) =>
        client.acquire({ key: { accountId, sessionId: `r${i}` }, ttl: seconds(60) }),
      ),
    );
    const granted = results.filter((r) => r.status === "fulfilled" && r.value.acquired).length;
    const refused = results.filter(
      (r) => r.status === "rejected" && ConnectError.from(r.reason).code === Code.ResourceExhausted,
    ).length;
    expect(granted + refused).toBe(racers);
    expect(granted).toBeGreaterThanOrEqual(quota);
    expect(granted).toBeLessThanOrEqual(quota + racers - 1);
    const later = await failure(
      client.acquire({ key: { accountId, sessionId: "late" }, ttl: seconds(60) }),
    );
    expect(later.code).toBe(Code.ResourceExhausted);
  });
});

describe("concurrent streams per connection", () => {
  let narrow: RunningServer;
  beforeAll(async () => {
    narrow = await startServer(["--max-streams-per-connection", "2"]);
  });

  it("the server advertises --max-streams-per-connection; a peer that opens more gets REFUSED_STREAM", async () => {
    const session = http2.connect(narrow.url);
    try {
      await new Promise<void>((resolve) => session.once("remoteSettings", () => resolve()));
      expect(session.remoteSettings.maxConcurrentStreams).toBe(2);
    } finally {
      session.destroy();
    }
    // Node's own client queues calls beyond the limit; a raw peer that
    // ignores it shows what the server does with the extra stream.
    const peer = await rawHttp2(new URL(narrow.url));
    try {
      for (const id of [1, 3, 5]) peer.headers(id, "/grpc.health.v1.Health/Watch");
      const reset = await peer.reset(5);
      expect(reset).toBe(7); // REFUSED_STREAM: the peer may retry it elsewhere.
      expect(peer.resets.has(1) || peer.resets.has(3)).toBe(false);
    } finally {
      peer.close();
    }
  });
});

describe("concurrent streams per connection on the guarded store", () => {
  it("the store advertises 100 by default and takes the lease server's --max-streams-per-connection; a peer that opens more gets REFUSED_STREAM", async () => {
    const lease = await startServer();
    const byDefault = await startGuardedServer(["--lease-url", lease.url]);
    const narrow = await startGuardedServer([
      "--lease-url",
      lease.url,
      "--max-streams-per-connection",
      "2",
    ]);
    const advertised = async (url: string) => {
      const session = http2.connect(url);
      try {
        await new Promise<void>((resolve) => session.once("remoteSettings", () => resolve()));
        return session.remoteSettings.maxConcurrentStreams;
      } finally {
        session.destroy();
      }
    };
    // It set none before, and got the listener's 1,000.
    expect(await advertised(byDefault.url)).toBe(100);
    expect(await advertised(narrow.url)).toBe(2);
    const peer = await rawHttp2(new URL(narrow.url));
    try {
      for (const id of [1, 3, 5]) peer.headers(id, "/leasehold.guarded.v1.GuardedStoreService/Put");
      expect(await peer.reset(5)).toBe(7); // REFUSED_STREAM
      expect(peer.resets.has(1) || peer.resets.has(3)).toBe(false);
    } finally {
      peer.close();
    }
  });
});

// A minimal HTTP/2 peer over TCP: preface, empty SETTINGS (the server's are
// left unacknowledged, so nghttp2 refuses excess streams rather than
// failing the connection), HEADERS frames with literal HPACK fields.
async function rawHttp2(url: URL) {
  const socket = net.connect(Number(url.port), url.hostname);
  await new Promise<void>((resolve, reject) => {
    socket.once("connect", resolve);
    socket.once("error", reject);
  });
  socket.write(Buffer.concat([preface, h2Frame(FRAME.SETTINGS, 0, 0)]));
  const resets = new Map<number, number>();
  const waiting = new Map<number, (code: number) => void>();
  readFrames(socket, ({ type, streamId, payload }) => {
    if (type !== FRAME.RST_STREAM) return;
    const code = payload.readUInt32BE(0);
    resets.set(streamId, code);
    waiting.get(streamId)?.(code);
  });
  socket.on("error", () => {});
  return {
    resets,
    headers: (stream: number, path: string) =>
      socket.write(
        h2Frame(
          FRAME.HEADERS,
          FLAG.END_HEADERS, // the stream stays open
          stream,
          headerBlock([
            [":method", "POST"],
            [":scheme", "http"],
            [":path", path],
            [":authority", url.host],
            ["content-type", "application/grpc"],
            ["te", "trailers"],
          ]),
        ),
      ),
    reset: (stream: number) =>
      new Promise<number>((resolve) => {
        const known = resets.get(stream);
        if (known !== undefined) resolve(known);
        else waiting.set(stream, resolve);
      }),
    close: () => socket.destroy(),
  };
}

describe("watchers per account over the wire", () => {
  let narrow: RunningServer;
  beforeAll(async () => {
    narrow = await startServer(["--max-watchers-per-account", "1"]);
  });

  it("a second Watch of the same account is RESOURCE_EXHAUSTED; another account is not; ending the first frees the slot", async () => {
    const c = grpcClient(narrow.url);
    const open = (accountId: string) => {
      const controller = new AbortController();
      const stream = c.watch({ key: { accountId, sessionId: "" } }, { signal: controller.signal });
      const it = stream[Symbol.asyncIterator]();
      return { first: it.next(), stop: () => controller.abort() };
    };
    const a = open("watch-acct");
    const first = await a.first.catch((e: unknown) => ConnectError.from(e));
    expect(first).not.toBeInstanceOf(ConnectError);
    const b = open("watch-acct");
    const refused = await failure(b.first);
    expect(refused.code).toBe(Code.ResourceExhausted);
    expect(refused.rawMessage).toMatch(/limit \(--max-watchers-per-account\) is 1/);
    expect(limitOf(refused)).toEqual({ limit: "max-watchers-per-account", max: "1" });
    const other = open("watch-other");
    await other.first;
    other.stop();
    a.stop();
    // The server gives the slot back once it sees the stream end.
    await expect
      .poll(async () => {
        const again = open("watch-acct");
        const answer = await again.first.catch((e: unknown) => ConnectError.from(e));
        again.stop();
        return answer instanceof ConnectError ? Code[answer.code] : "served";
      })
      .toBe("served");
  });

  it("the slots are the same whichever path serves the stream: a Watch over gRPC (the native path) and one over the Connect protocol count together", async () => {
    const open = (c: LeaseClient) => {
      const controller = new AbortController();
      const stream = c.watch(
        { key: { accountId: "watch-paths", sessionId: "" } },
        { signal: controller.signal },
      );
      return { first: stream[Symbol.asyncIterator]().next(), stop: () => controller.abort() };
    };
    const overGrpc = open(grpcClient(narrow.url));
    await overGrpc.first;
    const overConnect = open(connectClient(narrow.url));
    const refused = await failure(overConnect.first);
    expect(refused.code).toBe(Code.ResourceExhausted);
    expect(limitOf(refused)).toEqual({ limit: "max-watchers-per-account", max: "1" });
    overGrpc.stop();
    // And the other way round, once the server has seen the first end.
    await expect
      .poll(async () => {
        const again = open(connectClient(narrow.url));
        const answer = await again.first.catch((e: unknown) => ConnectError.from(e));
        if (answer instanceof ConnectError) return "the gRPC stream's slot is not back yet";
        const third = open(grpcClient(narrow.url));
        const code = await failure(third.first).then((e) => Code[e.code]);
        third.stop();
        again.stop();
        return code;
      })
      .toBe("ResourceExhausted");
  });
});

describe("stream limits", () => {
  it("watchers per account: the limit-th slot is granted, the next is RESOURCE_EXHAUSTED; leaving frees one", () => {
    const slots = createAccountSlots(2, "Watch streams", LimitName.watchersPerAccount);
    const leave = slots.enter("a");
    slots.enter("a");
    expect(() => slots.enter("a")).toThrow(
      /already has 2 Watch streams open on this server, the limit \(--max-watchers-per-account\) is 2/,
    );
    expect(() => slots.enter("b")).not.toThrow();
    leave();
    leave();
    expect(slots.used("a")).toBe(1);
    expect(() => slots.enter("a")).not.toThrow();
  });

  it("leases per KeepAlive stream: a repeated key does not count twice", () => {
    const leases = createStreamLeases(2);
    leases.add("k1");
    leases.add("k1");
    leases.add("k2");
    expect(() => leases.add("k3")).toThrow(
      /carries 2 leases, the limit \(--max-leases-per-stream\) is 2/,
    );
    leases.delete("k1");
    expect(() => leases.add("k3")).not.toThrow();
    expect(leases.size).toBe(2);
  });
});
