// The one call policy (src/call/call-policy.ts) on every path into the
// server: native gRPC, connect-node's gRPC, Connect and gRPC-Web. Every test
// runs on a server with `--grpc-path native` and on one with
// `--grpc-path connect`, so a gRPC client reaches both serving paths.
//
// - Streams outlive no token (DESIGN §7): a KeepAlive or Watch stream ends
//   with UNAUTHENTICATED once its token has expired past the verifier's clock
//   tolerance, without waiting for another message from the client.
// - A grpc-timeout beyond what a timer can hold (grpc-go sends 2592000S for
//   30 days) is clamped, never INVALID_ARGUMENT or an instant deadline.
// - A Watch that ends while its authorization is pending leaves no watcher
//   and no account slot behind.
// - Native path: a refused KeepAlive stream sends its trailers and is reset;
//   the server grants no more flow-control window to it; a pending check
//   stops the server from reading further (first shown: a stream the server
//   reads is granted window, so the counter those bounds read does count).
//
// - The protocol matrix: the same calls over every protocol give the same
//   answers, codes, details and metrics.
// - A step added to the policy (LeaseServerExtensions.policySteps) runs on
//   every path, unary and streaming, and can refuse a call on each.
//
// The session authorizer is the ACL table, so a test can hold an
// authorization check pending for as long as it likes: a transaction that
// holds an exclusive lock on session_acl blocks the check's SELECT.

import { randomUUID } from "node:crypto";
import http2 from "node:http2";
import { type Client, Code, ConnectError, createClient } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import { beforeAll, describe, expect, it } from "vitest";
import type { PolicyCallInfo, PolicyStep } from "../src/call/call-policy.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { GetRequestSchema, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { PermissionDeniedError } from "../src/lease/errors.js";
import type { LeaseServer } from "../src/server/server.js";
import { seconds } from "./support/calls.js";
import { openTransaction } from "./support/db.js";
import { useTestDatabase } from "./support/fixture.js";
import { frame } from "./support/raw-grpc.js";
import {
  FLAG,
  FRAME,
  h2Frame,
  headerBlock,
  openRawH2,
  type RawH2Connection,
  WINDOW_UPDATE,
} from "./support/raw-http2.js";
import { bearer, createTestKeys, type TestKeys } from "./support/tokens.js";
import { waitFor, within } from "./support/wait.js";

const { db, startServer } = useTestDatabase();
let keys: TestKeys;
const servers = {} as Record<"native" | "connect", LeaseServer>;
const account = "alice";
const maxWatchers = 4;

// The step every server runs: it records the calls whose request id starts
// with "step-" (their protocol, method, each hook and the end's code), and
// refuses those whose request id starts with "step-refuse-".
const stepSaw: {
  requestId: string;
  protocol: string;
  method: string;
  hook: string;
  code?: string;
}[] = [];
const recordingStep: PolicyStep = {
  admit(call) {
    if (!call.requestId.startsWith("step-")) return;
    stepSaw.push({ ...seen(call), hook: "admit" });
    if (call.requestId.startsWith("step-refuse-")) {
      throw new PermissionDeniedError("refused by the test's policy step");
    }
  },
  message(call) {
    if (call.requestId.startsWith("step-")) stepSaw.push({ ...seen(call), hook: "message" });
  },
  end(call, code) {
    if (!call.requestId.startsWith("step-")) return;
    stepSaw.push({ ...seen(call), hook: "end", code: code === undefined ? "ok" : Code[code] });
  },
};
const seen = (call: PolicyCallInfo) => ({
  requestId: call.requestId,
  protocol: call.protocol,
  method: call.method,
});

beforeAll(async () => {
  keys = await createTestKeys();
  await db.sql`INSERT INTO session_acl (account_id, subject, session_id, actions)
               VALUES (${account}, '*', '*', '{*}'), ('leaky', '*', '*', '{*}')`;
  for (const mode of ["native", "connect"] as const) {
    servers[mode] = await startServer(
      [
        ...keys.args,
        "--grpc-path",
        mode,
        "--session-authorizer",
        "acl-table",
        // A check held pending by a test waits for the lock, not for a timeout.
        "--lock-timeout",
        "30s",
        "--statement-timeout",
        "30s",
        "--max-watchers-per-account",
        String(maxWatchers),
      ],
      {},
      undefined,
      { policySteps: [recordingStep] },
    );
  }
});

type LeaseClient = Client<typeof LeaseService>;
type Protocol = "grpc" | "connect" | "grpc-web";

function clientOf(url: string, protocol: Protocol): LeaseClient {
  if (protocol === "grpc") return createClient(LeaseService, createGrpcTransport({ baseUrl: url }));
  if (protocol === "grpc-web") {
    return createClient(LeaseService, createGrpcWebTransport({ baseUrl: url, httpVersion: "1.1" }));
  }
  // Connect over HTTP/2: the only way a client streams requests over Connect.
  return createClient(LeaseService, createConnectTransport({ baseUrl: url, httpVersion: "2" }));
}

const outcome = (run: () => Promise<unknown>) =>
  run().then(
    () => undefined,
    (e: unknown) => ConnectError.from(e),
  );

const aborted = (signal: AbortSignal) =>
  new Promise<void>((resolve) => signal.addEventListener("abort", () => resolve(), { once: true }));

// jose accepts a token 5 s past its `exp` (the verifier's clock tolerance):
// one that expired 3 s ago is accepted for one to two seconds more.
const shortLivedToken = () => keys.token(account, { expiresIn: -3 });

function expectExpired(error: ConnectError | undefined) {
  expect(error?.code).toBe(Code.Unauthenticated);
  expect(error?.rawMessage).toMatch(/token expired/);
  expect(error?.findDetails(ErrorInfoSchema)[0]?.metadata).toMatchObject({ cause: "expired" });
}

for (const mode of ["native", "connect"] as const) {
  describe(`--grpc-path ${mode}`, () => {
    const url = () => servers[mode].url;

    it("a KeepAlive stream ends UNAUTHENTICATED once its token expired, without another message from the client; nothing is renewed after it (gRPC, Connect)", async () => {
      const long = await keys.token(account);
      await Promise.all(
        (["grpc", "connect"] as const).map(async (protocol) => {
          const client = clientOf(url(), protocol);
          const key = { accountId: account, sessionId: `ka-exp-${protocol}-${randomUUID()}` };
          const granted = await client.acquire({ key, ttl: seconds(600) }, bearer(long));
          const runId = granted.lease?.runId ?? "";
          const controller = new AbortController();
          async function* requests() {
            yield { key, runId };
            await aborted(controller.signal);
          }
          const answers: string[] = [];
          const error = await within(
            outcome(async () => {
              for await (const m of client.keepAlive(requests(), {
                ...bearer(await shortLivedToken()),
                signal: controller.signal,
              })) {
                answers.push(m.result.case ?? "");
              }
            }),
            { what: `${protocol}: the KeepAlive stream to end at its token's expiry` },
          );
          controller.abort();
          expectExpired(error);
          expect(answers).toEqual(["lease"]);
        }),
      );
    });

    it("a Watch stream ends UNAUTHENTICATED once its token expired (gRPC, Connect, gRPC-Web)", async () => {
      await Promise.all(
        (["grpc", "connect", "grpc-web"] as const).map(async (protocol) => {
          const client = clientOf(url(), protocol);
          const controller = new AbortController();
          const kinds: string[] = [];
          const error = await within(
            outcome(async () => {
              for await (const m of client.watch(
                { key: { accountId: account, sessionId: `w-exp-${randomUUID()}` } },
                { ...bearer(await shortLivedToken()), signal: controller.signal },
              )) {
                kinds.push(m.kind.case ?? "");
              }
            }),
            { what: `${protocol}: the Watch stream to end at its token's expiry` },
          );
          controller.abort();
          expectExpired(error);
          expect(kinds[0]).toBe("snapshot");
        }),
      );
    });

    it("a grpc-timeout of 30 days (grpc-go's 2592000S) is clamped, not refused, on gRPC, gRPC-Web and Connect", async () => {
      const token = await keys.token(account);
      const body = frame(GetRequestSchema, { key: { accountId: account, sessionId: "t" } });
      // gRPC over HTTP/2.
      const session = http2.connect(url());
      session.on("error", () => {});
      const grpc = await new Promise<string | undefined>((resolve, reject) => {
        const stream = session.request({
          ":method": "POST",
          ":path": "/leasehold.v1.LeaseService/Get",
          "content-type": "application/grpc",
          te: "trailers",
          "grpc-timeout": "2592000S",
          authorization: `Bearer ${token}`,
        });
        let status: string | undefined;
        stream.on("response", (h) => {
          if (h["grpc-status"] !== undefined) status = String(h["grpc-status"]);
        });
        stream.on("trailers", (t) => {
          status = String(t["grpc-status"]);
        });
        stream.on("data", () => {});
        stream.on("end", () => resolve(status));
        stream.on("error", reject);
        stream.end(body);
      });
      session.close();
      expect(grpc).toBe("0");
      // gRPC-Web over HTTP/1.1: the status is in the body's trailer frame or the headers.
      const web = await fetch(`${url()}/leasehold.v1.LeaseService/Get`, {
        method: "POST",
        headers: {
          "content-type": "application/grpc-web+proto",
          "grpc-timeout": "2592000S",
          authorization: `Bearer ${token}`,
        },
        body: body,
      });
      const text = Buffer.from(await web.arrayBuffer()).toString("latin1");
      expect(web.headers.get("grpc-status") ?? /grpc-status: ?(\d+)/.exec(text)?.[1]).toBe("0");
      // Connect: the same 30 days in connect-timeout-ms.
      const connect = await fetch(`${url()}/leasehold.v1.LeaseService/Get`, {
        method: "POST",
        headers: {
          "content-type": "application/json",
          "connect-protocol-version": "1",
          "connect-timeout-ms": "2592000000",
          authorization: `Bearer ${token}`,
        },
        body: JSON.stringify({ key: { accountId: account, sessionId: "t" } }),
      });
      expect(connect.status).toBe(200);
    });

    it("the protocol matrix: the same calls over gRPC, Connect and gRPC-Web give the same answers, codes, details and metrics", async () => {
      const token = await keys.token(account);
      const sessionOf = (p: Protocol) => `matrix-${mode}-${p}`;
      type Seen = { ok?: unknown; code?: string; message?: string; details?: unknown };
      const answer = async (run: () => Promise<unknown>): Promise<Seen> => {
        try {
          return { ok: await run() };
        } catch (e) {
          const ce = ConnectError.from(e);
          return {
            code: Code[ce.code],
            message: ce.rawMessage,
            details: ce
              .findDetails(ErrorInfoSchema)
              .map((d) => ({ reason: d.reason, metadata: d.metadata })),
          };
        }
      };
      const before = await scrape(url());
      const results: Record<string, Record<string, Seen>> = {};
      for (const protocol of ["grpc", "connect", "grpc-web"] as const) {
        // Connect's unary calls over HTTP/1.1, as curl and browsers send them.
        const client =
          protocol === "connect"
            ? createClient(
                LeaseService,
                createConnectTransport({ baseUrl: url(), httpVersion: "1.1" }),
              )
            : clientOf(url(), protocol);
        const key = { accountId: account, sessionId: sessionOf(protocol) };
        const runId = randomUUID();
        const r: Record<string, Seen> = {};
        r.acquire = await answer(async () => {
          const a = await client.acquire(
            { key, runId, ttl: seconds(60), holder: "matrix" },
            bearer(token),
          );
          return {
            acquired: a.acquired,
            runId: a.lease?.runId,
            holder: a.lease?.holder,
            ownSession: a.lease?.key?.sessionId === sessionOf(protocol),
          };
        });
        r.get = await answer(async () => {
          const g = await client.get({ key }, bearer(token));
          return { held: g.held, runId: g.lease?.runId };
        });
        r.renewNotHeld = await answer(() =>
          client.renew({ key, runId: randomUUID() }, bearer(token)),
        );
        r.otherAccount = await answer(() =>
          client.get({ key: { accountId: "mallory", sessionId: "x" } }, bearer(token)),
        );
        r.badKey = await answer(() =>
          client.get({ key: { accountId: account, sessionId: "" } }, bearer(token)),
        );
        r.noToken = await answer(() => client.get({ key }));
        r.watch = await answer(async () => {
          const controller = new AbortController();
          for await (const m of client.watch(
            { key },
            { ...bearer(token), signal: controller.signal },
          )) {
            controller.abort();
            return {
              kind: m.kind.case,
              runIds: m.kind.case === "snapshot" ? m.kind.value.leases.map((l) => l.runId) : [],
            };
          }
          return undefined;
        });
        r.release = await answer(
          async () => (await client.release({ key, runId }, bearer(token))).released,
        );
        // The run ids differ per protocol: compare whether each call saw its own.
        for (const k of ["acquire", "get"]) {
          const ok = r[k]?.ok as { runId?: string } | undefined;
          if (ok?.runId !== undefined) ok.runId = ok.runId === runId ? "own" : ok.runId;
        }
        const w = r.watch?.ok as { runIds: string[] } | undefined;
        if (w) w.runIds = w.runIds.map((id) => (id === runId ? "own" : id));
        results[protocol] = r;
      }
      expect(results.grpc?.acquire?.ok).toEqual({
        acquired: true,
        runId: "own",
        holder: "matrix",
        ownSession: true,
      });
      expect(results.grpc?.renewNotHeld?.code).toBe("FailedPrecondition");
      expect(results.grpc?.otherAccount?.code).toBe("PermissionDenied");
      expect(results.grpc?.badKey?.code).toBe("InvalidArgument");
      expect(results.grpc?.noToken?.code).toBe("Unauthenticated");
      expect(results.grpc?.watch?.ok).toEqual({ kind: "snapshot", runIds: ["own"] });
      expect(results.connect).toEqual(results.grpc);
      expect(results["grpc-web"]).toEqual(results.grpc);
      // Each outcome was counted once per protocol, under the same method and code.
      const after = await scrape(url());
      for (const [method, code] of [
        ["Acquire", "ok"],
        ["Get", "ok"],
        ["Renew", "failed_precondition"],
        ["Get", "permission_denied"],
        ["Get", "invalid_argument"],
        ["Get", "unauthenticated"],
        ["Release", "ok"],
      ] as const) {
        const series = `leasehold_rpc_duration_seconds_count{method="leasehold.v1.LeaseService/${method}",code="${code}"}`;
        expect(count(after, series) - count(before, series), series).toBe(3);
      }
      await waitFor(
        async () => {
          const series = `leasehold_rpc_duration_seconds_count{method="leasehold.v1.LeaseService/Watch",code="canceled"}`;
          return count(await scrape(url()), series) - count(before, series) === 3;
        },
        { what: "the three Watch streams to be counted as cancelled" },
      );
    });

    it("a step added to the policy runs on every path, unary and streaming, and its refusal is answered on each", async () => {
      const token = await keys.token(account);
      const grpcName = mode === "native" ? "grpc-native" : "grpc";
      const key = { accountId: account, sessionId: `step-${mode}` };
      const cases: { protocol: Protocol; name: string; method: string }[] = [
        { protocol: "grpc", name: grpcName, method: "Get" },
        { protocol: "connect", name: "connect", method: "Get" },
        { protocol: "grpc-web", name: "grpc-web", method: "Get" },
        { protocol: "grpc", name: grpcName, method: "Watch" },
        { protocol: "connect", name: "connect", method: "Watch" },
        { protocol: "grpc-web", name: "grpc-web", method: "Watch" },
        { protocol: "grpc", name: grpcName, method: "KeepAlive" },
        { protocol: "connect", name: "connect", method: "KeepAlive" },
      ];
      const call = async (c: (typeof cases)[number], requestId: string) => {
        const client = clientOf(url(), c.protocol);
        const options = { headers: { ...bearer(token).headers, "x-request-id": requestId } };
        const controller = new AbortController();
        return outcome(async () => {
          if (c.method === "Get") return client.get({ key }, options);
          if (c.method === "Watch") {
            for await (const _ of client.watch(
              { key },
              { ...options, signal: controller.signal },
            )) {
              controller.abort();
              return;
            }
            return;
          }
          async function* requests() {
            yield { key, runId: randomUUID() };
          }
          for await (const _ of client.keepAlive(requests(), options)) {
            // the stream ends after the lost answer (no such lease)
          }
        });
      };
      for (const c of cases) {
        const seenId = `step-seen-${randomUUID()}`;
        expect(await call(c, seenId), `${c.protocol} ${c.method}`).toBeUndefined();
        await waitFor(() => stepSaw.some((s) => s.requestId === seenId && s.hook === "end"), {
          what: `the end of ${c.protocol} ${c.method} to reach the step`,
        });
        const hooks = stepSaw.filter((s) => s.requestId === seenId);
        expect(hooks.map((h) => [h.protocol, h.method, h.hook])).toEqual([
          [c.name, c.method, "admit"],
          [c.name, c.method, "message"],
          [c.name, c.method, "end"],
        ]);
        const refusedId = `step-refuse-${randomUUID()}`;
        const refused = await call(c, refusedId);
        expect(refused?.code, `${c.protocol} ${c.method}`).toBe(Code.PermissionDenied);
        expect(refused?.rawMessage).toBe("refused by the test's policy step");
        expect(refused?.metadata.get("x-request-id")).toBe(refusedId);
        expect(
          stepSaw.filter((s) => s.requestId === refusedId).map((h) => [h.hook, h.code]),
        ).toEqual([
          ["admit", undefined],
          ["end", "PermissionDenied"],
        ]);
      }
    });

    it("a Watch that ends while its authorization is pending registers no watcher and keeps no account slot (gRPC, Connect, gRPC-Web)", async () => {
      const server = servers[mode];
      const token = await keys.token("leaky");
      // Every stream of the earlier tests has ended (their watchers go away as their handlers finish).
      await waitFor(() => server.streaming.watch.stats.watchers === 0, {
        what: "the earlier tests' watchers to be gone",
      });
      const lock = await openTransaction(
        db,
        (t) => t`LOCK TABLE session_acl IN ACCESS EXCLUSIVE MODE`,
      );
      const cancelled: Promise<unknown>[] = [];
      const controllers: AbortController[] = [];
      try {
        for (const protocol of ["grpc", "connect", "grpc-web", "grpc"] as const) {
          const controller = new AbortController();
          controllers.push(controller);
          const it = clientOf(url(), protocol)
            .watch(
              { key: { accountId: "leaky", sessionId: "" } },
              { ...bearer(token), signal: controller.signal },
            )
            [Symbol.asyncIterator]();
          cancelled.push(it.next().catch(() => undefined));
        }
        // Every check waits for the lock.
        await waitFor(
          async () => {
            const [row] = await db.sql<{ n: number }[]>`
              SELECT count(*)::int AS n FROM pg_stat_activity
              WHERE wait_event_type = 'Lock' AND query LIKE '%session_acl%'`;
            return (row?.n ?? 0) >= controllers.length;
          },
          { what: "every Watch's authorization to wait for the lock" },
        );
        for (const c of controllers) c.abort();
        await Promise.all(cancelled);
      } finally {
        await lock.end();
      }
      // A Watch opened now is served after the cancelled ones' checks were
      // answered (they were released first); then it ends.
      const control = new AbortController();
      const it = clientOf(url(), "grpc")
        .watch(
          { key: { accountId: "leaky", sessionId: "" } },
          { ...bearer(token), signal: control.signal },
        )
        [Symbol.asyncIterator]();
      expect((await it.next()).value?.kind.case).toBe("snapshot");
      control.abort();
      await it.next().catch(() => undefined);
      await waitFor(() => server.streaming.watch.stats.watchers === 0, {
        what: "no watcher to be left",
      });
      // Every slot of the account is free: as many Watch streams as the limit allows are served.
      const open = [];
      for (let i = 0; i < maxWatchers; i += 1) {
        const c = new AbortController();
        const w = clientOf(url(), "grpc")
          .watch(
            { key: { accountId: "leaky", sessionId: "" } },
            { ...bearer(token), signal: c.signal },
          )
          [Symbol.asyncIterator]();
        open.push({ c, w, first: await outcome(() => w.next()) });
      }
      for (const o of open) o.c.abort();
      expect(open.map((o) => o.first?.code)).toEqual(open.map(() => undefined));
    });
  });
}

describe("native gRPC path: a refused stream stops reading", () => {
  const keepAliveHeaders = (port: number, token?: string): Buffer =>
    headerBlock([
      [":method", "POST"],
      [":scheme", "http"],
      [":path", "/leasehold.v1.LeaseService/KeepAlive"],
      [":authority", `127.0.0.1:${port}`],
      ["content-type", "application/grpc"],
      ["te", "trailers"],
      ...(token === undefined
        ? []
        : ([["authorization", `Bearer ${token}`]] as [string, string][])),
    ]);

  // Empty KeepAlive messages (5 bytes each) filling `bytes` of DATA frames.
  const emptyMessages = (streamId: number, bytes: number): Buffer[] => {
    const frames: Buffer[] = [];
    for (let left = bytes; left >= 5; ) {
      const size = Math.min(16_380, left - (left % 5));
      frames.push(h2Frame(FRAME.DATA, 0, streamId, Buffer.alloc(size)));
      left -= size;
    }
    return frames;
  };

  const windowGranted = (
    frames: { type: number; streamId: number; payload: Buffer }[],
    id: number,
  ) =>
    frames
      .filter((f) => f.type === WINDOW_UPDATE && f.streamId === id)
      .reduce((n, f) => n + (f.payload.readUInt32BE(0) & 0x7fffffff), 0);

  // Copies of one gRPC message filling `bytes`, in DATA frames of at most
  // 16 KiB (a message may span two frames).
  const copiesOf = (message: Uint8Array, streamId: number, bytes: number): Buffer[] => {
    const all = Buffer.concat(
      Array.from({ length: Math.floor(bytes / message.length) }, () => message),
    );
    const frames: Buffer[] = [];
    for (let at = 0; at < all.length; at += 16_384) {
      frames.push(h2Frame(FRAME.DATA, 0, streamId, all.subarray(at, at + 16_384)));
    }
    return frames;
  };

  // After `firstLength` bytes of stream 1's initial window were sent: three
  // windows' worth of `message` copies, each sent once the server granted
  // room for it (so the caller never sends beyond its window).
  const sendThreeWindows = async (
    h2: RawH2Connection,
    firstLength: number,
    message: Uint8Array,
  ) => {
    let granted = h2.initialWindow - firstLength;
    let sent = 0;
    for (let round = 0; round < 3; round += 1) {
      const room = granted - sent;
      for (const f of copiesOf(message, 1, room)) h2.send(f);
      sent += room - (room % message.length);
      await h2.barrier();
      await h2.barrier();
      granted = h2.initialWindow - firstLength + windowGranted(h2.frames, 1);
      if (granted - sent < message.length) break;
    }
  };

  /** The most window the server may grant a stream it has stopped reading (see the pending test). */
  const pausedGrantBound = (firstLength: number) => 16_384 + firstLength;

  const u32 = (n: number) => {
    const b = Buffer.alloc(4);
    b.writeUInt32BE(n);
    return b;
  };

  it("the window counter these tests read moves: a KeepAlive stream the server reads is granted window as its caller sends, past the bound of a paused one", async () => {
    // Without this, a counter that never moved (WINDOW_UPDATE frames never
    // seen, or not summed) would pass the bounds of the tests below. The same
    // steps as the pending test, with the authorization decided: the filler
    // is more renewals of the same session, which need no further check.
    const token = await keys.token(account);
    const h2 = await openRawH2(servers.native.port);
    try {
      // Room for the server's answers (one per renewal): this caller reads all it is sent.
      h2.send(h2Frame(WINDOW_UPDATE, 0, 0, u32(1 << 30)));
      h2.send(
        h2Frame(FRAME.HEADERS, FLAG.END_HEADERS, 1, keepAliveHeaders(servers.native.port, token)),
      );
      h2.send(h2Frame(WINDOW_UPDATE, 0, 1, u32(1 << 30)));
      const renewal = frame(
        (await import("../src/gen/leasehold/v1/lease_pb.js")).KeepAliveRequestSchema,
        { key: { accountId: account, sessionId: "read" }, runId: randomUUID() },
      );
      h2.send(h2Frame(FRAME.DATA, 0, 1, renewal));
      // Its answer: the session's authorization was decided (and the server reads on).
      await h2.next((f) => f.type === FRAME.DATA && f.streamId === 1);
      await sendThreeWindows(h2, renewal.length, renewal);
      expect(
        h2.frames.some((f) => f.type === FRAME.RST_STREAM && f.streamId === 1),
        "the stream was reset",
      ).toBe(false);
      expect(windowGranted(h2.frames, 1)).toBeGreaterThan(pausedGrantBound(renewal.length));
    } finally {
      h2.close();
    }
  });

  it("a KeepAlive stream without a token gets its UNAUTHENTICATED trailers, then a reset; the window it was granted is never refilled", async () => {
    const h2 = await openRawH2(servers.native.port);
    try {
      h2.send(h2Frame(FRAME.HEADERS, FLAG.END_HEADERS, 1, keepAliveHeaders(servers.native.port)));
      const trailers = await h2.next(
        (f) => f.type === FRAME.HEADERS && f.streamId === 1 && (f.flags & FLAG.END_STREAM) !== 0,
      );
      expect(trailers.payload.toString("latin1")).toContain("16");
      const after = h2.frames.indexOf(trailers) + 1;
      // The caller goes on sending as much as the stream's window lets it.
      for (const f of emptyMessages(1, h2.initialWindow)) h2.send(f);
      await h2.barrier();
      await h2.barrier();
      const rest = h2.frames.slice(after);
      expect(rest.some((f) => f.type === FRAME.RST_STREAM && f.streamId === 1)).toBe(true);
      expect(windowGranted(rest, 1)).toBe(0);
    } finally {
      h2.close();
    }
  });

  it("while a KeepAlive stream's authorization is pending the server stops reading it: it grants no window beyond the initial one", async () => {
    const token = await keys.token(account);
    const lock = await openTransaction(
      db,
      (t) => t`LOCK TABLE session_acl IN ACCESS EXCLUSIVE MODE`,
    );
    const h2 = await openRawH2(servers.native.port);
    try {
      h2.send(
        h2Frame(FRAME.HEADERS, FLAG.END_HEADERS, 1, keepAliveHeaders(servers.native.port, token)),
      );
      // One renewal, whose session the authorizer is asked about (and blocks on).
      const renewal = frame(
        (await import("../src/gen/leasehold/v1/lease_pb.js")).KeepAliveRequestSchema,
        { key: { accountId: account, sessionId: "pending" }, runId: randomUUID() },
      );
      h2.send(h2Frame(FRAME.DATA, 0, 1, renewal));
      await waitFor(
        async () => {
          const [row] = await db.sql<{ n: number }[]>`
            SELECT count(*)::int AS n FROM pg_stat_activity
            WHERE wait_event_type = 'Lock' AND query LIKE '%session_acl%'`;
          return (row?.n ?? 0) >= 1;
        },
        { what: "the renewal's authorization to wait for the lock" },
      );
      // Three windows' worth of empty messages (5 bytes each).
      await sendThreeWindows(h2, renewal.length, Buffer.alloc(5));
      // What the server accepted while the check was pending: the initial
      // window and at most one readable buffer (16 KiB) more.
      expect(windowGranted(h2.frames, 1)).toBeLessThanOrEqual(pausedGrantBound(renewal.length));
    } finally {
      h2.close();
      await lock.end();
    }
  });
});

async function scrape(url: string): Promise<string> {
  const res = await fetch(`${url}/metrics`);
  return res.text();
}

function count(text: string, series: string): number {
  const line = text.split("\n").find((l) => l.startsWith(`${series} `));
  return line === undefined ? 0 : Number(line.slice(series.length + 1));
}
