// GuardedStoreService in this process over real sockets: documents record
// the token that wrote them, stale writes are refused (S7), bad input is
// INVALID_ARGUMENT naming the field and changes nothing, and the live mode
// asks a real lease server. Every store here runs in development mode beside
// a lease server that grants the tokens it writes with (a write that raises
// the fence is confirmed there); guarded-auth.test.ts covers its callers'
// authentication and the grant check.

import { randomUUID } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import http2 from "node:http2";
import os from "node:os";
import path from "node:path";
import { Code, ConnectError } from "@connectrpc/connect";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../../src/gen/google/rpc/error_details_pb.js";
import { parseGuardedConfig } from "../../src/guarded/config.js";
import { defaultGuardedLimits } from "../../src/guarded/guarded-service.js";
import type { SessionKey } from "../../src/lease/types.js";
import { durationFromMillis } from "../../src/server/rpc/convert.js";
import type { RunningServer } from "../../src/server/server.js";
import { useTestDatabase } from "../support/fixture.js";
import { freshKey, untilExpired } from "../support/leases.js";
import {
  type GuardedClient,
  grpcClient,
  guardedConnectClient,
  guardedGrpcClient,
} from "../support/server.js";
import { bearer, createTestKeys, type TestKeys } from "../support/tokens.js";

const { db, startServer, startGuardedServer } = useTestDatabase();
let devLeaseServer: RunningServer;
let store: RunningServer;
let grpc: GuardedClient;
let connect: GuardedClient;

const text = (s: string) => new TextEncoder().encode(s);
const read = (b: Uint8Array) => new TextDecoder().decode(b);

beforeAll(async () => {
  devLeaseServer = await startServer();
  store = await startGuardedServer(["--lease-url", devLeaseServer.url], {
    ...defaultGuardedLimits,
    maxValueBytes: 1024,
    maxDocumentsPerSession: 3,
  });
  grpc = guardedGrpcClient(store.url);
  connect = guardedConnectClient(store.url);
});

/**
 * `count` successive grants of `key` by the lease server (each run released
 * at once), in grant order: strictly increasing tokens (S6).
 */
async function grants(key: SessionKey, count: number): Promise<bigint[]> {
  const leases = grpcClient(devLeaseServer.url);
  const tokens: bigint[] = [];
  for (let i = 0; i < count; i++) {
    const { lease } = await leases.acquire({ key, ttl: durationFromMillis(60_000) });
    if (!lease) throw new Error(`grant ${i} of ${key.sessionId} refused`);
    tokens.push(lease.fencingToken);
    // Monotonic mode asks only that a raising token is the newest grant,
    // not that its lease is still valid.
    await leases.release({ key, runId: lease.runId });
  }
  return tokens;
}

/** The one grant of a fresh key. */
async function granted(prefix: string): Promise<{ key: SessionKey; token: bigint }> {
  const key = freshKey(prefix);
  const [token] = await grants(key, 1);
  return { key, token: token ?? 0n };
}

async function refusal(call: Promise<unknown>): Promise<ConnectError> {
  return call.then(
    () => expect.fail("expected the call to be refused"),
    (e: unknown) => ConnectError.from(e),
  );
}

async function storedDocuments(): Promise<unknown[]> {
  return [...(await db.sql`SELECT * FROM guarded_documents ORDER BY session_id, name`)];
}

describe("GuardedStoreService", () => {
  it("S7: Put records the writing token; Get and List return it, over gRPC and Connect", async () => {
    const key = freshKey("docs");
    const [t1, t2] = await grants(key, 2);
    if (t1 === undefined || t2 === undefined) throw new Error("two grants");
    // The first run writes while its grant is the newest.
    const put = await grpc.put({ key, name: "transcript", value: text("hello"), fencingToken: t2 });
    expect(put.highestToken).toBe(t2);
    expect(put.document).toMatchObject({ name: "transcript", fencingToken: t2, size: 5n });
    const [t3] = await grants(key, 1);
    if (t3 === undefined) throw new Error("a third grant");
    await connect.put({ key, name: "files/notes.md", value: text("# notes"), fencingToken: t3 });

    const got = await connect.get({ key, name: "transcript" });
    expect(read(got.value)).toBe("hello");
    expect(got.fencingToken).toBe(t2);
    expect(got.updatedAt).toEqual(put.document?.updatedAt);
    const listed = await grpc.list({ key });
    expect(listed.highestToken).toBe(t3);
    expect(listed.documents.map((d) => [d.name, d.fencingToken, d.size])).toEqual([
      ["files/notes.md", t3, 7n],
      ["transcript", t2, 5n],
    ]);
  });

  it("S7: a stale Put is ABORTED with STALE_FENCING_TOKEN and highest_token, and the document is intact", async () => {
    const key = freshKey("docs");
    const [older, newer] = await grants(key, 2);
    if (older === undefined || newer === undefined) throw new Error("two grants");
    await grpc.put({ key, name: "transcript", value: text("run B"), fencingToken: newer });
    for (const client of [grpc, connect]) {
      const error = await refusal(
        client.put({ key, name: "transcript", value: text("run A"), fencingToken: older }),
      );
      expect(error.code).toBe(Code.Aborted);
      const [info] = error.findDetails(ErrorInfoSchema);
      expect(info?.reason).toBe("STALE_FENCING_TOKEN");
      expect(info?.metadata).toMatchObject({
        highest_token: String(newer),
        presented_token: String(older),
      });
    }
    const got = await grpc.get({ key, name: "transcript" });
    expect([read(got.value), got.fencingToken]).toEqual(["run B", newer]);
  });

  it("S7: concurrent writers with the tokens of successive grants: the document ends with the highest accepted token's value", async () => {
    const key = freshKey("docs");
    // Grants interleave with the writes, so the fence rises while they race.
    const issued: bigint[] = [];
    const clients = Array.from({ length: 6 }, (_, i) =>
      i % 2 ? guardedGrpcClient(store.url) : guardedConnectClient(store.url),
    );
    const accepted: bigint[] = [];
    const writers = async (rounds: number) =>
      Promise.all(
        clients.map(async (client) => {
          for (let n = 0; n < rounds; n++) {
            const token = issued[Math.floor(Math.random() * issued.length)] ?? 0n;
            try {
              await client.put({ key, name: "doc", value: text(`v${token}`), fencingToken: token });
              accepted.push(token);
            } catch (error) {
              expect(ConnectError.from(error).code).toBe(Code.Aborted);
            }
          }
        }),
      );
    for (let round = 0; round < 4; round++) {
      const [token] = await grants(key, 1);
      issued.push(token ?? 0n);
      await writers(4);
    }
    expect(accepted.length).toBeGreaterThan(0);
    const highest = [...accepted].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0)).at(-1) ?? 0n;
    const got = await grpc.get({ key, name: "doc" });
    expect([read(got.value), got.fencingToken]).toEqual([`v${highest}`, highest]);
    expect((await grpc.list({ key })).highestToken).toBe(highest);
  });

  it("Get of a missing document is NOT_FOUND; List of an unknown session is empty with highest 0", async () => {
    const key = freshKey("docs");
    const error = await refusal(grpc.get({ key, name: "nothing" }));
    expect(error.code).toBe(Code.NotFound);
    expect(await grpc.list({ key })).toMatchObject({ documents: [], highestToken: 0n });
  });

  it("a session holds a bounded number of documents: RESOURCE_EXHAUSTED, and rewrites still pass", async () => {
    const { key, token } = await granted("docs");
    for (const name of ["a", "b", "c"]) {
      await grpc.put({ key, name, value: text(name), fencingToken: token });
    }
    const error = await refusal(
      grpc.put({ key, name: "d", value: text("d"), fencingToken: token }),
    );
    expect(error.code).toBe(Code.ResourceExhausted);
    const info = error.findDetails(ErrorInfoSchema).find((d) => d.reason === "LIMIT_EXCEEDED");
    expect(info?.metadata).toEqual({ limit: "documents-per-session", max: "3" });
    await grpc.put({ key, name: "a", value: text("again"), fencingToken: token });
    expect((await grpc.list({ key })).documents.map((d) => d.name)).toEqual(["a", "b", "c"]);
  });

  it("bad input: INVALID_ARGUMENT naming the field, and nothing changes", async () => {
    const { key, token } = await granted("docs");
    await grpc.put({ key, name: "kept", value: text("v"), fencingToken: token });
    const before = await storedDocuments();
    const value = text("x");
    const cases: [Parameters<GuardedClient["put"]>[0], string][] = [
      [{ name: "n", value, fencingToken: 5n }, "key"],
      [
        { key: { accountId: "", sessionId: "s" }, name: "n", value, fencingToken: 5n },
        "key.account_id",
      ],
      [
        { key: { accountId: "a", sessionId: "a b" }, name: "n", value, fencingToken: 5n },
        "key.session_id",
      ],
      [{ key, name: "", value, fencingToken: 5n }, "name"],
      [{ key, name: "bad\nname", value, fencingToken: 5n }, "name"],
      [{ key, name: "n".repeat(513), value, fencingToken: 5n }, "name"],
      [{ key, name: "n", value, fencingToken: 0n }, "fencing_token"],
      [{ key, name: "n", value, fencingToken: -5n }, "fencing_token"],
      [{ key, name: "n", value: new Uint8Array(1025), fencingToken: 5n }, "value"],
    ];
    for (const [request, field] of cases) {
      const error = await refusal(connect.put(request));
      expect(error.code, field).toBe(Code.InvalidArgument);
      expect(error.rawMessage.startsWith(`${field} `), error.rawMessage).toBe(true);
    }
    for (const [request, field] of [
      [{ key, name: "" }, "name"],
      [{ name: "n" }, "key"],
    ] as const) {
      const error = await refusal(grpc.get(request));
      expect(error.code).toBe(Code.InvalidArgument);
      expect(error.rawMessage.startsWith(`${field} `)).toBe(true);
    }
    expect((await refusal(grpc.list({}))).code).toBe(Code.InvalidArgument);
    expect(await storedDocuments()).toEqual(before);
    expect((await grpc.list({ key })).highestToken).toBe(token);
  });

  it("a body that is not protobuf, or flagged compressed without a compression, is INVALID_ARGUMENT naming the request message, in gRPC, gRPC-Web and Connect; nothing changes", async () => {
    const before = await storedDocuments();
    const path = "/leasehold.guarded.v1.GuardedStoreService/Put";
    // A field numbered 0 (no parser accepts it), and an empty message flagged compressed.
    for (const envelope of [Buffer.from([0, 0, 0, 0, 1, 0]), Buffer.from([1, 0, 0, 0, 0])]) {
      for (const type of ["application/grpc", "application/grpc-web+proto"]) {
        const answer = await fetchGrpcStatus(`${store.url}${path}`, type, envelope);
        expect(answer, `${type} ${envelope.toString("hex")}`).toMatchObject({
          status: "3",
          message: expect.stringMatching(/^request message: /),
        });
      }
    }
    const connectAnswer = await fetch(`${store.url}${path}`, {
      method: "POST",
      headers: { "content-type": "application/proto" },
      body: Buffer.from([0]),
    });
    expect(connectAnswer.status).toBe(400);
    expect(((await connectAnswer.json()) as { code: string }).code).toBe("invalid_argument");
    expect(await storedDocuments()).toEqual(before);
  });
});

/** grpc-status and grpc-message of a gRPC (HTTP/2) or gRPC-Web call with a raw body. */
async function fetchGrpcStatus(url: string, type: string, body: Buffer) {
  if (type === "application/grpc-web+proto") {
    const res = await fetch(url, { method: "POST", headers: { "content-type": type }, body });
    const text = Buffer.from(await res.arrayBuffer()).toString("latin1");
    return {
      status: /grpc-status: ?(\d+)\r\n/.exec(text)?.[1],
      message: decodeURIComponent(/grpc-message: ?([^\r]*)\r\n/.exec(text)?.[1] ?? ""),
    };
  }
  const session = http2.connect(new URL(url).origin);
  try {
    return await new Promise<{ status?: string; message: string }>((resolve, reject) => {
      session.on("error", reject);
      const req = session.request({
        ":method": "POST",
        ":path": new URL(url).pathname,
        "content-type": type,
        te: "trailers",
      });
      let h: http2.IncomingHttpHeaders = {};
      req.on("response", (headers) => {
        h = { ...headers, ...h };
      });
      req.on("trailers", (t) => {
        h = { ...h, ...t };
      });
      req.on("close", () =>
        resolve({
          status: h["grpc-status"] as string | undefined,
          message: decodeURIComponent(String(h["grpc-message"] ?? "")),
        }),
      );
      req.resume();
      req.end(body);
    });
  } finally {
    session.close();
  }
}

describe("guarded store, live mode", () => {
  let leaseServer: RunningServer;
  let liveStore: RunningServer;
  let live: GuardedClient;

  beforeAll(async () => {
    leaseServer = await startServer();
    liveStore = await startGuardedServer(["--fence-mode", "live", "--lease-url", leaseServer.url]);
    live = guardedGrpcClient(liveStore.url);
  });

  it("S4, S7 live: the valid lease's token writes; the same token after expiry is refused, unreplaced", async () => {
    const key = freshKey("live");
    const leases = grpcClient(leaseServer.url);
    const lease = await leases.acquire({ key, ttl: durationFromMillis(30_000), holder: "run-a" });
    const token = lease.lease?.fencingToken ?? 0n;
    await live.put({ key, name: "transcript", value: text("held"), fencingToken: token });
    // The holder's last renewal asks for 100 ms; then it stalls past it.
    await leases.renew({ key, runId: lease.lease?.runId ?? "", ttl: durationFromMillis(100) });
    await untilExpired(db.sql, key);
    const error = await refusal(
      live.put({ key, name: "transcript", value: text("late"), fencingToken: token }),
    );
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(error.findDetails(ErrorInfoSchema)[0]).toMatchObject({
      reason: "LEASE_NOT_HELD",
      metadata: { cause: "expired" },
    });
    expect(read((await live.get({ key, name: "transcript" })).value)).toBe("held");
  });

  it("S7 live: a token never granted for the session is refused", async () => {
    const key = { accountId: "acct", sessionId: `never-${randomUUID()}` };
    const error = await refusal(live.put({ key, name: "n", value: text("x"), fencingToken: 3n }));
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(error.findDetails(ErrorInfoSchema)[0]?.metadata.cause).toBe("not_found");
    expect(error.rawMessage).toBe(
      `lease not held: fencing token 3 was never granted for acct/${key.sessionId} (no token was ever granted for it); write with the token your Acquire returned`,
    );
  });

  it("live mode with the lease server unreachable is UNAVAILABLE, and nothing is written", async () => {
    const down = await startGuardedServer([
      "--fence-mode",
      "live",
      "--lease-url",
      "http://127.0.0.1:1",
      "--lease-timeout",
      "500ms",
    ]);
    try {
      const key = freshKey("live");
      const error = await refusal(
        guardedGrpcClient(down.url).put({ key, name: "n", value: text("x"), fencingToken: 1n }),
      );
      expect(error.code).toBe(Code.Unavailable);
      expect(error.rawMessage).toMatch(/^the lease server could not confirm the fencing token/);
      expect((await grpc.list({ key })).highestToken).toBe(0n);
    } finally {
      await down.close();
    }
  });
});

describe("guarded store, live mode against a lease server with keys", () => {
  let keys: TestKeys;
  let leaseServer: RunningServer;
  let tokenDir: string;

  beforeAll(async () => {
    keys = await createTestKeys();
    leaseServer = await startServer(keys.args);
    tokenDir = await mkdtemp(path.join(os.tmpdir(), "leasehold-lease-token-"));
  });
  afterAll(async () => {
    await rm(tokenDir, { recursive: true, force: true });
  });

  /** A live-mode store presenting `token` (from a file) to the lease server. */
  async function liveStoreWith(token: string): Promise<RunningServer> {
    const file = path.join(tokenDir, `${randomUUID()}.jwt`);
    await writeFile(file, `${token}\n`, { mode: 0o600 });
    return startGuardedServer([
      ...["--fence-mode", "live", "--lease-url", leaseServer.url],
      ...["--lease-token-file", file],
    ]);
  }

  async function grant(account: string) {
    const key = { accountId: account, sessionId: `live-${randomUUID()}` };
    const answer = await grpcClient(leaseServer.url).acquire(
      { key, ttl: durationFromMillis(30_000), holder: "run-a" },
      bearer(await keys.token(account)),
    );
    return { key, token: answer.lease?.fencingToken ?? 0n };
  }

  it("S7 live: with a fence-scope token the store confirms writers' tokens of any account", async () => {
    const store = await liveStoreWith(
      await keys.token("guarded-store", { scope: "leasehold:fence" }),
    );
    try {
      const client = guardedGrpcClient(store.url);
      for (const account of ["alice", "bob"]) {
        const { key, token } = await grant(account);
        const put = await client.put({ key, name: "n", value: text(account), fencingToken: token });
        expect(put.highestToken).toBe(token);
        const error = await refusal(
          client.put({ key, name: "n", value: text("x"), fencingToken: token + 1n }),
        );
        expect(error.code).toBe(Code.FailedPrecondition);
      }
    } finally {
      await store.close();
    }
  });

  it("without the fence scope the lease server refuses the check: UNAVAILABLE naming why, nothing written", async () => {
    const store = await liveStoreWith(await keys.token("guarded-store"));
    try {
      const { key, token } = await grant("alice");
      const error = await refusal(
        guardedGrpcClient(store.url).put({ key, name: "n", value: text("x"), fencingToken: token }),
      );
      expect(error.code).toBe(Code.Unavailable);
      expect(error.rawMessage).toMatch(/could not confirm the fencing token.*permission_denied/);
      expect((await grpc.list({ key })).highestToken).toBe(0n);
    } finally {
      await store.close();
    }
  });
});

describe("guarded store configuration", () => {
  const lease = ["--lease-url", "http://127.0.0.1:7070"];

  it("defaults to monotonic mode on its own port and data folder, in development mode", () => {
    const config = parseGuardedConfig(lease, {});
    expect(config).toMatchObject({
      fenceMode: "monotonic",
      listenPort: 7071,
      dataDir: ".leasehold/guarded-pgdata",
      leaseUrl: "http://127.0.0.1:7070",
      auth: { keys: undefined },
    });
  });

  it("reads the environment like the lease server, flags first", () => {
    const config = parseGuardedConfig(["--fence-mode", "live"], {
      LEASEHOLD_FENCE_MODE: "monotonic",
      LEASEHOLD_LEASE_URL: "http://lease:7070",
      LEASEHOLD_LISTEN: "0.0.0.0:9000",
      DATABASE_URL: "postgres://x@db/y",
      LEASEHOLD_JWT_SECRET: "s".repeat(32),
      LEASEHOLD_LEASE_TOKEN: "a.b.c",
    });
    expect(config).toMatchObject({
      fenceMode: "live",
      leaseUrl: "http://lease:7070",
      listenHost: "0.0.0.0",
      listenPort: 9000,
      databaseUrl: "postgres://x@db/y",
    });
  });

  it("refuses live mode without a lease URL, an unknown mode and a malformed URL, naming the setting", () => {
    expect(() => parseGuardedConfig(["--fence-mode", "live"], {})).toThrow(/--lease-url/);
    expect(() => parseGuardedConfig(["--fence-mode", "strict"], {})).toThrow(
      /--fence-mode \(LEASEHOLD_FENCE_MODE\) must be monotonic or live/,
    );
    expect(() => parseGuardedConfig(["--lease-url", "lease:7070"], {})).toThrow(/--lease-url/);
  });

  it("takes the lease-server token from the environment or a file, not both, never empty", async () => {
    expect(
      parseGuardedConfig(lease, { LEASEHOLD_LEASE_TOKEN: " abc.def.ghi\n" }).leaseToken,
    ).toEqual({ text: "abc.def.ghi" });
    const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-lease-token-"));
    try {
      const file = path.join(dir, "token");
      expect(() => parseGuardedConfig([...lease, "--lease-token-file", file], {})).toThrow(
        /--lease-token-file \(LEASEHOLD_LEASE_TOKEN_FILE\): cannot read/,
      );
      await writeFile(file, "\n");
      expect(() => parseGuardedConfig([...lease, "--lease-token-file", file], {})).toThrow(
        /is empty/,
      );
      await writeFile(file, "abc.def.ghi\n");
      expect(parseGuardedConfig([...lease, "--lease-token-file", file], {}).leaseToken).toEqual({
        file,
      });
      expect(() =>
        parseGuardedConfig([...lease, "--lease-token-file", file], { LEASEHOLD_LEASE_TOKEN: "x" }),
      ).toThrow(/set only one of LEASEHOLD_LEASE_TOKEN and --lease-token-file/);
      expect(() => parseGuardedConfig(lease, { LEASEHOLD_LEASE_TOKEN: " " })).toThrow(
        /LEASEHOLD_LEASE_TOKEN must not be empty/,
      );
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
