// Hostile input at volume, and HTTP/2 abuse, against `leasehold serve` as its
// own process on real sockets (docs/security.md, "Hostile input at volume").
//
// Part one sends more than 10,000 fast-check generated requests to every
// LeaseService method over gRPC (the client library's transport), the Connect
// protocol (HTTP/2 and HTTP/1.1) and gRPC-Web, and raw HTTP/2 requests whose
// bodies are junk. Part two abuses the HTTP/2 layer itself: rapid resets,
// oversized and endless headers, readers that never read, connections that
// never finish their opening, and thousands of idle connections.
//
// Throughout: no answer is INTERNAL or UNKNOWN (the server's own metrics are
// checked too, so answers the abuser never read count), every INVALID_ARGUMENT
// names its field, a control client of another account keeps acquiring,
// renewing and reading between batches, and that account's stored rows do
// not change apart from the control lease's own renewals (S3: no overwrite;
// security: one account never reaches another's leases).

import { readFileSync } from "node:fs";
import http from "node:http";
import http2 from "node:http2";
import net from "node:net";
import {
  create,
  type DescMessage,
  fromBinary,
  type MessageInitShape,
  toBinary,
} from "@bufbuild/protobuf";
import { type Duration, DurationSchema } from "@bufbuild/protobuf/wkt";
import { type Client, Code, ConnectError, createClient, type Transport } from "@connectrpc/connect";
import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-node";
import fc from "fast-check";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createGrpcTransport, type GrpcTransport } from "../src/client/grpc-transport.js";
import { BadRequestSchema } from "../src/gen/google/rpc/error_details_pb.js";
import {
  AcquireRequestSchema,
  KeepAliveRequestSchema,
  KeepAliveResponseSchema,
  LeaseService,
  WatchRequestSchema,
  WatchResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { documentedCodes } from "./support/documented-codes.js";
import { useTestDatabase } from "./support/fixture.js";
import { FLAG, FRAME, h2Frame, headerBlock, preface, readFrames } from "./support/raw-http2.js";
import type { ServerProcess } from "./support/server.js";
import { createTestKeys } from "./support/tokens.js";
import { waitFor, within } from "./support/wait.js";

const { db, spawnServer } = useTestDatabase();

// Two servers on one database: `volume` with the deployment's connection
// defaults for the property runs, `guard` with short connection timeouts for
// the abuse, so that a test waits seconds, not minutes, for them to act.
let volume: ServerProcess;
let guard: ServerProcess;
const guardTimeouts = { handshakeMs: 1_000, idleMs: 10_000 };

const tokens: Record<"fuzz" | "admin" | "control" | "garbage", string> = {
  fuzz: "",
  admin: "",
  control: "",
  garbage: "Bearer \u00ffgarbage.\u00e9",
};
type TokenName = keyof typeof tokens | "none";
const authHeaders = (t: TokenName): Record<string, string> =>
  t === "none" ? {} : { authorization: tokens[t] };

const seconds = (s: number | bigint, nanos = 0): Duration =>
  create(DurationSchema, { seconds: BigInt(s), nanos });

// ---- the control account ----------------------------------------------------

interface Held {
  key: { accountId: string; sessionId: string };
  runId: string;
  token: bigint;
}
let controlHeld: Held;
let controlLive: Held;
let controlBefore: unknown;
const controlLatenciesMs: number[] = [];

async function controlRows(): Promise<unknown> {
  const leases =
    await db.sql`SELECT * FROM leases WHERE account_id = 'control' ORDER BY session_id`;
  const events = await db.sql`SELECT * FROM lease_events WHERE account_id = 'control' ORDER BY id`;
  // The control lease's own renewals move its deadline and nothing else.
  const rows = leases.map((row) =>
    row.sessionId === controlLive.key.sessionId ? { ...row, expiresAt: "renewed" } : row,
  );
  return { leases: rows, events: [...events] };
}

/** Accounts with any stored row: only the fuzz account and the control account may have one. */
async function accountsStored(): Promise<string[]> {
  const rows =
    await db.sql`SELECT account_id FROM leases UNION SELECT account_id FROM lease_events`;
  return rows.map((r) => r.accountId as string).sort();
}

/**
 * Healthy traffic on its own fresh connection: the control run renews its
 * lease (same token), reads the other control lease, and an acquire of it by
 * another run is refused (S3). Each answer must come within 10 s.
 */
async function controlCheck(url: string): Promise<void> {
  const transport = createGrpcTransport({ baseUrl: url });
  const client = createClient(LeaseService, transport);
  const options = { headers: authHeaders("control"), timeoutMs: 10_000 };
  const started = performance.now();
  try {
    const renewed = await client.renew(
      { key: controlLive.key, runId: controlLive.runId, ttl: seconds(3600) },
      options,
    );
    expect(renewed.lease?.fencingToken).toBe(controlLive.token);
    const got = await client.get({ key: controlHeld.key }, options);
    expect(got.lease?.runId).toBe(controlHeld.runId);
    const taken = await client.acquire({ key: controlHeld.key, ttl: seconds(10) }, options);
    expect(taken.acquired).toBe(false);
    expect(taken.current?.fencingToken).toBe(controlHeld.token);
  } finally {
    transport.close();
  }
  controlLatenciesMs.push(performance.now() - started);
}

// ---- the server's own view ----------------------------------------------------

/** The server's count of finished calls by method and code, from /metrics. */
async function serverCodes(url: string): Promise<Map<string, number>> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const counts = new Map<string, number>();
  const line = /^leasehold_rpc_duration_seconds_count\{([^}]*)\} (\d+)/gm;
  for (const m of text.matchAll(line)) {
    const labels = m[1] ?? "";
    const method = /method="([^"]*)"/.exec(labels)?.[1] ?? "?";
    const code = /code="([^"]*)"/.exec(labels)?.[1] ?? "?";
    counts.set(`${method} ${code}`, (counts.get(`${method} ${code}`) ?? 0) + Number(m[2]));
  }
  return counts;
}

async function expectNoInternalOnServer(url: string): Promise<void> {
  const bad = [...(await serverCodes(url))].filter(([k]) => /( internal| unknown)$/.test(k));
  expect(bad).toEqual([]);
}

/** Resident memory of a server process, in MiB. */
function rssMiB(server: ServerProcess): number {
  const status = readFileSync(`/proc/${server.child.pid}/status`, "utf8");
  return Number(/VmRSS:\s+(\d+) kB/.exec(status)?.[1] ?? Number.NaN) / 1024;
}

function expectAlive(server: ServerProcess): void {
  expect(server.child.exitCode).toBeNull();
  expect(server.child.signalCode).toBeNull();
}

// ---- the report -----------------------------------------------------------------

const sent = new Map<string, number>();
const codesSeen = new Map<string, number>();
const abuseReport: Record<string, unknown> = {};
/** What the servers wrote to stderr (warnings and errors), shown with the summary. */
const serverLog: string[] = [];
const count = (map: Map<string, number>, k: string) => map.set(k, (map.get(k) ?? 0) + 1);

beforeAll(async () => {
  const keys = await createTestKeys();
  tokens.fuzz = `Bearer ${await keys.token("fuzz")}`;
  tokens.admin = `Bearer ${await keys.token("fuzz", { scope: "leasehold:admin" })}`;
  tokens.control = `Bearer ${await keys.token("control")}`;
  // Production TTL bounds; a short wait bound so a valid random wait cannot stall a batch.
  const common = [...keys.args, "--min-ttl", "1s", "--max-ttl", "1h", "--max-wait", "200ms"];
  volume = await spawnServer(common, { LEASEHOLD_LOG_LEVEL: "warn" });
  volume.child.stderr?.on("data", (d: Buffer) => serverLog.push(`volume: ${d.toString()}`));
  guard = await spawnServer([
    ...common,
    "--handshake-timeout",
    `${guardTimeouts.handshakeMs}ms`,
    "--idle-timeout",
    `${guardTimeouts.idleMs}ms`,
  ]);
  guard.child.stderr?.on("data", (d: Buffer) => serverLog.push(`guard: ${d.toString()}`));
  const transport = createGrpcTransport({ baseUrl: volume.url });
  const client = createClient(LeaseService, transport);
  const grant = async (sessionId: string, holder: string): Promise<Held> => {
    const key = { accountId: "control", sessionId };
    const a = await client.acquire(
      { key, ttl: seconds(3600), holder },
      { headers: authHeaders("control") },
    );
    return { key, runId: a.lease?.runId ?? "", token: a.lease?.fencingToken ?? 0n };
  };
  controlHeld = await grant("held", "desktop");
  controlLive = await grant("live", "control");
  transport.close();
  controlBefore = await controlRows();
}, 120_000);

afterAll(() => {
  const byProtocol: Record<string, Record<string, number>> = {};
  for (const [k, n] of sent) {
    const [protocol, method] = k.split(" ");
    byProtocol[protocol ?? "?"] ??= {};
    (byProtocol[protocol ?? "?"] as Record<string, number>)[method ?? "?"] = n;
  }
  const total = [...sent.values()].reduce((a, b) => a + b, 0);
  const sorted = [...controlLatenciesMs].sort((a, b) => a - b);
  const summary = {
    requests: total,
    sentByProtocolAndMethod: byProtocol,
    codes: Object.fromEntries([...codesSeen].sort()),
    controlChecks: sorted.length,
    controlLatencyMs: {
      p50: Math.round(sorted[Math.floor(sorted.length / 2)] ?? 0),
      max: Math.round(sorted[sorted.length - 1] ?? 0),
    },
    abuse: abuseReport,
  };
  console.log(`hostile volume summary\n${JSON.stringify(summary, null, 2)}`);
  if (serverLog.length > 0) console.log(`server log\n${serverLog.join("").slice(0, 20_000)}`);
});

// ---- generated requests ------------------------------------------------------------

const idChars = "abcdefghijklmnopqrstuvwxyz0123456789._:@+=-".split("");
const validId = fc.string({ unit: fc.constantFrom(...idChars), minLength: 1, maxLength: 24 });
const fuzzKey = fc.record({ accountId: fc.constant("fuzz"), sessionId: validId });
const validTtl = fc.integer({ min: 1, max: 3600 }).map((s) => seconds(s));
const validWait = fc.option(
  fc.integer({ min: 0, max: 200 }).map((ms) => seconds(0, ms * 1_000_000)),
  { nil: undefined },
);
const validText = (max: number) =>
  fc.string({ unit: fc.constantFrom(...[..."abc XYZ-é𝔘"]), maxLength: max }).map((s) =>
    // 𝔘 is two UTF-16 units: clip to the limit the server counts in.
    s.slice(0, max),
  );

// Ids no rule accepts: empty, a character outside the allowed set, too long,
// lone surrogates, NUL, injection attempts, and huge ones (still inside the
// 64 KiB message bound, so the id rule, not the size bound, answers).
const badId = fc.oneof(
  fc.constantFrom(
    "",
    " ",
    "a b",
    "a/b",
    "a\u0000",
    "é",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\ud800",
    "\u202e",
    "' OR 1=1 --",
    "'; DROP TABLE leases; --",
    "*",
    "%00",
    "x".repeat(129),
    "y".repeat(20_000),
  ),
  fc.string({ minLength: 0, maxLength: 40 }).map((s) => `${s}\u0001`),
  fc.string({ unit: fc.constantFrom(...idChars), minLength: 129, maxLength: 3000 }),
  fc
    .string({ unit: "binary", minLength: 1, maxLength: 60 })
    .filter((s) => !/^[A-Za-z0-9._:@+=-]+$/.test(s)),
);
const nonEmptyBadId = badId.filter((s) => s !== "");
const uuidPattern = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
const badRunId = fc.oneof(
  fc.constantFrom("run-1", "' OR 1=1 --", "00000000-0000-0000-0000-00000000000g", "\u0000"),
  fc.uuid().map((u) => `{${u}}`),
  fc.uuid().map((u) => `${u}0`),
  fc.string({ unit: "binary", minLength: 1, maxLength: 80 }).filter((s) => !uuidPattern.test(s)),
);
const int64 = fc.bigInt(-(2n ** 63n), 2n ** 63n - 1n);
// Durations that are malformed (nanos out of range or of the wrong sign) or
// out of protobuf's range.
const brokenDuration = fc.oneof(
  fc.record({
    seconds: fc.bigInt(0n, 100n),
    nanos: fc.integer({ min: 1_000_000_000, max: 2 ** 31 - 1 }),
  }),
  fc.record({ seconds: fc.bigInt(1n, 100n), nanos: fc.integer({ min: -999_999_999, max: -1 }) }),
  fc.record({ seconds: fc.bigInt(-100n, -1n), nanos: fc.integer({ min: 1, max: 999_999_999 }) }),
  fc.record({ seconds: fc.bigInt(315_576_000_001n, 2n ** 63n - 1n), nanos: fc.constant(0) }),
  fc.record({ seconds: fc.bigInt(-(2n ** 63n), -315_576_000_001n), nanos: fc.constant(0) }),
);
const badTtl = fc.oneof(
  brokenDuration,
  fc.record({ seconds: fc.constant(0n), nanos: fc.integer({ min: 0, max: 999_999_999 }) }),
  fc.record({ seconds: fc.bigInt(3601n, 315_576_000_000n), nanos: fc.constant(0) }),
  fc.record({ seconds: fc.bigInt(-315_576_000_000n, -1n), nanos: fc.constant(0) }),
);
const badWait = fc.oneof(
  brokenDuration,
  fc.record({ seconds: fc.bigInt(-315_576_000_000n, -1n), nanos: fc.constant(0) }),
  fc.record({
    seconds: fc.constant(0n),
    nanos: fc.integer({ min: 201_000_000, max: 999_999_999 }),
  }),
  fc.record({ seconds: fc.bigInt(1n, 315_576_000_000n), nanos: fc.constant(0) }),
);
const badText = (max: number) =>
  fc.oneof(
    fc.string({ minLength: max + 1, maxLength: max + 400 }).filter((s) => s.length > max),
    fc
      .tuple(
        fc.string({ maxLength: 20 }),
        fc.integer({ min: 0, max: 31 }),
        fc.string({ maxLength: 20 }),
      )
      .map(([a, c, b]) => `${a}${String.fromCharCode(c)}${b}`.slice(0, max)),
    fc.constant("\u007f"),
  );
const badPageSize = fc.integer({ min: -(2 ** 31), max: -1 });
// Page tokens that cannot be ours: characters outside base64url, too long,
// or base64url of a cursor with an unknown version.
const badPageToken = fc.oneof(
  fc.constantFrom("%%%", "=", "a b", "x".repeat(1025), "djE6\u0000"),
  fc
    .string({ unit: "binary", minLength: 1, maxLength: 60 })
    .filter((s) => !/^[A-Za-z0-9_-]+$/.test(s)),
  fc.string({ maxLength: 40 }).map((s) => Buffer.from(`zz:${s}`).toString("base64url")),
);
const badFencingToken = fc.bigInt(-(2n ** 63n), 0n);

type Key = { accountId: string; sessionId: string } | undefined;
/** A valid fuzz-account key with exactly one of its parts broken, and the field that names it. */
const badKey = (sessionMayBeEmpty: boolean): fc.Arbitrary<{ key: Key; field: string }> =>
  fc.oneof(
    fc.constant({ key: undefined as Key, field: "key" }),
    fc.tuple(badId, validId).map(([accountId, sessionId]) => ({
      key: { accountId, sessionId },
      field: "key.account_id",
    })),
    (sessionMayBeEmpty ? nonEmptyBadId : badId).map((sessionId) => ({
      key: { accountId: "fuzz", sessionId },
      field: "key.session_id",
    })),
  );

interface Generated {
  method: string;
  request: Record<string, unknown>;
  token: TokenName;
  /** The one field made invalid: the answer must be INVALID_ARGUMENT naming it. */
  field?: string;
}

/** One broken field in an otherwise valid request of the fuzz account, per method. */
function oneBadField(
  method: string,
  base: fc.Arbitrary<Record<string, unknown>>,
  bad: Record<string, fc.Arbitrary<unknown>>,
  token: TokenName = "fuzz",
): fc.Arbitrary<Generated> {
  return fc.tuple(base, fc.constantFrom(...Object.keys(bad))).chain(([request, field]) =>
    (bad[field] as fc.Arbitrary<unknown>).map((value): Generated => {
      if (field === "key") {
        const k = value as { key: Key; field: string };
        return { method, request: { ...request, key: k.key }, token, field: k.field };
      }
      const localName = field.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
      return { method, request: { ...request, [localName]: value }, token, field };
    }),
  );
}

const runIdOrEmpty = fc.oneof(fc.uuid(), fc.constant(""));
const singleBadField: Record<string, fc.Arbitrary<Generated>> = {
  acquire: oneBadField(
    "acquire",
    fc.record({
      key: fuzzKey,
      ttl: validTtl,
      wait: validWait,
      runId: runIdOrEmpty,
      holder: validText(64),
    }),
    {
      key: badKey(false),
      ttl: fc.option(badTtl, { nil: undefined }),
      wait: badWait,
      run_id: badRunId,
      holder: badText(64),
    },
  ),
  renew: oneBadField(
    "renew",
    fc.record({ key: fuzzKey, runId: fc.uuid(), ttl: fc.option(validTtl, { nil: undefined }) }),
    { key: badKey(false), run_id: fc.oneof(badRunId, fc.constant("")), ttl: badTtl },
  ),
  release: oneBadField("release", fc.record({ key: fuzzKey, runId: fc.uuid() }), {
    key: badKey(false),
    run_id: fc.oneof(badRunId, fc.constant("")),
  }),
  get: oneBadField("get", fc.record({ key: fuzzKey }), { key: badKey(false) }),
  list: oneBadField(
    "list",
    fc.record({
      accountId: fc.constant("fuzz"),
      pageSize: fc.integer({ min: 0, max: 2 ** 31 - 1 }),
    }),
    { account_id: badId, page_size: badPageSize, page_token: badPageToken },
  ),
  keepAlive: oneBadField(
    "keepAlive",
    fc.record({ key: fuzzKey, runId: fc.uuid(), ttl: fc.option(validTtl, { nil: undefined }) }),
    { key: badKey(false), run_id: fc.oneof(badRunId, fc.constant("")), ttl: badTtl },
  ),
  watch: oneBadField("watch", fc.record({ key: fuzzKey, includeRenewals: fc.boolean() }), {
    key: badKey(true),
  }),
  requestHandoff: oneBadField(
    "requestHandoff",
    fc.record({ key: fuzzKey, requesterHolder: validText(64), reason: validText(256) }),
    { key: badKey(false), requester_holder: badText(64), reason: badText(256) },
  ),
  history: oneBadField(
    "history",
    fc.record({ key: fuzzKey, pageSize: fc.integer({ min: 0, max: 2 ** 31 - 1 }) }),
    { key: badKey(false), page_size: badPageSize, page_token: badPageToken },
  ),
  checkFence: oneBadField(
    "checkFence",
    fc.record({ key: fuzzKey, fencingToken: fc.bigInt(1n, 2n ** 63n - 1n) }),
    { key: badKey(false), fencing_token: badFencingToken },
  ),
  revoke: oneBadField(
    "revoke",
    fc.record({ key: fuzzKey, reason: validText(256) }),
    { key: badKey(false), reason: badText(256) },
    "admin",
  ),
  revokeKeeper: oneBadField(
    "revokeKeeper",
    fc.record({ accountId: fc.constant("fuzz"), keeperId: fc.uuid(), reason: validText(256) }),
    { account_id: badId, keeper_id: badRunId, reason: badText(256) },
    "admin",
  ),
};

// Any value in any field, with any token but the control account's: valid
// requests of the fuzz account, requests naming the control account's leases
// (refused: not the caller's account), bad tokens, and ids beyond the message
// size bound.
const anyText = fc.oneof(
  badText(300),
  validText(64),
  badId,
  fc.string({ unit: "binary", maxLength: 100 }),
);
const anyId = fc.oneof(validId, badId, fc.constantFrom("fuzz", "control", "held", "live"));
const anyKey = fc.option(
  fc.oneof(
    fuzzKey,
    fc.record({
      accountId: fc.constantFrom("control", "fuzz"),
      sessionId: fc.constantFrom("held", "live"),
    }),
    fc.record({ accountId: anyId, sessionId: anyId }),
    fc.constant({ accountId: "fuzz", sessionId: "z".repeat(70_000) }),
  ),
  { nil: undefined },
);
const anyDuration = fc.option(
  fc.oneof(
    validTtl,
    badTtl,
    badWait,
    fc.record({ seconds: int64, nanos: fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 }) }),
  ),
  { nil: undefined },
);
const anyRunId = fc.oneof(fc.uuid(), badRunId, fc.constant(""));
const anyPageSize = fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 });
const anyPageToken = fc.oneof(fc.constant(""), badPageToken, anyText);
const anyToken = fc.constantFrom<TokenName>("fuzz", "fuzz", "admin", "garbage", "none");
const anyValues: Record<string, fc.Arbitrary<Record<string, unknown>>> = {
  acquire: fc.record({
    key: anyKey,
    runId: anyRunId,
    ttl: anyDuration,
    wait: anyDuration,
    holder: anyText,
  }),
  renew: fc.record({ key: anyKey, runId: anyRunId, ttl: anyDuration }),
  release: fc.record({ key: anyKey, runId: anyRunId }),
  get: fc.record({ key: anyKey }),
  list: fc.record({ accountId: anyId, pageSize: anyPageSize, pageToken: anyPageToken }),
  keepAlive: fc.record({ key: anyKey, runId: anyRunId, ttl: anyDuration }),
  watch: fc.record({ key: anyKey, includeRenewals: fc.boolean() }),
  requestHandoff: fc.record({ key: anyKey, requesterHolder: anyText, reason: anyText }),
  history: fc.record({ key: anyKey, pageSize: anyPageSize, pageToken: anyPageToken }),
  checkFence: fc.record({ key: anyKey, fencingToken: int64 }),
  revoke: fc.record({ key: anyKey, reason: anyText }),
  revokeKeeper: fc.record({ accountId: anyId, keeperId: anyRunId, reason: anyText }),
};
const anyRequest = (methods: string[]): fc.Arbitrary<Generated> =>
  fc.oneof(
    ...methods.map((method) =>
      fc
        .tuple(anyValues[method] as fc.Arbitrary<Record<string, unknown>>, anyToken)
        .map(([request, token]): Generated => ({ method, request, token })),
    ),
  );
const badRequest = (methods: string[]): fc.Arbitrary<Generated> =>
  fc.oneof(...methods.map((m) => singleBadField[m] as fc.Arbitrary<Generated>));

/** Field names of each method's request, as errors name them. */
const fieldsOf: Record<string, string[]> = {
  acquire: ["key", "key.account_id", "key.session_id", "run_id", "ttl", "wait", "holder"],
  renew: ["key", "key.account_id", "key.session_id", "run_id", "ttl"],
  release: ["key", "key.account_id", "key.session_id", "run_id"],
  get: ["key", "key.account_id", "key.session_id"],
  list: ["account_id", "page_size", "page_token"],
  keepAlive: ["key", "key.account_id", "key.session_id", "run_id", "ttl"],
  watch: ["key", "key.account_id", "key.session_id"],
  requestHandoff: ["key", "key.account_id", "key.session_id", "requester_holder", "reason"],
  history: ["key", "key.account_id", "key.session_id", "page_size", "page_token"],
  checkFence: ["key", "key.account_id", "key.session_id", "fencing_token"],
  revoke: ["key", "key.account_id", "key.session_id", "reason"],
  revokeKeeper: ["account_id", "keeper_id", "reason"],
};

// ---- calls ------------------------------------------------------------------------

type LeaseClient = Client<typeof LeaseService>;
interface Protocol {
  name: string;
  h2: boolean;
  /** Methods it can carry: bidirectional streams need HTTP/2. */
  methods: string[];
  transport(url: string): Transport;
}
// Keep is a stream of requests answered each in its own error while the
// stream goes on: its hostile input is test/hostile-keep.test.ts's.
const allMethods = LeaseService.methods.map((m) => m.localName).filter((m) => m !== "keep");
// HTTP/1.1 calls each on a connection of their own. With keep-alive sockets
// shared across batches, one gRPC-Web call in about 1,500 got no answer
// within 10 s in two runs of three (not reproduced in isolation; see
// docs/security.md, "Hostile input at volume").
const h1PerRequest = new http.Agent({ keepAlive: false });
const protocols: Protocol[] = [
  {
    name: "grpc",
    h2: true,
    methods: allMethods,
    transport: (baseUrl) => createGrpcTransport({ baseUrl }),
  },
  {
    name: "connect-h2",
    h2: true,
    methods: allMethods,
    transport: (baseUrl) =>
      createConnectTransport({ baseUrl, httpVersion: "2", idleConnectionTimeoutMs: 50 }),
  },
  {
    name: "connect-h1",
    h2: false,
    methods: allMethods.filter((m) => m !== "keepAlive"),
    transport: (baseUrl) =>
      createConnectTransport({ baseUrl, httpVersion: "1.1", nodeOptions: { agent: h1PerRequest } }),
  },
  {
    name: "grpc-web",
    h2: false,
    methods: allMethods.filter((m) => m !== "keepAlive"),
    transport: (baseUrl) =>
      createGrpcWebTransport({ baseUrl, httpVersion: "1.1", nodeOptions: { agent: h1PerRequest } }),
  },
];

/**
 * Makes one call and returns its error, or undefined when it answered. A
 * stream counts as answered at its first message (it is then cancelled);
 * KeepAlive sends its one request and waits for that first answer.
 */
async function call(client: LeaseClient, g: Generated): Promise<unknown> {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(new Error("no answer within 10 s")), 10_000);
  const options = { headers: authHeaders(g.token), signal: controller.signal };
  const c = client as unknown as Record<
    string,
    (req: unknown, o: typeof options) => Promise<unknown> | AsyncIterable<unknown>
  >;
  try {
    if (g.method === "watch" || g.method === "keepAlive") {
      const request =
        g.method === "watch"
          ? g.request
          : (async function* () {
              yield g.request;
              await new Promise<void>((resolve) =>
                controller.signal.addEventListener("abort", () => resolve()),
              );
            })();
      const stream = c[g.method]?.call(client, request, options) as AsyncIterable<unknown>;
      for await (const _ of stream) return undefined;
      return undefined;
    }
    await c[g.method]?.call(client, g.request, options);
    return undefined;
  } catch (error) {
    return error;
  } finally {
    clearTimeout(timer);
    controller.abort();
  }
}

const bigints = (_key: string, value: unknown) =>
  typeof value === "bigint" ? value.toString() : value;

/** Checks one answer; throws (failing the property) on an undocumented code or an unnamed field. */
function judge(protocol: string, h2: boolean, g: Generated, error: unknown): void {
  count(sent, `${protocol} ${g.method}`);
  if (error === undefined) {
    count(codesSeen, `${protocol} ok`);
    if (g.field !== undefined) throw new Error(`${g.method} accepted a bad ${g.field}`);
    return;
  }
  const ce = ConnectError.from(error);
  // Over HTTP/1.1 the server may answer a call before reading its body (a
  // refused token, a bad Watch) and close the connection; connect-node then
  // fails on its own write and reports that as INTERNAL without reading the
  // answer. Not the server's code: counted apart, and the server's own
  // metrics are checked for INTERNAL after every protocol.
  if (!h2 && ce.code === Code.Internal && /\b(EPIPE|ECONNRESET)\b/.test(ce.rawMessage)) {
    count(codesSeen, `${protocol} client-side ${ce.rawMessage}`);
    return;
  }
  count(codesSeen, `${protocol} ${Code[ce.code]}`);
  if (!documentedCodes.has(ce.code)) {
    throw new Error(`${protocol} ${g.method} answered ${Code[ce.code]}: ${ce.rawMessage}`);
  }
  if (ce.code !== Code.InvalidArgument) {
    if (g.field !== undefined) {
      throw new Error(
        `${g.method} with a bad ${g.field} answered ${Code[ce.code]}: ${ce.rawMessage}`,
      );
    }
    return;
  }
  const named = ce.findDetails(BadRequestSchema)[0]?.fieldViolations[0]?.field;
  if (named === undefined || !ce.rawMessage.startsWith(`${named} `)) {
    throw new Error(
      `${protocol} ${g.method}: INVALID_ARGUMENT without its field: ${ce.rawMessage}`,
    );
  }
  if (!(fieldsOf[g.method] ?? []).includes(named)) {
    throw new Error(`${g.method} named ${named}, not one of its fields`);
  }
  if (g.field !== undefined && named !== g.field) {
    throw new Error(`${g.method} with a bad ${g.field} named ${named}: ${ce.rawMessage}`);
  }
}

// Requests per protocol: 3,000 on each HTTP/2 protocol, 1,500 on each HTTP/1.1
// one; with the raw bodies below, more than 10,000 in all.
const volumeOf: Record<string, number> = {
  grpc: 3_000,
  "connect-h2": 3_000,
  "connect-h1": 1_500,
  "grpc-web": 1_500,
};
const concurrency = 8;
const chunks = 5;

describe("hostile input at volume", () => {
  for (const protocol of protocols) {
    it(`${protocol.name}: ${volumeOf[protocol.name]} generated requests over every method it carries get documented codes, bad fields are named, and the control account is untouched (S3)`, async () => {
      // Over HTTP/1.1 a message beyond the server's bound is answered (and
      // the connection closed) while connect-node still writes it; the
      // client then reports its own EPIPE as INTERNAL. HTTP/2 carries them.
      const generated = fc
        .oneof(badRequest(protocol.methods), anyRequest(protocol.methods))
        .filter((g) => protocol.h2 || JSON.stringify(g.request, bigints).length < 60_000);
      const perChunk = Math.ceil((volumeOf[protocol.name] ?? 0) / concurrency / chunks);
      for (let chunk = 0; chunk < chunks; chunk++) {
        await fc.assert(
          fc.asyncProperty(
            fc.array(generated, { minLength: concurrency, maxLength: concurrency }),
            async (batch) => {
              // A connection per batch: every Watch and KeepAlive here is
              // cancelled after its first message, and nghttp2 ends a
              // connection that resets streams faster than its rapid-reset
              // bound (a burst of 1,000, then 33 a second) with GOAWAY
              // INTERNAL_ERROR, which the abuse tests below check.
              const transport = protocol.transport(volume.url);
              const client = createClient(LeaseService, transport);
              try {
                const errors = await Promise.all(batch.map((g) => call(client, g)));
                batch.forEach((g, i) => {
                  judge(protocol.name, protocol.h2, g, errors[i]);
                });
              } finally {
                (transport as Partial<GrpcTransport>).close?.();
              }
            },
          ),
          { numRuns: perChunk },
        );
        // Between batches: healthy traffic still answers.
        await controlCheck(volume.url);
      }
      expect(await controlRows()).toEqual(controlBefore);
      await expectNoInternalOnServer(volume.url);
      // Nothing reached another account: the fuzz account's own valid requests only.
      expect((await accountsStored()).filter((a) => a !== "fuzz")).toEqual(["control"]);
    });
  }
});

// ---- raw bodies ---------------------------------------------------------------------

interface RawAnswer {
  status: number;
  headers: Record<string, string | string[] | undefined>;
  trailers: Record<string, string | string[] | undefined>;
  body: Buffer;
}

interface RawRequest {
  version: "h2" | "h1";
  path: string;
  headers: Record<string, string>;
  body: Uint8Array;
}

/** Has `body` a complete first message of a stream (gRPC, gRPC-Web or Connect framing)? */
function hasMessage(body: Buffer): boolean {
  return body.length >= 5 && body.length >= 5 + body.readUInt32BE(1);
}

/**
 * Sends one request and collects its answer. A stream that sends a complete
 * message counts as answered (the junk decoded to a valid request) and is
 * cancelled; anything else must end within 10 s.
 */
function rawRequest(session: http2.ClientHttp2Session, r: RawRequest): Promise<RawAnswer> {
  return new Promise((resolve, reject) => {
    const answer: RawAnswer = { status: 0, headers: {}, trailers: {}, body: Buffer.alloc(0) };
    const timer = setTimeout(() => {
      stop();
      reject(
        new Error(`no answer within 10 s to ${r.version} ${r.path} ${r.headers["content-type"]}`),
      );
    }, 10_000);
    let stop = () => {};
    const done = () => {
      clearTimeout(timer);
      stop();
      resolve(answer);
    };
    const onData = (chunk: Buffer) => {
      answer.body = Buffer.concat([answer.body, chunk]);
      if (answer.status === 200 && hasMessage(answer.body) && (answer.body[0] ?? 0) === 0) done();
    };
    if (r.version === "h2") {
      const stream = session.request({ ":method": "POST", ":path": r.path, ...r.headers });
      stop = () => stream.close(http2.constants.NGHTTP2_CANCEL);
      stream.on("response", (h) => {
        answer.status = Number(h[":status"]);
        answer.headers = h;
      });
      stream.on("trailers", (t) => {
        answer.trailers = t;
      });
      stream.on("data", onData);
      stream.on("end", done);
      stream.on("error", (e) => {
        clearTimeout(timer);
        reject(e);
      });
      stream.end(r.body);
    } else {
      const url = new URL(r.path, volume.url);
      const req = http.request(
        url,
        { method: "POST", headers: r.headers, agent: h1Agent },
        (res) => {
          answer.status = res.statusCode ?? 0;
          answer.headers = res.headers;
          res.on("data", onData);
          res.on("end", () => {
            answer.trailers = res.trailers;
            done();
          });
        },
      );
      stop = () => req.destroy();
      req.on("error", (e) => {
        clearTimeout(timer);
        reject(e);
      });
      req.end(r.body);
    }
  });
}
const h1Agent = new http.Agent({ keepAlive: true, maxSockets: 16 });

const pascal = (snake: string) =>
  snake.replace(/(^|_)([a-z])/g, (_, __, c: string) => c.toUpperCase());

/** The answer's code by its protocol: a gRPC status, a Connect error code, or the HTTP status alone. */
function rawCode(a: RawAnswer): { code: string; message: string } {
  const type = String(a.headers["content-type"] ?? "");
  const grpcStatus = a.trailers["grpc-status"] ?? a.headers["grpc-status"];
  if (grpcStatus !== undefined) {
    const message = decodeURIComponent(
      String(a.trailers["grpc-message"] ?? a.headers["grpc-message"] ?? ""),
    );
    // 0 is OK, which connect's Code has no member for.
    if (String(grpcStatus) === "0") return { code: "Ok", message };
    return { code: Code[Number(grpcStatus)] ?? `grpc ${grpcStatus}`, message };
  }
  if (type.startsWith("application/grpc-web")) {
    const text = a.body.toString("latin1");
    const status = /grpc-status: ?(\d+)/i.exec(text)?.[1];
    const message = /grpc-message: ?([^\r]*)/i.exec(text)?.[1] ?? "";
    if (status !== undefined)
      return {
        code: status === "0" ? "Ok" : (Code[Number(status)] ?? `grpc ${status}`),
        message: decodeURIComponent(message),
      };
  }
  if (type.startsWith("application/connect+")) {
    // The end-of-stream message (flag 2) holds any error as JSON.
    for (let at = 0; at + 5 <= a.body.length; ) {
      const length = a.body.readUInt32BE(at + 1);
      if ((a.body[at] ?? 0) & 2) {
        const end = JSON.parse(a.body.subarray(at + 5, at + 5 + length).toString()) as {
          error?: { code: string; message?: string };
        };
        return end.error
          ? { code: pascal(end.error.code), message: end.error.message ?? "" }
          : { code: "Ok", message: "" };
      }
      at += 5 + length;
    }
  }
  if (type.startsWith("application/json") && a.status !== 200) {
    const error = JSON.parse(a.body.toString()) as { code: string; message?: string };
    return { code: pascal(error.code), message: error.message ?? "" };
  }
  return { code: a.status === 200 ? "Ok" : `http ${a.status}`, message: "" };
}

const messageOf = (schema: DescMessage, init: MessageInitShape<DescMessage>) =>
  toBinary(schema, create(schema, init));
const concatBytes = (parts: Uint8Array[]) => new Uint8Array(Buffer.concat(parts));
const envelope = (flags: number, length: number, payload: Uint8Array) => {
  const head = Buffer.alloc(5);
  head[0] = flags;
  head.writeUInt32BE(length >>> 0, 1);
  return concatBytes([head, payload]);
};
// Bytes that look like protobuf and are not: a truncated varint, a length
// past the end, invalid UTF-8 in a string, field 0, wire types 6 and 7, and
// valid messages of other methods (unknown to the one called, or decoding
// into wrong types).
const junkPayload = fc.oneof(
  fc.uint8Array({ maxLength: 300 }),
  fc
    .array(
      fc.oneof(
        fc.constantFrom(
          Uint8Array.from([0x08, 0xff]),
          Uint8Array.from([0x0a, 0x7f, 0x01]),
          Uint8Array.from([0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
          Uint8Array.from([0x0a, 0x05, 0x0a, 0x03, 0xc3, 0x28, 0x41]),
          Uint8Array.from([0x00, 0x01]),
          Uint8Array.from([0x0e]),
          Uint8Array.from([0x0f]),
          Uint8Array.from([0x1a, 0xff, 0xff, 0xff, 0xff, 0x0f]),
        ),
        fc.uint8Array({ maxLength: 24 }),
      ),
      { maxLength: 8 },
    )
    .map(concatBytes),
  fc.constantFrom(
    messageOf(AcquireRequestSchema, {
      key: { accountId: "fuzz", sessionId: "raw" },
      ttl: seconds(5),
    }),
    messageOf(WatchRequestSchema, { key: { accountId: "fuzz", sessionId: "" } }),
    messageOf(KeepAliveRequestSchema, {
      key: { accountId: "control", sessionId: "live" },
      runId: "x",
    }),
  ),
);
const enveloped = fc.oneof(
  junkPayload.map((p) => envelope(0, p.length, p)),
  fc
    .tuple(fc.integer({ min: 0, max: 255 }), fc.integer({ min: 0, max: 2 ** 32 - 1 }), junkPayload)
    .map(([flags, length, p]) => envelope(flags, length, p)),
  fc
    .tuple(junkPayload, junkPayload)
    .map(([a, b]) => concatBytes([envelope(0, a.length, a), envelope(0, b.length, b)])),
  junkPayload,
);
const junkJson = fc.oneof(
  fc.json().map((j) => new TextEncoder().encode(j)),
  fc.string({ unit: "binary", maxLength: 200 }).map((s) => new TextEncoder().encode(s)),
);
const junkHeaders = fc.record(
  {
    "grpc-timeout": fc.constantFrom("1x", "99999999999S", "-1m", "", "1n"),
    "grpc-encoding": fc.constantFrom("gzip", "br", "identity", "snappy"),
    "connect-timeout-ms": fc.constantFrom("-5", "abc", "99999999999999"),
    "content-encoding": fc.constantFrom("gzip", "br", "deflate"),
    "connect-protocol-version": fc.constantFrom("1", "2", ""),
  },
  { requiredKeys: [] },
);

const rawGenerated = fc
  .tuple(
    fc.constantFrom(...LeaseService.methods),
    fc.constantFrom<"h2" | "h1">("h2", "h2", "h1"),
    fc.constantFrom<TokenName>("fuzz", "fuzz", "admin", "garbage", "none"),
    junkHeaders,
  )
  .chain(([method, version, token, extra]) => {
    const streaming = method.methodKind !== "unary";
    const types: [string, fc.Arbitrary<Uint8Array>][] = [
      ["application/grpc", enveloped],
      ["application/grpc+proto", enveloped],
      ["application/grpc+json", enveloped],
      ["application/grpc-web+proto", enveloped],
      ["text/plain", junkPayload],
      ...(streaming
        ? ([
            ["application/connect+proto", enveloped],
            ["application/connect+json", junkJson],
          ] as [string, fc.Arbitrary<Uint8Array>][])
        : ([
            ["application/proto", junkPayload],
            ["application/json", junkJson],
          ] as [string, fc.Arbitrary<Uint8Array>][])),
    ];
    return fc.constantFrom(...types).chain(([type, body]) =>
      body.map(
        (b): RawRequest => ({
          version,
          path: `/${LeaseService.typeName}/${method.name}`,
          headers: {
            "content-type": type,
            ...(type.startsWith("application/grpc") ? { te: "trailers" } : {}),
            ...extra,
            ...authHeaders(token),
          },
          body: b,
        }),
      ),
    );
  });

// What an INVALID_ARGUMENT for junk bytes must name: the request message or
// one of its fields, the protocol rule broken (framing, a timeout header),
// the compression, or the message that JSON could not be decoded into.
const rawRuleNamed =
  /^(request message|key|key\.account_id|key\.session_id|run_id|ttl|wait|holder|account_id|page_size|page_token|requester_holder|reason|fencing_token|keeper_id|id|open|open\.[a-z_]+)[ :]|^protocol error: |^decompression failed|^cannot decode message /;

describe("junk bodies over raw HTTP/2 and HTTP/1.1", () => {
  it("1,500 requests of junk bytes, junk JSON and junk headers to every method in every content type get documented answers, never INTERNAL or UNKNOWN (S3)", async () => {
    const prefixes = new Map<string, number>();
    for (let chunk = 0; chunk < chunks; chunk++) {
      await fc.assert(
        fc.asyncProperty(
          fc.array(rawGenerated, { minLength: concurrency, maxLength: concurrency }),
          async (batch) => {
            // A session per batch: a streaming answer is cut with RST_STREAM
            // once its first message is in, and a thousand resets on one
            // session trip the server's rapid-reset defence (GOAWAY, the
            // HTTP/2 abuse tests below), which is not what this test asks.
            const session = http2.connect(volume.url);
            session.on("error", () => {});
            const answers = await Promise.all(batch.map((r) => rawRequest(session, r))).finally(
              () => session.close(),
            );
            answers.forEach((a, i) => {
              const r = batch[i] as RawRequest;
              const method = r.path.split("/").pop() ?? "";
              count(sent, `raw-${r.version} ${method}`);
              const { code, message } = rawCode(a);
              count(codesSeen, `raw-${r.version} ${code}`);
              const label = `${r.version} ${r.path} ${r.headers["content-type"]}: ${code} ${message}`;
              // 501: an encoding the server does not speak; 505: gRPC over HTTP/1.1.
              const unimplemented =
                (code === "Unimplemented" && a.status === 501) ||
                (code === "http 505" && r.version === "h1");
              if (
                code === "Internal" ||
                code === "Unknown" ||
                (a.status >= 500 && !unimplemented)
              ) {
                throw new Error(`undocumented answer ${a.status} ${label}`);
              }
              // A deadline the request set may run out; an encoding the server
              // does not speak is UNIMPLEMENTED, as the gRPC spec says.
              const allowed = new Set(documentedCodes);
              if (r.headers["grpc-timeout"] ?? r.headers["connect-timeout-ms"]) {
                allowed.add(Code.DeadlineExceeded);
              }
              if (r.headers["grpc-encoding"] ?? r.headers["content-encoding"]) {
                allowed.add(Code.Unimplemented);
              }
              if (
                !/^(Ok|http 4\d\d|http 505)$/.test(code) &&
                !allowed.has(Code[code as keyof typeof Code])
              ) {
                throw new Error(`undocumented code ${label}`);
              }
              if (code === "InvalidArgument") {
                if (!rawRuleNamed.test(message))
                  throw new Error(`INVALID_ARGUMENT names nothing: ${label}`);
                const prefix = message.slice(0, 32);
                prefixes.set(prefix, (prefixes.get(prefix) ?? 0) + 1);
              }
            });
          },
        ),
        { numRuns: Math.ceil(1_500 / concurrency / chunks) },
      );
      await controlCheck(volume.url);
    }
    abuseReport.junkInvalidArgumentMessages = Object.fromEntries(
      [...prefixes].sort((a, b) => b[1] - a[1]).slice(0, 15),
    );
    expect(await controlRows()).toEqual(controlBefore);
    expect((await accountsStored()).filter((a) => a !== "fuzz")).toEqual(["control"]);
    await expectNoInternalOnServer(volume.url);
    expectAlive(volume);
  });
});

// ---- HTTP/2 abuse over raw sockets ------------------------------------------------------

const grpcHeaders = (path: string, extra: [string, string][] = []): [string, string][] => [
  [":method", "POST"],
  [":scheme", "http"],
  [":path", path],
  [":authority", "localhost"],
  ["content-type", "application/grpc"],
  ["te", "trailers"],
  ["authorization", tokens.fuzz],
  ...extra,
];

function grpcMessage<S extends DescMessage>(schema: S, init: MessageInitShape<S>): Buffer {
  const body = toBinary(schema, create(schema, init));
  return Buffer.from(envelope(0, body.length, body));
}

/** A raw HTTP/2 connection: the frames the server sent, its GOAWAY, and when it closed. */
interface RawConnection {
  socket: net.Socket;
  goaway?: { lastStreamId: number; code: number };
  /** Every GOAWAY's error code, in order. */
  goawayCodes: number[];
  resets: number;
  headers: number;
  closed: Promise<void>;
  write(data: Buffer): Promise<void>;
}

async function rawConnection(
  url: string,
  options: { sendPreface?: boolean } = {},
): Promise<RawConnection> {
  const { hostname, port } = new URL(url);
  const socket = net.connect({ host: hostname, port: Number(port) });
  socket.on("error", () => {});
  await new Promise<void>((resolve, reject) => {
    socket.once("connect", resolve);
    socket.once("error", reject);
  });
  const conn: RawConnection = {
    socket,
    resets: 0,
    headers: 0,
    goawayCodes: [],
    closed: new Promise((resolve) => socket.once("close", () => resolve())),
    write: (data) =>
      new Promise((resolve) => {
        if (socket.destroyed || !socket.write(data)) {
          if (socket.destroyed) return resolve();
          socket.once("drain", resolve);
          socket.once("close", resolve);
        } else resolve();
      }),
  };
  readFrames(socket, ({ type, flags, payload }) => {
    if (type === FRAME.GOAWAY) {
      conn.goaway = {
        lastStreamId: payload.readUInt32BE(0) & 0x7fffffff,
        code: payload.readUInt32BE(4),
      };
      conn.goawayCodes.push(conn.goaway.code);
    } else if (type === FRAME.RST_STREAM) conn.resets += 1;
    else if (type === FRAME.HEADERS) conn.headers += 1;
    else if (type === FRAME.SETTINGS && !(flags & FLAG.ACK) && !socket.destroyed) {
      socket.write(h2Frame(FRAME.SETTINGS, FLAG.ACK, 0));
    }
  });
  if (options.sendPreface ?? true)
    await conn.write(Buffer.concat([preface, h2Frame(FRAME.SETTINGS, 0, 0)]));
  return conn;
}

// RFC 9113 §7 error codes, by number.
const h2Errors = [
  "NO_ERROR",
  "PROTOCOL_ERROR",
  "INTERNAL_ERROR",
  "FLOW_CONTROL_ERROR",
  "SETTINGS_TIMEOUT",
  "STREAM_CLOSED",
  "FRAME_SIZE_ERROR",
  "REFUSED_STREAM",
  "CANCEL",
  "COMPRESSION_ERROR",
  "CONNECT_ERROR",
  "ENHANCE_YOUR_CALM",
  "INADEQUATE_SECURITY",
  "HTTP_1_1_REQUIRED",
];
const h2ErrorName = (code: number | undefined) =>
  code === undefined ? "none" : (h2Errors[code] ?? String(code));

/** Waits for the server's first answer on a raw connection (a reset, headers, GOAWAY or a close) and says what it was. */
async function firstAnswer(conn: RawConnection, what: string) {
  await waitFor(() => conn.resets > 0 || conn.headers > 0 || conn.goaway || conn.socket.destroyed, {
    what,
  });
  return { reset: conn.resets, headers: conn.headers, goaway: h2ErrorName(conn.goaway?.code) };
}

/** After an abuse: the process lives, healthy traffic answers, nothing stored changed, no INTERNAL. */
async function expectServerUnharmed(server: ServerProcess): Promise<void> {
  expectAlive(server);
  await controlCheck(server.url);
  expect(await controlRows()).toEqual(controlBefore);
  expect((await accountsStored()).filter((a) => a !== "fuzz")).toEqual(["control"]);
  await expectNoInternalOnServer(server.url);
}

const acquirePath = `/${LeaseService.typeName}/Acquire`;
const cancel = Buffer.from([0, 0, 0, http2.constants.NGHTTP2_CANCEL]);

/** Successful renewals the server counted (Renew and KeepAlive). */
async function renewalsDone(url: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  return Number(/^leasehold_lease_renewals_total (\d+)/m.exec(text)?.[1] ?? 0);
}

/** The server's count of finished calls of one method, any code. */
async function callsOf(url: string, method: string): Promise<number> {
  let n = 0;
  for (const [k, v] of await serverCodes(url)) if (k.startsWith(`${method} `)) n += v;
  return n;
}

describe("HTTP/2 abuse", () => {
  it("rapid reset (CVE-2023-44487): streams opened and reset at once are cut off with GOAWAY; the server stays healthy (S3)", async () => {
    const rssBefore = rssMiB(guard);
    const callsBefore = await callsOf(guard.url, "Acquire");
    const block = headerBlock(grpcHeaders(acquirePath));
    const body = grpcMessage(AcquireRequestSchema, {
      key: { accountId: "fuzz", sessionId: "rapid-reset" },
      ttl: seconds(60),
      wait: seconds(0, 200_000_000),
    });
    const conn = await rawConnection(guard.url);
    const target = 20_000;
    const perWrite = 250;
    let streams = 0;
    const started = performance.now();
    while (streams < target && !conn.socket.destroyed) {
      const frames: Buffer[] = [];
      for (let j = 0; j < perWrite; j++) {
        const id = 2 * (streams + j) + 1;
        frames.push(
          h2Frame(FRAME.HEADERS, FLAG.END_HEADERS, id, block),
          h2Frame(FRAME.DATA, FLAG.END_STREAM, id, body),
          h2Frame(FRAME.RST_STREAM, 0, id, cancel),
        );
      }
      await conn.write(Buffer.concat(frames));
      streams += perWrite;
    }
    await within(conn.closed, { what: "the server to close the rapid-reset connection" });
    const elapsedMs = Math.round(performance.now() - started);
    abuseReport.rapidReset = {
      streamsWritten: streams,
      goaways: conn.goawayCodes.map(h2ErrorName),
      goawayLastStreamId: conn.goaway?.lastStreamId,
      acquireCallsTheServerRan: (await callsOf(guard.url, "Acquire")) - callsBefore,
      elapsedMs,
      rssMiB: { before: Math.round(rssBefore), after: Math.round(rssMiB(guard)) },
    };
    // nghttp2's bound: after a burst of about 1,000 reset streams the
    // connection gets GOAWAY INTERNAL_ERROR, and no later stream is served.
    expect(conn.goawayCodes).toContain(http2.constants.NGHTTP2_INTERNAL_ERROR);
    expect(conn.goaway?.lastStreamId ?? Number.POSITIVE_INFINITY).toBeLessThan(2 * 1_100);
    expect(rssMiB(guard) - rssBefore).toBeLessThan(100);
    await expectServerUnharmed(guard);
  });

  it("oversized headers: 100 KiB of one header over HTTP/2 and HTTP/1.1, 1,000 header fields, and an endless CONTINUATION flood are refused without harm (S3)", async () => {
    const rssBefore = rssMiB(guard);
    const outcomes: Record<string, unknown> = {};

    // One 100 KiB header, split into HEADERS and CONTINUATION frames.
    {
      const conn = await rawConnection(guard.url);
      const block = headerBlock(grpcHeaders(acquirePath, [["x-big", "b".repeat(100 * 1024)]]));
      const pieces: Buffer[] = [];
      for (let at = 0; at < block.length; at += 16_384)
        pieces.push(block.subarray(at, at + 16_384));
      await conn.write(
        Buffer.concat(
          pieces.map((p, i) =>
            h2Frame(
              i === 0 ? FRAME.HEADERS : FRAME.CONTINUATION,
              (i === 0 ? FLAG.END_STREAM : 0) | (i === pieces.length - 1 ? FLAG.END_HEADERS : 0),
              1,
              p,
            ),
          ),
        ),
      );
      outcomes.header100KiB = await firstAnswer(conn, "an answer to a 100 KiB header");
      conn.socket.destroy();
    }

    // 1,000 header fields of a few bytes each.
    {
      const conn = await rawConnection(guard.url);
      const many = Array.from({ length: 1_000 }, (_, i): [string, string] => [`x-h${i}`, "v"]);
      await conn.write(
        h2Frame(
          FRAME.HEADERS,
          FLAG.END_HEADERS | FLAG.END_STREAM,
          1,
          headerBlock(grpcHeaders(acquirePath, many)),
        ),
      );
      outcomes.headerFields1000 = await firstAnswer(conn, "an answer to 1,000 header fields");
      conn.socket.destroy();
    }

    // CONTINUATION flood: a header block that never ends (up to 64 MiB sent).
    {
      const conn = await rawConnection(guard.url);
      await conn.write(h2Frame(FRAME.HEADERS, 0, 1, headerBlock(grpcHeaders(acquirePath))));
      const piece = h2Frame(
        FRAME.CONTINUATION,
        0,
        1,
        headerBlock([["x-more", "c".repeat(16_000)]]),
      );
      let sentBytes = 0;
      while (sentBytes < 64 * 1024 * 1024 && !conn.socket.destroyed) {
        await conn.write(Buffer.concat(Array.from({ length: 16 }, () => piece)));
        sentBytes += 16 * piece.length;
      }
      await within(conn.closed, {
        what: "the server to close a connection flooding CONTINUATION frames",
      });
      outcomes.continuationFlood = {
        sentMiB: Math.round(sentBytes / 1024 / 1024),
        goaway: h2ErrorName(conn.goaway?.code),
      };
      expect(sentBytes).toBeLessThan(64 * 1024 * 1024);
    }

    // HTTP/1.1: 100 KiB of one header is 431.
    {
      const status = await new Promise<number>((resolve, reject) => {
        const req = http.request(new URL(acquirePath, guard.url), {
          method: "POST",
          headers: { "content-type": "application/json", "x-big": "b".repeat(100 * 1024) },
        });
        req.on("response", (res) => {
          res.resume();
          resolve(res.statusCode ?? 0);
        });
        req.on("error", reject);
        req.end("{}");
      });
      outcomes.http1Header100KiB = status;
      expect(status).toBe(431);
    }

    abuseReport.oversizedHeaders = {
      ...outcomes,
      rssMiB: { before: Math.round(rssBefore), after: Math.round(rssMiB(guard)) },
    };
    expect(rssMiB(guard) - rssBefore).toBeLessThan(100);
    await expectServerUnharmed(guard);
  });
});

/** A gRPC call with the fuzz token on its own connection, which reads nothing until `read`. */
function slowCall(url: string, method: string) {
  const session = http2.connect(url);
  session.on("error", () => {});
  const stream = session.request({
    ":method": "POST",
    ":path": `/${LeaseService.typeName}/${method}`,
    "content-type": "application/grpc",
    te: "trailers",
    authorization: tokens.fuzz,
  });
  stream.on("error", () => {});
  // The status: in trailers, or in the response headers of a trailers-only answer.
  let trailers: http2.IncomingHttpHeaders = {};
  stream.on("response", (headers) => {
    if (headers["grpc-status"] !== undefined) trailers = headers;
  });
  stream.on("trailers", (t) => {
    trailers = t;
  });
  const ended = new Promise<void>((resolve) => stream.once("close", () => resolve()));
  return {
    stream,
    /** Reads the rest of the call; resolves with its messages and grpc-status once it ends. */
    readAll: async () => {
      const chunks: Buffer[] = [];
      stream.on("data", (c: Buffer) => chunks.push(c));
      await ended;
      const body = Buffer.concat(chunks);
      const frames: Buffer[] = [];
      for (let at = 0; at + 5 <= body.length; at += 5 + body.readUInt32BE(at + 1)) {
        frames.push(body.subarray(at + 5, at + 5 + body.readUInt32BE(at + 1)));
      }
      return {
        frames,
        status: trailers["grpc-status"],
        message: decodeURIComponent(String(trailers["grpc-message"] ?? "")),
      };
    },
    /** Reads until `done` holds for the messages so far. */
    readUntil: (done: (frames: Buffer[]) => boolean) => {
      let body = Buffer.alloc(0);
      const frames: Buffer[] = [];
      return within(
        new Promise<Buffer[]>((resolve) => {
          stream.on("data", (c: Buffer) => {
            body = Buffer.concat([body, c]);
            while (body.length >= 5 && body.length >= 5 + body.readUInt32BE(1)) {
              frames.push(body.subarray(5, 5 + body.readUInt32BE(1)));
              body = body.subarray(5 + body.readUInt32BE(1));
            }
            if (done(frames)) resolve(frames);
          });
        }),
        { what: `${method} messages the test waits for` },
      );
    },
    close: () => {
      stream.close(http2.constants.NGHTTP2_CANCEL);
      session.close();
    },
  };
}

describe("slow readers", () => {
  it("40 Watch streams that never read, under 4,000 changes: each watcher's buffer is bounded and it gets a fresh snapshot instead (L1), memory stays bounded", async () => {
    const rssBefore = rssMiB(guard);
    const watchers = Array.from({ length: 40 }, () => slowCall(guard.url, "Watch"));
    for (const w of watchers) {
      w.stream.end(
        grpcMessage(WatchRequestSchema, {
          key: { accountId: "fuzz", sessionId: "" },
          includeRenewals: true,
        }),
      );
    }
    const transport = createGrpcTransport({ baseUrl: guard.url });
    const client = createClient(LeaseService, transport);
    const fuzz = { headers: authHeaders("fuzz") };
    let changes = 0;
    const worker = async (w: number) => {
      for (let i = 0; i < 250; i++) {
        const key = { accountId: "fuzz", sessionId: `slow-watch-${w}-${i % 10}` };
        const a = await client.acquire({ key, ttl: seconds(60) }, fuzz);
        await client.release({ key, runId: a.lease?.runId ?? "" }, fuzz);
        changes += 2;
      }
    };
    await Promise.all(Array.from({ length: 8 }, (_, w) => worker(w)));
    const rssAfter = rssMiB(guard);
    transport.close();
    // The first watcher reads again: past the snapshot it was sent at the
    // start, it gets a second one, not the backlog.
    const snapshots = (frames: Buffer[]) =>
      frames.filter((f) => fromBinary(WatchResponseSchema, f).kind.case === "snapshot").length;
    const first = watchers[0] as ReturnType<typeof slowCall>;
    const frames = await first.readUntil((f) => snapshots(f) >= 2);
    for (const w of watchers) w.close();
    abuseReport.slowWatchers = {
      watchers: watchers.length,
      changes,
      messagesReadByOneWatcherUntilItsSecondSnapshot: frames.length,
      rssMiB: { before: Math.round(rssBefore), after: Math.round(rssAfter) },
    };
    expect(frames.length).toBeLessThan(changes);
    expect(rssAfter - rssBefore).toBeLessThan(150);
    await expectServerUnharmed(guard);
  });

  it("a KeepAlive stream whose client sends 6,000 renewals and reads nothing holds bounded server memory; its answers are all for its run", async () => {
    const transport = createGrpcTransport({ baseUrl: guard.url });
    const client = createClient(LeaseService, transport);
    const key = { accountId: "fuzz", sessionId: "slow-keepalive" };
    const a = await client.acquire({ key, ttl: seconds(600) }, { headers: authHeaders("fuzz") });
    transport.close();
    const runId = a.lease?.runId ?? "";
    const rssBefore = rssMiB(guard);
    const renewalsBefore = await renewalsDone(guard.url);
    const call = slowCall(guard.url, "KeepAlive");
    const renewal = grpcMessage(KeepAliveRequestSchema, { key, runId, ttl: seconds(600) });
    const requests = 6_000;
    call.stream.write(Buffer.concat(Array.from({ length: requests }, () => renewal)));
    // The server goes on renewing while its answers wait in HTTP/2 flow
    // control (or ends the stream at its backlog bound): either way some
    // renewals are done and nothing grows without bound.
    await waitFor(async () => (await renewalsDone(guard.url)) > renewalsBefore, {
      what: "renewals of the unread KeepAlive stream",
    });
    const rssUnread = rssMiB(guard);
    call.stream.end();
    const end = await within(call.readAll(), { what: "the rest of the KeepAlive stream" });
    call.close();
    const answers = end.frames.map((f) => fromBinary(KeepAliveResponseSchema, f));
    abuseReport.slowKeepAlive = {
      renewalsSent: requests,
      renewalsDone: (await renewalsDone(guard.url)) - renewalsBefore,
      answersDelivered: answers.length,
      status: end.status,
      message: end.message,
      rssMiB: { before: Math.round(rssBefore), unread: Math.round(rssUnread) },
    };
    expect(["0", "8"]).toContain(String(end.status));
    expect(answers.length).toBeLessThanOrEqual(requests);
    expect(answers.every((m) => m.runId === runId && m.result.case === "lease")).toBe(true);
    expect(rssUnread - rssBefore).toBeLessThan(100);
    await expectServerUnharmed(guard);
  });
});

/** Opens `n` sockets to `url` in waves (the listen backlog is finite), each sending `first` (if any). */
async function openSockets(
  url: string,
  n: number,
  first?: string,
): Promise<{ socket: net.Socket; closedAfterMs: Promise<number> }[]> {
  const { hostname, port } = new URL(url);
  const out: { socket: net.Socket; closedAfterMs: Promise<number> }[] = [];
  for (let at = 0; at < n; at += 200) {
    const wave = Array.from({ length: Math.min(200, n - at) }, async () => {
      // From before the connect: the server accepts after this, so its
      // deadline cannot fall earlier than `opened` + the timeout.
      const opened = performance.now();
      const socket = net.connect({ host: hostname, port: Number(port) });
      socket.on("error", () => {});
      socket.resume();
      await new Promise<void>((resolve, reject) => {
        socket.once("connect", resolve);
        socket.once("error", reject);
      });
      const closedAfterMs = new Promise<number>((resolve) =>
        socket.once("close", () => resolve(performance.now() - opened)),
      );
      if (first !== undefined) socket.write(first);
      return { socket, closedAfterMs };
    });
    out.push(...(await Promise.all(wave)));
  }
  return out;
}

describe("connections that carry no calls", () => {
  it("connections that never finish their opening are closed after --handshake-timeout; healthy traffic answers meanwhile", async () => {
    const kinds: Record<string, string | undefined> = {
      silent: undefined,
      "partial HTTP/2 preface": "PRI * HTTP/2.0\r\n",
      "preface without SETTINGS": preface.toString("latin1"),
      "partial HTTP/1.1 request": "POST /leasehold.v1.LeaseService/Get HTTP/1.1\r\nHost: a\r\n",
    };
    const opened = await Promise.all(
      Object.entries(kinds).map(async ([kind, first]) => ({
        kind,
        sockets: await openSockets(guard.url, 250, first),
      })),
    );
    await controlCheck(guard.url);
    const closed: Record<string, { minMs: number; maxMs: number }> = {};
    for (const { kind, sockets } of opened) {
      const times = await within(Promise.all(sockets.map((s) => s.closedAfterMs)), {
        what: `the server to close every "${kind}" connection`,
        timeoutMs: 30_000,
      });
      closed[kind] = {
        minMs: Math.round(Math.min(...times)),
        maxMs: Math.round(Math.max(...times)),
      };
    }
    abuseReport.unfinishedOpenings = {
      perKind: 250,
      handshakeTimeoutMs: guardTimeouts.handshakeMs,
      closed,
    };
    // Not before its time: the bound is the setting, not an accident.
    for (const { minMs } of Object.values(closed)) {
      expect(minMs).toBeGreaterThanOrEqual(guardTimeouts.handshakeMs);
    }
    await expectServerUnharmed(guard);
  });

  it("3,000 idle HTTP/2 connections: the server answers healthy traffic while they are open and closes them with GOAWAY after --idle-timeout", async () => {
    const rssBefore = rssMiB(guard);
    const n = 3_000;
    const sessions: {
      session: http2.ClientHttp2Session;
      goaway: boolean;
      closed: Promise<number>;
    }[] = [];
    const started = performance.now();
    for (let at = 0; at < n; at += 200) {
      const wave = Array.from({ length: Math.min(200, n - at) }, async () => {
        const session = http2.connect(guard.url);
        const entry = {
          session,
          goaway: false,
          closed: new Promise<number>((resolve) =>
            session.once("close", () => resolve(performance.now())),
          ),
        };
        session.on("error", () => {});
        session.once("goaway", () => {
          entry.goaway = true;
        });
        await new Promise<void>((resolve, reject) => {
          session.once("remoteSettings", () => resolve());
          session.once("error", reject);
        });
        return entry;
      });
      sessions.push(...(await Promise.all(wave)));
    }
    const allOpenAt = performance.now();
    const rssOpen = rssMiB(guard);
    await controlCheck(guard.url);
    const closedAt = await within(Promise.all(sessions.map((s) => s.closed)), {
      what: `the server to close ${n} idle connections`,
      timeoutMs: 60_000,
    });
    const firstClose = Math.min(...closedAt);
    abuseReport.idleConnections = {
      connections: n,
      openedInMs: Math.round(allOpenAt - started),
      idleTimeoutMs: guardTimeouts.idleMs,
      closedWithGoaway: sessions.filter((s) => s.goaway).length,
      allClosedAfterOpenMs: Math.round(Math.max(...closedAt) - allOpenAt),
      controlLatencyWhileOpenMs: Math.round(controlLatenciesMs[controlLatenciesMs.length - 1] ?? 0),
      rssMiB: {
        before: Math.round(rssBefore),
        open: Math.round(rssOpen),
        after: Math.round(rssMiB(guard)),
      },
    };
    // The first session opened at `started`; none is closed before the idle bound.
    expect(firstClose - started).toBeGreaterThan(guardTimeouts.idleMs * 0.9);
    expect(sessions.filter((s) => s.goaway).length).toBe(n);
    await expectServerUnharmed(guard);
  });
});
