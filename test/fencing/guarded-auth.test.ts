// The guarded store's callers and its fence (DESIGN §7): it authenticates
// every call as the lease server does (the same keys and settings), keeps
// each account to its own documents, and never raises a session's fence past
// a token the lease server has granted for that session. A write that would
// raise the fence is confirmed with CheckFence; one at the highest token the
// store has seen needs no lease server.

import { randomUUID } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import http from "node:http";
import os from "node:os";
import path from "node:path";
import { Code } from "@connectrpc/connect";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ConfigError } from "../../src/config/settings.js";
import { ErrorInfoSchema } from "../../src/gen/google/rpc/error_details_pb.js";
import { parseGuardedConfig } from "../../src/guarded/config.js";
import { startGuardedServer as startGuardedWithLogger } from "../../src/guarded/server.js";
import type { SessionKey } from "../../src/lease/types.js";
import { createLogger } from "../../src/log/logger.js";
import { durationFromMillis } from "../../src/server/rpc/convert.js";
import type { RunningServer } from "../../src/server/server.js";
import { failure } from "../support/calls.js";
import { useTestDatabase } from "../support/fixture.js";
import {
  grpcClient,
  guardedConnectClient,
  guardedGrpcClient,
  testGuardedArgs,
} from "../support/server.js";
import { startTcpProxy, type TcpProxy } from "../support/tcp-proxy.js";
import { bearer, createTestKeys, type TestKeys } from "../support/tokens.js";

const { db, defer, startServer, startGuardedServer } = useTestDatabase();
const maxToken = 9_223_372_036_854_775_807n;
const text = (s: string) => new TextEncoder().encode(s);
const read = (b: Uint8Array) => new TextDecoder().decode(b);

let keys: TestKeys;
let leaseServer: RunningServer;
let tokenDir: string;

beforeAll(async () => {
  keys = await createTestKeys();
  leaseServer = await startServer(keys.args);
  tokenDir = await mkdtemp(path.join(os.tmpdir(), "leasehold-guarded-auth-"));
});
afterAll(async () => {
  await rm(tokenDir, { recursive: true, force: true });
});

/** A guarded store with the lease server's keys, presenting its own fence-scope token. */
async function storeWithKeys(leaseUrl: string, extra: string[] = []): Promise<RunningServer> {
  const file = path.join(tokenDir, `${randomUUID()}.jwt`);
  const token = await keys.token("guarded-store", { scope: "leasehold:fence" });
  await writeFile(file, `${token}\n`, { mode: 0o600 });
  return startGuardedServer([
    ...keys.args,
    ...["--lease-url", leaseUrl, "--lease-token-file", file, "--lease-timeout", "1s"],
    ...extra,
  ]);
}

/** A grant of a fresh session of `account` by the lease server; its token. */
async function grant(account: string, key?: SessionKey) {
  const k = key ?? { accountId: account, sessionId: `s-${randomUUID()}` };
  const answer = await grpcClient(leaseServer.url).acquire(
    { key: k, ttl: durationFromMillis(60_000), holder: "run" },
    bearer(await keys.token(account)),
  );
  const lease = answer.lease;
  if (!lease) throw new Error("not granted");
  return { key: k, token: lease.fencingToken, runId: lease.runId };
}

/** Releases the run's lease, so that the next grant of the session is a new token. */
async function release(key: SessionKey, runId: string) {
  await grpcClient(leaseServer.url).release(
    { key, runId },
    bearer(await keys.token(key.accountId)),
  );
}

async function fenceRow(key: SessionKey): Promise<bigint | undefined> {
  const [row] = await db.sql<{ highestToken: bigint }[]>`
    SELECT highest_token FROM leasehold_fences
    WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
  return row?.highestToken;
}

describe("guarded store callers", () => {
  let store: RunningServer;
  beforeAll(async () => {
    store = await storeWithKeys(leaseServer.url);
  });

  it("Get, List and Put without a token are UNAUTHENTICATED (gRPC and Connect), and nothing is written", async () => {
    const { key, token } = await grant("alice");
    for (const client of [guardedGrpcClient(store.url), guardedConnectClient(store.url)]) {
      // One at a time: a refusal is awaited as soon as its call is made.
      const calls = [
        () => client.put({ key, name: "n", value: text("x"), fencingToken: token }),
        () => client.get({ key, name: "n" }),
        () => client.list({ key }),
      ];
      for (const call of calls) {
        const error = await failure(call());
        expect(error.code).toBe(Code.Unauthenticated);
        expect(error.rawMessage).toMatch(/missing bearer token/);
      }
    }
    const forged = await keys.token("alice", { secret: new Uint8Array(32).fill(7) });
    const error = await failure(guardedGrpcClient(store.url).list({ key }, bearer(forged)));
    expect(error.code).toBe(Code.Unauthenticated);
    expect(await fenceRow(key)).toBeUndefined();
  });

  it("another account's documents are PERMISSION_DENIED for Get, List and Put; its own pass", async () => {
    const { key, token } = await grant("alice");
    const client = guardedGrpcClient(store.url);
    const alice = bearer(await keys.token("alice"));
    await client.put({ key, name: "notes", value: text("alice's"), fencingToken: token }, alice);

    const mallory = bearer(await keys.token("mallory"));
    const calls = [
      () => client.get({ key, name: "notes" }, mallory),
      () => client.list({ key }, mallory),
      () =>
        client.put({ key, name: "notes", value: text("mallory's"), fencingToken: token }, mallory),
    ];
    for (const call of calls) {
      const error = await failure(call());
      expect(error.code).toBe(Code.PermissionDenied);
      expect(error.rawMessage).toBe("key.account_id is not the account of the caller's token");
    }
    expect(read((await client.get({ key, name: "notes" }, alice)).value)).toBe("alice's");
    expect((await client.list({ key }, alice)).highestToken).toBe(token);
  });

  it("a Put over HTTP/1.1 is refused from its headers, before its body: no token is 401, a writer whose leasehold-account-id names another account is 403, each while 5 MB of it are still unsent (issue 34)", async () => {
    const url = new URL(store.url);
    const mallory = `Bearer ${await keys.token("mallory")}`;
    const refusal = (headers: Record<string, string>) =>
      new Promise<{ status: number; body: string }>((resolve, reject) => {
        const req = http.request({
          host: url.hostname,
          port: url.port,
          path: "/leasehold.guarded.v1.GuardedStoreService/Put",
          method: "POST",
          agent: false,
          headers: {
            "content-type": "application/json",
            "content-length": String(5 * 1024 * 1024),
            ...headers,
          },
        });
        req.on("error", reject);
        req.on("response", (res) => {
          let body = "";
          res.setEncoding("utf8");
          res.on("data", (chunk: string) => {
            body += chunk;
          });
          res.on("end", () => {
            req.destroy();
            resolve({ status: res.statusCode ?? 0, body });
          });
        });
        // The first 64 KiB of a body declared at 5 MiB; the rest never comes.
        req.write(Buffer.alloc(64 * 1024, " "));
      });
    const none = await refusal({});
    expect(none.status).toBe(401);
    expect(JSON.parse(none.body)).toMatchObject({
      code: "unauthenticated",
      message: expect.stringMatching(/^missing bearer token/),
    });
    const other = await refusal({ authorization: mallory, "leasehold-account-id": "alice" });
    expect(other.status).toBe(403);
    expect(JSON.parse(other.body)).toMatchObject({
      code: "permission_denied",
      message: "leasehold-account-id is not the account of the caller's token",
    });
  });

  it("calls go through the lease server's call policy: the request id comes back on a served call and on a refused one, sent or generated (gRPC and Connect)", async () => {
    const { key, token } = await grant("alice");
    const alice = bearer(await keys.token("alice"));
    const mallory = bearer(await keys.token("mallory"));
    for (const client of [guardedGrpcClient(store.url), guardedConnectClient(store.url)]) {
      const servedId = `req-${randomUUID()}`;
      let answered: string | null = null;
      await client.put(
        { key, name: "ids", value: text("x"), fencingToken: token },
        {
          headers: { ...alice.headers, "x-request-id": servedId },
          onHeader: (h) => {
            answered = h.get("x-request-id");
          },
        },
      );
      expect(answered).toBe(servedId);

      const refusedId = `req-${randomUUID()}`;
      const denied = await failure(
        client.get(
          { key, name: "ids" },
          { headers: { ...mallory.headers, "x-request-id": refusedId } },
        ),
      );
      expect(denied.code).toBe(Code.PermissionDenied);
      expect(denied.metadata.get("x-request-id")).toBe(refusedId);
      // No id sent: the policy makes one, as on the lease server.
      const anonymous = await failure(client.list({ key }));
      expect(anonymous.code).toBe(Code.Unauthenticated);
      expect(anonymous.metadata.get("x-request-id")).toMatch(/^[0-9a-f-]{36}$/);
    }
  });

  it("a refused call writes one log line, as on the lease server: request id, method, account and code, never the token", async () => {
    const lines: string[] = [];
    const file = path.join(tokenDir, `${randomUUID()}.jwt`);
    await writeFile(file, `${await keys.token("guarded-store", { scope: "leasehold:fence" })}\n`);
    const config = parseGuardedConfig(
      [
        ...testGuardedArgs,
        ...["--database-url", db.url, "--lease-url", leaseServer.url, "--lease-token-file", file],
        ...keys.args,
      ],
      {},
    );
    const logged = await startGuardedWithLogger(
      config,
      createLogger({
        level: "info",
        destination: { write: (line: string) => void lines.push(line) },
      }),
    );
    defer(() => logged.close());
    const { key } = await grant("alice");
    const token = await keys.token("mallory");
    const requestId = `req-${randomUUID()}`;
    const denied = await failure(
      guardedGrpcClient(logged.url).get(
        { key, name: "n" },
        { headers: { ...bearer(token).headers, "x-request-id": requestId } },
      ),
    );
    expect(denied.code).toBe(Code.PermissionDenied);
    const ours = lines
      .map((l) => JSON.parse(l) as Record<string, unknown>)
      .filter((l) => l.requestId === requestId);
    expect(ours).toEqual([
      expect.objectContaining({
        msg: "rpc",
        method: "leasehold.guarded.v1.GuardedStoreService/Get",
        account: "mallory",
        code: "permission_denied",
      }),
    ]);
    expect(lines.join("")).not.toContain(token);
  });
});

describe("the fence rises only to granted tokens", () => {
  let store: RunningServer;
  beforeAll(async () => {
    store = await storeWithKeys(leaseServer.url);
  });

  it("S7: a Put with 2^63−1, never granted, is refused (LEASE_NOT_HELD, not_found) and the fence is unchanged; the holder still writes", async () => {
    const { key, token } = await grant("alice");
    const client = guardedGrpcClient(store.url);
    const alice = bearer(await keys.token("alice"));
    await client.put({ key, name: "doc", value: text("v1"), fencingToken: token }, alice);

    const error = await failure(
      client.put({ key, name: "doc", value: text("poison"), fencingToken: maxToken }, alice),
    );
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(error.findDetails(ErrorInfoSchema)[0]).toMatchObject({
      reason: "LEASE_NOT_HELD",
      metadata: { cause: "not_found" },
    });
    expect(error.rawMessage).toBe(
      `lease not held: fencing token ${maxToken} was never granted for ${key.accountId}/${key.sessionId} (the newest grant is ${token}); write with the token your Acquire returned`,
    );
    expect(await fenceRow(key)).toBe(token);
    // The real holder is not locked out.
    const put = await client.put(
      { key, name: "doc", value: text("v2"), fencingToken: token },
      alice,
    );
    expect(put.highestToken).toBe(token);
    expect(read((await client.get({ key, name: "doc" }, alice)).value)).toBe("v2");
  });

  it("S7: a never-written session cannot be poisoned either: its fence row is not even created", async () => {
    const { key } = await grant("alice");
    const error = await failure(
      guardedGrpcClient(store.url).put(
        { key, name: "doc", value: text("x"), fencingToken: maxToken },
        bearer(await keys.token("alice")),
      ),
    );
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(await fenceRow(key)).toBeUndefined();
  });

  it("S6, S7: a write at a new granted token raises the fence; a raising write with a replaced run's token is STALE", async () => {
    const first = await grant("alice");
    const alice = bearer(await keys.token("alice"));
    const client = guardedGrpcClient(store.url);
    await client.put(
      { key: first.key, name: "doc", value: text("A"), fencingToken: first.token },
      alice,
    );
    await release(first.key, first.runId);
    const second = await grant("alice", first.key);
    await release(second.key, second.runId);
    const third = await grant("alice", first.key);
    expect(third.token).toBeGreaterThan(second.token);

    // The second run never wrote: its token would raise the fence, but a
    // newer grant exists.
    const stale = await failure(
      client.put(
        { key: first.key, name: "doc", value: text("B"), fencingToken: second.token },
        alice,
      ),
    );
    expect(stale.code).toBe(Code.Aborted);
    expect(stale.findDetails(ErrorInfoSchema)[0]?.metadata).toMatchObject({
      highest_token: String(third.token),
      presented_token: String(second.token),
    });
    expect(await fenceRow(first.key)).toBe(first.token);

    const put = await client.put(
      { key: first.key, name: "doc", value: text("C"), fencingToken: third.token },
      alice,
    );
    expect(put.highestToken).toBe(third.token);
    expect(await fenceRow(first.key)).toBe(third.token);
  });
});

describe("the lease server unreachable", () => {
  let proxy: TcpProxy;
  let store: RunningServer;
  beforeAll(async () => {
    proxy = await startTcpProxy(leaseServer.url);
    store = await storeWithKeys(proxy.url);
  });
  afterAll(async () => {
    await proxy.close();
  });

  it("a write that would raise the fence is UNAVAILABLE and changes nothing; a write at the highest token seen proceeds", async () => {
    const alice = bearer(await keys.token("alice"));
    const client = guardedGrpcClient(store.url);
    const first = await grant("alice");
    await client.put(
      { key: first.key, name: "doc", value: text("A1"), fencingToken: first.token },
      alice,
    );
    await release(first.key, first.runId);
    const second = await grant("alice", first.key);

    proxy.drop();
    try {
      const error = await failure(
        client.put(
          { key: first.key, name: "doc", value: text("B1"), fencingToken: second.token },
          alice,
        ),
      );
      expect(error.code).toBe(Code.Unavailable);
      expect(error.rawMessage).toMatch(/^the lease server could not confirm the fencing token/);
      expect(await fenceRow(first.key)).toBe(first.token);

      const put = await client.put(
        { key: first.key, name: "doc", value: text("A2"), fencingToken: first.token },
        alice,
      );
      expect(put.highestToken).toBe(first.token);
      expect(read((await client.get({ key: first.key, name: "doc" }, alice)).value)).toBe("A2");
    } finally {
      proxy.pass();
    }
    // Reachable again: the new run's write raises the fence.
    const put = await client.put(
      { key: first.key, name: "doc", value: text("B1"), fencingToken: second.token },
      alice,
    );
    expect(put.highestToken).toBe(second.token);
  });
});

describe("guarded store authentication settings", () => {
  const configError = (argv: string[], env: NodeJS.ProcessEnv = {}): string => {
    try {
      parseGuardedConfig(argv, env);
    } catch (error) {
      expect(error).toBeInstanceOf(ConfigError);
      return (error as Error).message;
    }
    throw new Error("the configuration was accepted");
  };
  const lease = ["--lease-url", "http://127.0.0.1:7070"];

  it("--lease-url is required in both modes", () => {
    for (const mode of ["monotonic", "live"]) {
      expect(configError(["--fence-mode", mode])).toMatch(
        /--lease-url \(LEASEHOLD_LEASE_URL\) is required/,
      );
    }
  });

  it("takes the lease server's token settings and variables: LEASEHOLD_JWT_SECRET, --jwks-file, issuer, audience, account claim, tokens without exp", () => {
    const secret = "s".repeat(40);
    const config = parseGuardedConfig([...lease, "--account-claim", "org"], {
      LEASEHOLD_JWT_SECRET: secret,
      LEASEHOLD_JWT_ISSUER: "https://issuer.example",
      LEASEHOLD_JWT_AUDIENCE: "store, other",
      LEASEHOLD_ALLOW_TOKENS_WITHOUT_EXP: "on",
      LEASEHOLD_LEASE_TOKEN: "a.b.c",
    });
    expect(config.auth).toEqual({
      keys: { kind: "hs256", secret: new TextEncoder().encode(secret) },
      issuer: "https://issuer.example",
      audience: ["store", "other"],
      accountClaim: "org",
      allowTokensWithoutExp: true,
    });
    expect(configError([...lease], { LEASEHOLD_JWT_SECRET: "short" })).toMatch(/at least 32 bytes/);
    expect(configError([...lease, "--jwks-file", path.join(tokenDir, "missing.json")])).toMatch(
      /--jwks-file \(LEASEHOLD_JWKS_FILE\): cannot read/,
    );
  });

  it("development mode (no keys) listens on loopback only; with keys the store needs its own lease-server token", () => {
    expect(configError([...lease, "--listen", "0.0.0.0:7071"])).toMatch(
      /refusing to listen on 0\.0\.0\.0 without authentication keys: anyone could read and write every account's documents/,
    );
    expect(parseGuardedConfig([...lease], {}).auth.keys).toBeUndefined();
    expect(configError([...lease], { LEASEHOLD_JWT_SECRET: "s".repeat(40) })).toMatch(
      /needs its own token for the lease server's CheckFence: set LEASEHOLD_LEASE_TOKEN or --lease-token-file/,
    );
    const config = parseGuardedConfig([...lease, "--listen", "0.0.0.0:7071"], {
      LEASEHOLD_JWT_SECRET: "s".repeat(40),
      LEASEHOLD_LEASE_TOKEN: "a.b.c",
    });
    expect(config.listenHost).toBe("0.0.0.0");
  });
});
