// Property tests (fast-check) over a real socket: random and hostile values
// in every field of every LeaseService request, and random bytes as request
// bodies. The only answers are documented codes (never INTERNAL or
// UNKNOWN), a request with a bad field changes nothing stored, another
// account's leases never change, and the server stays up.

import { randomUUID } from "node:crypto";
import http2 from "node:http2";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import fc from "fast-check";
import { beforeAll, describe, expect, it } from "vitest";
import {
  Health,
  HealthCheckResponse_ServingStatus as Status,
} from "../src/gen/grpc/health/v1/health_pb.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { documentedCodes } from "./support/documented-codes.js";
import { useTestServer } from "./support/fixture.js";
import { storedState } from "./support/leases.js";
import { adminScope } from "./support/tokens.js";

// A short wait bound: a valid random wait on a held session cannot stall a run.
const { db, server, client, keys } = useTestServer({ keys: true, args: ["--max-wait", "200ms"] });
const tokens: Record<string, string | undefined> = {};
const unimplemented = new Set<string>();

beforeAll(async () => {
  tokens.none = undefined;
  tokens.garbage = "Bearer \u00ffgarbage.\u00e9";
  tokens.fuzz = `Bearer ${await keys.token("fuzz")}`;
  tokens.admin = `Bearer ${await keys.token("fuzz", { scope: adminScope })}`;
  const victim = { headers: { authorization: `Bearer ${await keys.token("victim")}` } };
  const ttl = { seconds: 3600n, nanos: 0 };
  await client.acquire({ key: { accountId: "victim", sessionId: "held" }, ttl }, victim);
  await client.acquire(
    { key: { accountId: "fuzz", sessionId: "held" }, ttl },
    {
      headers: { authorization: tokens.fuzz },
    },
  );
  // Methods this build does not serve answer UNIMPLEMENTED; only those may.
  for (const method of LeaseService.methods) {
    const error = await callMethod(method.localName, {}, tokens.admin).catch((e) => e);
    if (ConnectError.from(error).code === Code.Unimplemented) unimplemented.add(method.localName);
  }
});

// ---- values ---------------------------------------------------------------

const hostileStrings = [
  "",
  " ",
  "*",
  "victim",
  "fuzz",
  "held",
  "' OR 1=1 --",
  "'; DROP TABLE leases; --",
  "%00",
  "\u0000",
  "\u202e",
  "a".repeat(129),
  "x".repeat(5000),
  "../../etc/passwd",
  "\\",
  "NULL",
  "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
  "\ud800",
  "e1:9223372036854775808",
  "djE6",
];
const text = fc.oneof(
  fc.constantFrom(...hostileStrings),
  fc.string({ unit: "binary", maxLength: 150 }),
  fc.string({ maxLength: 300 }),
);
const id = fc.oneof(fc.constantFrom("fuzz", "victim", "held", "other"), text);
// Ids that no rule accepts: a character outside the allowed set, or too long.
const badId = fc.oneof(
  fc.constantFrom("a b", "a/b", "a\u0000", "é", "a".repeat(129), "' OR 1=1 --", "*", "%00"),
  fc.string({ minLength: 1, maxLength: 50 }).map((s) => `${s}\u0001`),
);
const int64 = fc.bigInt(-(2n ** 63n), 2n ** 63n - 1n);
const duration = fc.option(
  fc.record({
    seconds: fc.oneof(int64, fc.bigInt(-5n, 5n)),
    nanos: fc.oneof(
      fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 }),
      fc.integer({ min: 0, max: 999_999_999 }),
    ),
  }),
  { nil: undefined },
);
const runId = fc.oneof(
  text,
  fc.uuid(),
  fc.uuid().map((u) => u.toUpperCase()),
);
const pageSize = fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 });
const key = (accountAndSession: fc.Arbitrary<{ accountId: string; sessionId: string }>) =>
  fc.option(accountAndSession, { nil: undefined });

function requests(k: fc.Arbitrary<{ accountId: string; sessionId: string } | undefined>) {
  return {
    acquire: fc.record({ key: k, runId, ttl: duration, wait: duration, holder: text }),
    renew: fc.record({ key: k, runId, ttl: duration }),
    release: fc.record({ key: k, runId }),
    get: fc.record({ key: k }),
    list: fc.record({ accountId: id, pageSize, pageToken: text }),
    keepAlive: fc.record({ key: k, runId, ttl: duration }),
    watch: fc.record({ key: k, includeRenewals: fc.boolean() }),
    requestHandoff: fc.record({ key: k, requesterHolder: text, reason: text }),
    history: fc.record({ key: k, pageSize, pageToken: text }),
    checkFence: fc.record({ key: k, fencingToken: int64 }),
    revoke: fc.record({ key: k, reason: text }),
  } as const;
}

// ---- calls ----------------------------------------------------------------

async function callMethod(method: string, request: unknown, authorization?: string) {
  const options = {
    headers: authorization === undefined ? {} : { authorization },
    signal: AbortSignal.timeout(10_000),
  };
  const c = client as unknown as Record<
    string,
    (req: unknown, o: typeof options) => Promise<unknown> | AsyncIterable<unknown>
  >;
  const fn = c[method];
  if (!fn) throw new Error(`no method ${method}`);
  if (method === "watch") {
    const controller = new AbortController();
    try {
      const stream = fn.call(client, request, { ...options, signal: controller.signal });
      for await (const _ of stream as AsyncIterable<unknown>) return;
      return;
    } finally {
      controller.abort();
    }
  }
  if (method === "keepAlive" || method === "keep") {
    const controller = new AbortController();
    async function* one() {
      yield request;
      await new Promise<void>((resolve) =>
        controller.signal.addEventListener("abort", () => resolve()),
      );
    }
    try {
      const stream = fn.call(client, one(), { ...options, signal: controller.signal });
      for await (const _ of stream as AsyncIterable<unknown>) return;
      return;
    } finally {
      controller.abort();
    }
  }
  return fn.call(client, request, options);
}

/** The code of a call: undefined for success. Fails the property on an undocumented one. */
async function codeOf(method: string, request: unknown, token: string | undefined) {
  try {
    await callMethod(method, request, token);
    return undefined;
  } catch (error) {
    const ce = ConnectError.from(error);
    if (ce.code === Code.Unimplemented && unimplemented.has(method)) return ce.code;
    if (!documentedCodes.has(ce.code)) {
      throw new Error(`${method} answered ${Code[ce.code]}: ${ce.rawMessage}`);
    }
    return ce.code;
  }
}

const methodAndRequest = (k: Parameters<typeof requests>[0]) =>
  fc.oneof(
    ...Object.entries(requests(k)).map(([method, arb]) =>
      arb.map((request) => ({ method, request })),
    ),
  );
const token = fc.constantFrom("none", "garbage", "fuzz", "admin");

/** A gRPC call with `body` over a bare HTTP/2 connection: the grpc-status and grpc-message it ends with. */
function rawGrpc(path: string, body: Buffer): Promise<{ status?: string; message: string }> {
  return new Promise((resolve, reject) => {
    const session = http2.connect(server.url);
    session.on("error", reject);
    const req = session.request({
      ":method": "POST",
      ":path": path,
      "content-type": "application/grpc+proto",
      te: "trailers",
      authorization: tokens.fuzz ?? "",
    });
    let h: http2.IncomingHttpHeaders = {};
    req.on("response", (headers) => {
      h = { ...headers, ...h };
    });
    req.on("trailers", (t) => {
      h = { ...h, ...t };
    });
    req.on("close", () => {
      session.close();
      resolve({
        status: h["grpc-status"] as string | undefined,
        message: decodeURIComponent(String(h["grpc-message"] ?? "")),
      });
    });
    req.resume();
    req.end(body);
  });
}

/** The same over gRPC-Web: the status from the body's trailer frame. */
async function rawGrpcWeb(
  path: string,
  body: Buffer,
  encoding?: string,
): Promise<{ status?: string; message: string }> {
  const web = await fetch(`${server.url}${path}`, {
    method: "POST",
    headers: {
      "content-type": "application/grpc-web+proto",
      authorization: tokens.fuzz ?? "",
      ...(encoding ? { "grpc-encoding": encoding } : {}),
    },
    body,
  });
  const text = Buffer.from(await web.arrayBuffer()).toString("latin1");
  return {
    status: /grpc-status: ?(\d+)\r\n/.exec(text)?.[1],
    message: decodeURIComponent(/grpc-message: ?([^\r]*)\r\n/.exec(text)?.[1] ?? ""),
  };
}

const victimRows = async () => ({
  leases: [...(await db.sql`SELECT * FROM leases WHERE account_id = 'victim'`)],
  events: [...(await db.sql`SELECT * FROM lease_events WHERE account_id = 'victim' ORDER BY id`)],
});

describe("hostile input over a real socket", () => {
  it("S3: a request with a bad id in it is refused with a documented code and changes nothing", async () => {
    const badKey = key(
      fc.oneof(
        fc.record({ accountId: fc.constant("fuzz"), sessionId: badId }),
        fc.record({ accountId: badId, sessionId: id }),
      ),
    ).filter((k) => k !== undefined);
    await fc.assert(
      fc.asyncProperty(methodAndRequest(badKey), token, badId, async (call, t, badAccount) => {
        const before = await storedState(db.sql);
        const request =
          call.method === "list"
            ? { ...(call.request as object), accountId: badAccount }
            : call.request;
        const code = await codeOf(call.method, request, tokens[t]);
        expect(code).toBeDefined();
        expect(await storedState(db.sql)).toEqual(before);
      }),
      { numRuns: 300 },
    );
  });

  it("S3: random values in every field get documented codes only; another account's leases never change", async () => {
    const before = await victimRows();
    await fc.assert(
      fc.asyncProperty(
        methodAndRequest(key(fc.record({ accountId: id, sessionId: id }))),
        token,
        async (call, t) => {
          await codeOf(call.method, call.request, tokens[t]);
        },
      ),
      { numRuns: 400 },
    );
    expect(await victimRows()).toEqual(before);
  });

  it("random bytes and JSON as request bodies get documented codes and change nothing", async () => {
    const methods = LeaseService.methods.filter((m) => m.methodKind === "unary");
    const before = await storedState(db.sql);
    await fc.assert(
      fc.asyncProperty(
        fc.constantFrom(...methods.map((m) => m.name)),
        fc.oneof(
          fc.uint8Array({ maxLength: 300 }).map((b) => ({ type: "application/proto", body: b })),
          fc.json().map((j) => ({ type: "application/json", body: j })),
          fc
            .string({ unit: "binary", maxLength: 200 })
            .map((s) => ({ type: "application/json", body: s })),
        ),
        async (method, { type, body }) => {
          const res = await fetch(`${server.url}/leasehold.v1.LeaseService/${method}`, {
            method: "POST",
            headers: { "content-type": type, authorization: tokens.fuzz ?? "" },
            body,
          });
          if (res.status === 200) {
            await res.arrayBuffer();
            return;
          }
          const error = (await res.json()) as { code?: string };
          expect([
            "invalid_argument",
            "failed_precondition",
            "permission_denied",
            "unauthenticated",
            "resource_exhausted",
            ...(unimplemented.has(method[0]?.toLowerCase() + method.slice(1))
              ? ["unimplemented"]
              : []),
          ]).toContain(error.code);
        },
      ),
      { numRuns: 300 },
    );
    // Random bodies can decode to valid requests of the fuzz account only.
    const after = await storedState(db.sql);
    const others = (s: unknown) =>
      (s as { leases: { accountId: string }[] }).leases.filter((l) => l.accountId !== "fuzz");
    expect(others(after)).toEqual(others(before));
  });

  it("a body that is not protobuf is INVALID_ARGUMENT in gRPC, gRPC-Web and Connect, unary and streaming", async () => {
    // One envelope holding a field with number 0: no protobuf parser accepts it.
    const envelope = Buffer.from([0, 0, 0, 0, 1, 0]);
    for (const path of [
      "/leasehold.v1.LeaseService/Get",
      "/leasehold.v1.LeaseService/Watch",
      "/grpc.health.v1.Health/Check",
    ]) {
      expect((await rawGrpc(path, envelope)).status, path).toBe("3");
    }
    expect((await rawGrpcWeb("/leasehold.v1.LeaseService/Get", envelope)).status).toBe("3");

    const connect = await fetch(`${server.url}/leasehold.v1.LeaseService/Get`, {
      method: "POST",
      headers: { "content-type": "application/proto", authorization: tokens.fuzz ?? "" },
      body: Buffer.from([0]),
    });
    expect(connect.status).toBe(400);
    expect(((await connect.json()) as { code: string }).code).toBe("invalid_argument");
  });

  it("a call that takes one request message and gets none or two is INVALID_ARGUMENT naming the request message, in gRPC and gRPC-Web, unary and server-streaming", async () => {
    const empty = Buffer.from([0, 0, 0, 0, 0]);
    const bodies = { none: Buffer.alloc(0), two: Buffer.concat([empty, empty]) };
    for (const path of ["/leasehold.v1.LeaseService/Get", "/leasehold.v1.LeaseService/Watch"]) {
      for (const [count, body] of Object.entries(bodies)) {
        for (const [protocol, answer] of [
          ["gRPC", await rawGrpc(path, body)],
          ["gRPC-Web", await rawGrpcWeb(path, body)],
        ] as const) {
          expect(answer, `${protocol} ${path}, ${count} messages`).toMatchObject({
            status: "3",
            message: expect.stringMatching(/^request message: .*one/),
          });
        }
      }
    }
  });

  it("a message flagged compressed in a call that names no compression is INVALID_ARGUMENT naming the request message, in gRPC, gRPC-Web and Connect streaming, unary and server-streaming", async () => {
    // Flags 0x01 (compressed) on an empty message; grpc-encoding absent or identity.
    const compressed = Buffer.from([1, 0, 0, 0, 0]);
    const invalid = { status: "3", message: expect.stringMatching(/^request message: .*compress/) };
    for (const path of ["/leasehold.v1.LeaseService/Get", "/leasehold.v1.LeaseService/Watch"]) {
      expect(await rawGrpc(path, compressed), `gRPC ${path}`).toMatchObject(invalid);
      for (const encoding of [undefined, "identity"]) {
        expect(
          await rawGrpcWeb(path, compressed, encoding),
          `gRPC-Web ${path}, grpc-encoding ${encoding}`,
        ).toMatchObject(invalid);
      }
    }
    const connect = await fetch(`${server.url}/leasehold.v1.LeaseService/Watch`, {
      method: "POST",
      headers: { "content-type": "application/connect+proto", authorization: tokens.fuzz ?? "" },
      body: compressed,
    });
    const body = Buffer.from(await connect.arrayBuffer());
    // The Connect protocol ends a stream with a JSON message flagged 0x02.
    expect(body[0]).toBe(2);
    expect(JSON.parse(body.subarray(5).toString("utf8"))).toMatchObject({
      error: {
        code: "invalid_argument",
        message: expect.stringMatching(/^request message: .*compress/),
      },
    });
  });

  it("the server is still up and answers correctly after the storm", async () => {
    const health = createClient(Health, createGrpcTransport({ baseUrl: server.url }));
    expect((await health.check({ service: "" })).status).toBe(Status.SERVING);
    const got = await client.get(
      { key: { accountId: "fuzz", sessionId: `after-${randomUUID()}` } },
      { headers: { authorization: tokens.fuzz ?? "" } },
    );
    expect(got.held).toBe(false);
  });
});
