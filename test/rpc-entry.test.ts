// Requests where they enter the server, before any method runs: a method or
// service the server does not have, an RPC path asked with the wrong content
// type or HTTP method, JSON fields the API does not have. On both serving
// paths of the lease server (--grpc-path native and connect) and on the
// guarded store, over every protocol where the case applies (gRPC, gRPC-Web,
// Connect), on real sockets.

import http from "node:http";
import http2 from "node:http2";
import { gzipSync } from "node:zlib";
import {
  create,
  type DescMethod,
  type DescMethodStreaming,
  type DescMethodUnary,
} from "@bufbuild/protobuf";
import { BinaryWriter, WireType } from "@bufbuild/protobuf/wire";
import { Code, createClient, type Transport } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import * as grpc from "@grpc/grpc-js";
import { beforeAll, describe, expect, it } from "vitest";
import { settingsHelp } from "../src/config/settings.js";
import { GuardedStoreService } from "../src/gen/leasehold/guarded/v1/guarded_pb.js";
import { AcquireRequestSchema, LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { guardedSettings, parseGuardedConfig } from "../src/guarded/config.js";
import { parseServerConfig, serverSettings } from "../src/server/config/server-config.js";
import type { RunningServer } from "../src/server/server.js";
import { failure } from "./support/calls.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { connectClient } from "./support/server.js";

const { startServer, startGuardedServer } = useTestDatabase();
let native: RunningServer;
let connectPath: RunningServer;
let guarded: RunningServer;
let accepting: RunningServer;

beforeAll(async () => {
  native = await startServer(["--grpc-path", "native"]);
  connectPath = await startServer(["--grpc-path", "connect"]);
  guarded = await startGuardedServer(["--lease-url", native.url]);
  accepting = await startServer(["--json-unknown-fields", "accept"]);
});

// Names for it.each, which runs before beforeAll has started the servers.
const servers = [
  "lease server, --grpc-path native",
  "lease server, --grpc-path connect",
  "guarded store",
] as const;
const serverNamed = (name: (typeof servers)[number]): RunningServer =>
  ({ [servers[0]]: native, [servers[1]]: connectPath, [servers[2]]: guarded })[name];

// ---- plain HTTP -------------------------------------------------------------

interface Answer {
  status: number;
  headers: Record<string, string | string[] | undefined>;
  body: Buffer;
  trailers?: Record<string, string | string[] | undefined>;
}

/** One request over HTTP/1.1, as curl sends it by default. */
function h1(
  baseUrl: string,
  path: string,
  options: { method?: string; headers?: http.OutgoingHttpHeaders; body?: Uint8Array } = {},
): Promise<Answer> {
  const { hostname, port } = new URL(baseUrl);
  return new Promise((resolve, reject) => {
    const req = http.request(
      { hostname, port, path, method: options.method ?? "POST", headers: options.headers },
      (res) => {
        const chunks: Buffer[] = [];
        res.on("data", (c: Buffer) => chunks.push(c));
        res.on("end", () =>
          resolve({
            status: res.statusCode ?? 0,
            headers: res.headers,
            body: Buffer.concat(chunks),
          }),
        );
      },
    );
    req.on("error", reject);
    req.end(options.body);
  });
}

/** One request over HTTP/2 (h2c), with its trailers. */
function h2(
  baseUrl: string,
  path: string,
  headers: http2.OutgoingHttpHeaders,
  body?: Uint8Array,
): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const session = http2.connect(baseUrl);
    session.on("error", reject);
    const stream = session.request({ ":method": "POST", ":path": path, ...headers });
    let answer: Answer | undefined;
    const chunks: Buffer[] = [];
    stream.on("response", (h) => {
      answer = { status: Number(h[":status"]), headers: h, body: Buffer.alloc(0) };
    });
    stream.on("trailers", (t) => {
      if (answer) answer.trailers = t;
    });
    stream.on("data", (c: Buffer) => chunks.push(c));
    stream.on("error", reject);
    stream.on("end", () => {
      session.close();
      if (!answer) reject(new Error("no response headers"));
      else resolve({ ...answer, body: Buffer.concat(chunks) });
    });
    stream.end(body);
  });
}

/** A gRPC-style envelope (flag 0) around a message. */
function envelope(payload: Uint8Array, flags = 0): Buffer {
  const out = Buffer.alloc(5 + payload.byteLength);
  out[0] = flags;
  out.writeUInt32BE(payload.byteLength, 1);
  out.set(payload, 5);
  return out;
}

/** The status of a gRPC or gRPC-Web answer: trailers, trailers-only headers, or gRPC-Web's trailer frame. */
function grpcStatus(a: Answer): { code: number; message: string } {
  let fields: Record<string, unknown> = { ...a.headers, ...a.trailers };
  if (fields["grpc-status"] === undefined) {
    // gRPC-Web: the last frame of the body, flag 0x80, holds the trailers as HTTP/1 header lines.
    let offset = 0;
    while (offset + 5 <= a.body.length) {
      const length = a.body.readUInt32BE(offset + 1);
      if (a.body[offset] === 0x80) {
        const text = a.body.subarray(offset + 5, offset + 5 + length).toString("latin1");
        fields = Object.fromEntries(
          text
            .split("\r\n")
            .filter(Boolean)
            .map((line) => {
              const i = line.indexOf(":");
              return [line.slice(0, i).trim().toLowerCase(), line.slice(i + 1).trim()];
            }),
        );
      }
      offset += 5 + length;
    }
  }
  return {
    code: Number(fields["grpc-status"]),
    message: decodeURIComponent(String(fields["grpc-message"] ?? "")),
  };
}

// ---- clients of every protocol ------------------------------------------------

const protocols = (baseUrl: string): [string, Transport][] => [
  ["gRPC", createGrpcTransport({ baseUrl })],
  ["gRPC-Web over HTTP/2", createGrpcWebTransport({ baseUrl, httpVersion: "2" })],
  ["gRPC-Web over HTTP/1.1", createGrpcWebTransport({ baseUrl, httpVersion: "1.1" })],
  ["Connect over HTTP/1.1", createConnectTransport({ baseUrl, httpVersion: "1.1" })],
  ["Connect over HTTP/2", createConnectTransport({ baseUrl, httpVersion: "2" })],
];

/** A method with another name on the same service: a method the server does not have. */
function renamed<M extends DescMethod>(method: M, name: string): M {
  return { ...method, name, localName: name.toLowerCase() };
}

async function callUnary(transport: Transport, method: DescMethod, input: Record<string, unknown>) {
  if (method.methodKind !== "unary") throw new Error("not unary");
  return transport.unary(method as DescMethodUnary, undefined, 10_000, undefined, input);
}

async function callServerStream(
  transport: Transport,
  method: DescMethod,
  input: Record<string, unknown>,
) {
  if (method.methodKind !== "server_streaming") throw new Error("not server streaming");
  async function* one() {
    yield input;
  }
  const res = await transport.stream(
    method as DescMethodStreaming,
    undefined,
    10_000,
    undefined,
    one(),
  );
  for await (const _ of res.message) {
    // Drain: the error, if any, comes at the end.
  }
}

describe("a method or service the server does not have (issue 30, item 3)", () => {
  it.each(servers)(
    "%s: UNIMPLEMENTED naming the method, over gRPC, gRPC-Web and Connect, unary and streaming",
    async (name) => {
      const server = serverNamed(name);
      const [service, other] =
        server === guarded
          ? [GuardedStoreService, LeaseService]
          : [LeaseService, GuardedStoreService];
      const unary = renamed(service.methods[1] as DescMethod, "Nope");
      const streaming = { ...renamed(LeaseService.method.watch, "NopeStream"), parent: service };
      for (const [protocol, transport] of protocols(server.url)) {
        const nope = await failure(callUnary(transport, unary, {}));
        expect([protocol, nope.code], nope.message).toEqual([protocol, Code.Unimplemented]);
        expect(nope.rawMessage).toBe(`unknown method: ${service.typeName} has no method "Nope"`);

        const unknownService = await failure(
          callUnary(transport, other.methods[0] as DescMethod, {}),
        );
        expect([protocol, unknownService.code]).toEqual([protocol, Code.Unimplemented]);
        expect(unknownService.rawMessage).toContain(`unknown service "${other.typeName}"`);
        expect(unknownService.rawMessage).toContain(service.typeName);

        if (protocol.startsWith("gRPC-Web over HTTP/1.1")) continue;
        const stream = await failure(callServerStream(transport, streaming, { key: freshKey() }));
        expect([protocol, stream.code]).toEqual([protocol, Code.Unimplemented]);
        expect(stream.rawMessage).toContain('no method "NopeStream"');
      }
    },
  );

  it.each(servers)(
    "%s: curl's POST of JSON to an unknown method gets the Connect error; GET of a missing page stays a plain 404",
    async (name) => {
      const server = serverNamed(name);
      const json = await h1(server.url, "/leasehold.v1.LeaseService/Nope", {
        headers: { "content-type": "application/json" },
        body: Buffer.from("{}"),
      });
      expect(json.status).toBe(501);
      expect(JSON.parse(json.body.toString())).toMatchObject({ code: "unimplemented" });

      const notRpc = await h1(server.url, "/nothing", {
        headers: { "content-type": "application/json" },
        body: Buffer.from("{}"),
      });
      expect(notRpc.status).toBe(501);
      expect(JSON.parse(notRpc.body.toString()).message).toMatch(
        /^no RPC at "\/nothing": RPC paths are \/<package>.<Service>\/<Method>/,
      );

      // A Connect GET names its protocol in the query.
      const get = await h1(
        server.url,
        `/leasehold.v1.LeaseService/Nope?connect=v1&encoding=json&message=${encodeURIComponent("{}")}`,
        { method: "GET" },
      );
      expect(get.status).toBe(501);
      expect(JSON.parse(get.body.toString())).toMatchObject({ code: "unimplemented" });

      const page = await h1(server.url, "/no-such-page.html", { method: "GET" });
      expect(page.status).toBe(404);
      expect(page.headers["content-type"]).toBe("text/plain; charset=utf-8");
      expect(page.body.toString()).toBe("not found\n");
    },
  );

  it("raw gRPC over HTTP/2: an unknown method is UNIMPLEMENTED in the trailers, with HTTP 200", async () => {
    for (const server of [native, connectPath]) {
      const a = await h2(
        server.url,
        "/leasehold.v1.LeaseService/Nope",
        { "content-type": "application/grpc", te: "trailers" },
        envelope(new Uint8Array()),
      );
      expect(a.status).toBe(200);
      expect(grpcStatus(a)).toEqual({
        code: Code.Unimplemented,
        message: 'unknown method: leasehold.v1.LeaseService has no method "Nope"',
      });
    }
  });
  it("an independent gRPC client (@grpc/grpc-js) sees UNIMPLEMENTED, not UNKNOWN from HTTP 405", async () => {
    for (const server of [native, connectPath, guarded]) {
      const client = new grpc.Client(new URL(server.url).host, grpc.credentials.createInsecure());
      try {
        const error = await new Promise<grpc.ServiceError>((resolve, reject) => {
          client.makeUnaryRequest(
            "/leasehold.v1.LeaseService/Nope",
            (b: Buffer) => b,
            (b: Buffer) => b,
            Buffer.alloc(0),
            (e: grpc.ServiceError | null) => (e ? resolve(e) : reject(new Error("answered"))),
          );
        });
        expect(error.code).toBe(grpc.status.UNIMPLEMENTED);
        expect(error.details).toMatch(/^unknown (method|service)/);
      } finally {
        client.close();
      }
    }
  });
});

describe("an RPC path asked the wrong way says what it takes (issue 30, item 4)", () => {
  it.each(servers)(
    "%s: a wrong or missing content type is 415 and a GET is 405, each with a body naming what is expected",
    async (name) => {
      const server = serverNamed(name);
      const path =
        server === guarded
          ? "/leasehold.guarded.v1.GuardedStoreService/Get"
          : "/leasehold.v1.LeaseService/Acquire";
      const rpc = path.slice(1);
      for (const send of ["HTTP/1.1", "HTTP/2"] as const) {
        const ask = (headers: Record<string, string>, method = "POST") =>
          send === "HTTP/1.1"
            ? h1(server.url, path, {
                method,
                headers,
                body: method === "GET" ? undefined : Buffer.from("{}"),
              })
            : h2(
                server.url,
                path,
                { ":method": method, ...headers },
                method === "GET" ? undefined : Buffer.from("{}"),
              );

        const wrong = await ask({ "content-type": "text/plain" });
        expect([send, wrong.status]).toEqual([send, 415]);
        expect(wrong.headers["content-type"]).toBe("text/plain; charset=utf-8");
        const said = wrong.body.toString();
        expect(said).toContain(`${rpc} is an RPC; it does not take content-type "text/plain"`);
        expect(said).toContain("application/json or application/proto (Connect)");
        expect(said).toContain("application/grpc");
        expect(said).toContain("application/grpc-web");

        const missing = await ask({});
        expect([send, missing.status]).toEqual([send, 415]);
        expect(missing.body.toString()).toContain("does not take content-type (none given)");

        const get = await ask({}, "GET");
        expect([send, get.status]).toEqual([send, 405]);
        expect(get.headers.allow).toBe("POST");
        expect(get.body.toString()).toContain(
          `${rpc} is an RPC; it does not answer GET. Send POST with content-type`,
        );
      }
    },
  );

  it("a method that streams both ways, asked over HTTP/1.1, is 505 saying it needs HTTP/2", async () => {
    const a = await h1(native.url, "/leasehold.v1.LeaseService/KeepAlive", {
      headers: { "content-type": "application/connect+json" },
      body: envelope(Buffer.from("{}")),
    });
    expect(a.status).toBe(505);
    expect(a.body.toString()).toContain("KeepAlive streams both ways and needs HTTP/2");
  });
});

// ---- JSON fields the API does not have ------------------------------------------

/** The error of an answer in any protocol: Connect unary JSON, Connect end-stream, gRPC or gRPC-Web status. */
function errorOf(a: Answer): { code: string; message: string } {
  const type = String(a.headers["content-type"] ?? "");
  if (type.startsWith("application/json")) {
    return JSON.parse(a.body.toString()) as { code: string; message: string };
  }
  if (type.startsWith("application/connect+")) {
    let offset = 0;
    while (offset + 5 <= a.body.length) {
      const length = a.body.readUInt32BE(offset + 1);
      if (a.body[offset] === 0x02) {
        const end = JSON.parse(a.body.subarray(offset + 5, offset + 5 + length).toString());
        return end.error ?? { code: "ok", message: "" };
      }
      offset += 5 + length;
    }
    return { code: "no end-stream message", message: "" };
  }
  const { code, message } = grpcStatus(a);
  return { code: Code[code] ?? String(code), message };
}

const json = (value: unknown) => Buffer.from(JSON.stringify(value));
const held = async (server: RunningServer, key: { accountId: string; sessionId: string }) =>
  (await connectClient(server.url).get({ key })).held;

describe("JSON fields the API does not have are refused (issue 30, item 5)", () => {
  it.each(["lease server, --grpc-path native", "lease server, --grpc-path connect"] as const)(
    "%s: an Acquire with a misspelt field is INVALID_ARGUMENT naming every unknown field, in every JSON protocol, and acquires nothing",
    async (name) => {
      const server = serverNamed(name);
      const path = "/leasehold.v1.LeaseService/Acquire";
      const named = (message: string) => {
        expect(message).toMatch(/^request message: unknown fields? /);
        expect(message).toContain("--json-unknown-fields accept");
      };

      // Connect unary over HTTP/1.1, as the README's curl sends it.
      const key = freshKey();
      const curl = await h1(server.url, path, {
        headers: { "content-type": "application/json" },
        body: json({ key, ttl: "30s", holdr: "typo" }),
      });
      expect(curl.status).toBe(400);
      expect(errorOf(curl).code).toBe("invalid_argument");
      expect(errorOf(curl).message).toBe(
        'request message: unknown field "holdr": JSON requests may only use the fields of the API ' +
          "(check the spelling; a server started with --json-unknown-fields accept ignores fields it does not know, for a rolling upgrade)",
      );
      // S3: nothing was granted.
      expect(await held(server, key)).toBe(false);

      // Nested and several: each is named, by its path.
      const nested = await h1(server.url, path, {
        headers: { "content-type": "application/json" },
        body: json({ key: { accountId: "acct", sesionId: "s" }, ttl: "30s", holdr: "x" }),
      });
      expect(errorOf(nested).message).toMatch(
        /^request message: unknown fields "key.sesionId", "holdr": /,
      );

      // gRPC, gRPC-Web and Connect streaming with their JSON codecs.
      const typo = json({ key, ttl: "30s", holdr: "typo" });
      const answers: [string, Answer][] = [
        [
          "gRPC+json",
          await h2(
            server.url,
            path,
            { "content-type": "application/grpc+json", te: "trailers" },
            envelope(typo),
          ),
        ],
        [
          "gRPC-Web+json over HTTP/1.1",
          await h1(server.url, path, {
            headers: { "content-type": "application/grpc-web+json" },
            body: envelope(typo),
          }),
        ],
        [
          "gRPC-Web+json over HTTP/2",
          await h2(
            server.url,
            path,
            { "content-type": "application/grpc-web+json" },
            envelope(typo),
          ),
        ],
        [
          "Connect over HTTP/2",
          await h2(server.url, path, { "content-type": "application/json" }, typo),
        ],
        [
          "Connect streaming Watch",
          await h1(server.url, "/leasehold.v1.LeaseService/Watch", {
            headers: { "content-type": "application/connect+json" },
            body: envelope(json({ key, includeRenewal: true })),
          }),
        ],
        [
          "Connect streaming KeepAlive",
          await h2(
            server.url,
            "/leasehold.v1.LeaseService/KeepAlive",
            { "content-type": "application/connect+json" },
            envelope(json({ key, runId: "0b7a4e5c-1b0f-4d4e-9a56-0c1d2e3f4a5b", tll: "10s" })),
          ),
        ],
      ];
      for (const [protocol, answer] of answers) {
        const error = errorOf(answer);
        expect([protocol, error.code]).toEqual([
          protocol,
          protocol.startsWith("Connect") ? "invalid_argument" : "InvalidArgument",
        ]);
        named(error.message);
      }
      expect(errorOf(answers[4]?.[1] as Answer).message).toContain('"includeRenewal"');
      expect(errorOf(answers[5]?.[1] as Answer).message).toContain('"tll"');
      expect(await held(server, key)).toBe(false);
    },
  );

  it.each(["lease server, --grpc-path native", "lease server, --grpc-path connect"] as const)(
    '%s: a "ttl" that is not a duration string is INVALID_ARGUMENT starting with the field',
    async (name) => {
      const server = serverNamed(name);
      const key = freshKey();
      const answer = await h1(server.url, "/leasehold.v1.LeaseService/Acquire", {
        headers: { "content-type": "application/json" },
        body: json({ key, ttl: 30 }),
      });
      expect(answer.status).toBe(400);
      expect(errorOf(answer)).toEqual({
        code: "invalid_argument",
        message: 'ttl must be a duration string such as "30s" or "1.5s", got 30',
      });
      expect(await held(server, key)).toBe(false);
    },
  );

  it("the guarded store refuses them too: a Put with a misspelt field stores nothing", async () => {
    const key = freshKey();
    const put = await h1(guarded.url, "/leasehold.guarded.v1.GuardedStoreService/Put", {
      headers: { "content-type": "application/json" },
      body: json({ key, name: "doc", value: "aGk=", fencingToken: "1", fencingTokn: "2" }),
    });
    expect(put.status).toBe(400);
    expect(errorOf(put)).toMatchObject({ code: "invalid_argument" });
    expect(errorOf(put).message).toMatch(/^request message: unknown field "fencingTokn": /);
    const list = await h1(guarded.url, "/leasehold.guarded.v1.GuardedStoreService/List", {
      headers: { "content-type": "application/json" },
      body: json({ key }),
    });
    expect(list.status).toBe(200);
    expect(JSON.parse(list.body.toString()).documents ?? []).toEqual([]);
  });

  it("a compressed JSON body is judged once inflated: still INVALID_ARGUMENT naming the field", async () => {
    const key = freshKey();
    const a = await h1(native.url, "/leasehold.v1.LeaseService/Acquire", {
      headers: { "content-type": "application/json", "content-encoding": "gzip" },
      body: gzipSync(json({ key, ttl: "30s", holdr: "typo" })),
    });
    expect(a.status).toBe(400);
    expect(errorOf(a).code).toBe("invalid_argument");
    expect(errorOf(a).message).toContain('"holdr"');
    expect(await held(native, key)).toBe(false);
  });

  it("binary protobuf stays lenient: an unknown field is skipped over gRPC (both paths) and Connect", async () => {
    const withUnknown = () => {
      const message = create(AcquireRequestSchema, {
        key: freshKey(),
        ttl: { seconds: 30n },
        holder: "desktop",
      });
      message.$unknown = [
        {
          no: 99,
          wireType: WireType.LengthDelimited,
          data: new BinaryWriter().string("new").finish(),
        },
      ];
      return message;
    };
    for (const server of [native, connectPath]) {
      for (const transport of [
        createGrpcTransport({ baseUrl: server.url }),
        createConnectTransport({ baseUrl: server.url, httpVersion: "1.1" }),
      ]) {
        const answer = await createClient(LeaseService, transport).acquire(withUnknown());
        expect(answer.acquired).toBe(true);
        expect(answer.lease?.holder).toBe("desktop");
      }
    }
  });

  it("with --json-unknown-fields accept they are ignored (a rolling upgrade): the Acquire is granted", async () => {
    const key = freshKey();
    const a = await h1(accepting.url, "/leasehold.v1.LeaseService/Acquire", {
      headers: { "content-type": "application/json" },
      body: json({ key, ttl: "30s", holder: "desktop", addedLater: { x: 1 } }),
    });
    expect(a.status).toBe(200);
    const answer = JSON.parse(a.body.toString());
    expect(answer.acquired).toBe(true);
    expect(answer.lease.holder).toBe("desktop");
  });

  it("the flag takes refuse or accept, on both servers, and --help lists it", () => {
    // The guarded store may require a lease server URL; any will do here.
    const parsers = [
      (argv: string[], env: NodeJS.ProcessEnv) => parseServerConfig(argv, env),
      (argv: string[], env: NodeJS.ProcessEnv) =>
        parseGuardedConfig(["--lease-url", "http://127.0.0.1:7070", ...argv], env),
    ];
    for (const parse of parsers) {
      expect(parse([], {}).jsonUnknownFields).toBe("refuse");
      expect(parse([], { LEASEHOLD_JSON_UNKNOWN_FIELDS: "accept" }).jsonUnknownFields).toBe(
        "accept",
      );
      expect(() => parse(["--json-unknown-fields", "ignore"], {})).toThrow(
        '--json-unknown-fields (LEASEHOLD_JSON_UNKNOWN_FIELDS) must be refuse or accept, got "ignore"',
      );
    }
    for (const settings of [serverSettings, guardedSettings]) {
      expect(settingsHelp(settings)).toMatch(
        /--json-unknown-fields +LEASEHOLD_JSON_UNKNOWN_FIELDS +refuse \(default/,
      );
    }
  });
});

describe("the guarded store bounds its request messages where they enter", () => {
  it("a message declared at 4 GiB is RESOURCE_EXHAUSTED from its 5-byte header, over gRPC and gRPC-Web", async () => {
    const header = Buffer.from([0, 0xff, 0xff, 0xff, 0xf0]);
    for (const type of ["application/grpc", "application/grpc-web+proto"]) {
      const a = await h2(
        guarded.url,
        "/leasehold.guarded.v1.GuardedStoreService/Put",
        { "content-type": type, te: "trailers" },
        header,
      );
      const { code, message } = grpcStatus(a);
      expect([type, code]).toEqual([type, Code.ResourceExhausted]);
      expect(message).toMatch(
        /^message size 4294967280 is larger than configured readMaxBytes \d+/,
      );
    }
  });
});
