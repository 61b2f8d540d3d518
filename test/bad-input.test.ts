// Bad input gets INVALID_ARGUMENT naming the field and the rule, over a real
// socket, and changes nothing stored.

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import { beforeAll, describe, expect, it } from "vitest";
import { BadRequestSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { useTestServer } from "./support/fixture.js";
import { storedState } from "./support/leases.js";

// Production TTL bounds (1s to 1h), so the bound checks are the real ones.
const { db, client } = useTestServer({ args: ["--min-ttl", "1s", "--max-ttl", "1h"] });
let held: { key: { accountId: string; sessionId: string }; runId: string };

beforeAll(async () => {
  const key = { accountId: "acct", sessionId: "held" };
  const a = await client.acquire({ key, ttl: create(DurationSchema, { seconds: 600n }) });
  held = { key, runId: a.lease?.runId ?? "" };
});

const ttl = (seconds: bigint, nanos = 0) => create(DurationSchema, { seconds, nanos });
const key = { accountId: "acct", sessionId: "held" };
const long = "x".repeat(129);

type Case = [name: string, call: () => Promise<unknown>, field: string, rule: RegExp];

const cases = (): Case[] => [
  ["missing key", () => client.acquire({ ttl: ttl(10n) }), "key", /is required/],
  [
    "empty account_id",
    () => client.acquire({ key: { accountId: "", sessionId: "s" }, ttl: ttl(10n) }),
    "key.account_id",
    /must not be empty/,
  ],
  [
    "empty session_id",
    () => client.acquire({ key: { accountId: "a", sessionId: "" }, ttl: ttl(10n) }),
    "key.session_id",
    /must not be empty/,
  ],
  [
    "oversized session_id",
    () => client.acquire({ key: { accountId: "a", sessionId: long }, ttl: ttl(10n) }),
    "key.session_id",
    /at most 128 characters, got 129/,
  ],
  [
    "oversized account_id",
    () => client.get({ key: { accountId: long, sessionId: "s" } }),
    "key.account_id",
    /at most 128/,
  ],
  [
    "session_id with a space",
    () => client.acquire({ key: { accountId: "a", sessionId: "a b" }, ttl: ttl(10n) }),
    "key.session_id",
    /may contain only/,
  ],
  [
    "run_id not a UUID",
    () => client.acquire({ key, runId: "run-1", ttl: ttl(10n) }),
    "run_id",
    /must be a UUID/,
  ],
  ["missing ttl", () => client.acquire({ key }), "ttl", /is required/],
  ["ttl zero", () => client.acquire({ key, ttl: ttl(0n) }), "ttl", /between 1s and 1h, got 0s/],
  ["ttl negative", () => client.acquire({ key, ttl: ttl(-5n) }), "ttl", /between 1s and 1h/],
  [
    "ttl above the bound",
    () => client.acquire({ key, ttl: ttl(7200n) }),
    "ttl",
    /between 1s and 1h, got 2h/,
  ],
  [
    "ttl with broken nanos",
    () => client.acquire({ key, ttl: ttl(1n, -5) }),
    "ttl",
    /not a valid duration/,
  ],
  [
    "wait above the bound",
    () => client.acquire({ key, ttl: ttl(10n), wait: ttl(86_400n) }),
    "wait",
    /between 0s and 5m/,
  ],
  [
    "holder too long",
    () => client.acquire({ key, ttl: ttl(10n), holder: "h".repeat(65) }),
    "holder",
    /at most 64/,
  ],
  [
    "holder with a control character",
    () => client.acquire({ key, ttl: ttl(10n), holder: "a\nb" }),
    "holder",
    /control characters/,
  ],
  ["renew without run_id", () => client.renew({ key }), "run_id", /is required/],
  [
    "renew with a bad run_id",
    () => client.renew({ key, runId: "' OR 1=1 --" }),
    "run_id",
    /must be a UUID/,
  ],
  [
    "renew with ttl zero",
    () => client.renew({ key, runId: held.runId, ttl: ttl(0n) }),
    "ttl",
    /between 1s and 1h/,
  ],
  [
    "release with a bad run_id",
    () => client.release({ key, runId: "nope" }),
    "run_id",
    /must be a UUID/,
  ],
  ["release without key", () => client.release({ runId: randomUUID() }), "key", /is required/],
  ["get without key", () => client.get({}), "key", /is required/],
  ["list without account", () => client.list({}), "account_id", /must not be empty/],
  [
    "list with negative page_size",
    () => client.list({ accountId: "acct", pageSize: -1 }),
    "page_size",
    /must not be negative/,
  ],
  [
    "list with a forged page_token",
    () => client.list({ accountId: "acct", pageToken: "%%%" }),
    "page_token",
    /not a token/,
  ],
];

describe("INVALID_ARGUMENT names the field and the rule", () => {
  it.each(cases().map((c) => [c[0], c] as const))("%s", async (_name, [, call, field, rule]) => {
    const before = await storedState(db.sql);
    const error = await call().then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(ConnectError);
    const ce = error as ConnectError;
    expect(ce.code).toBe(Code.InvalidArgument);
    expect(ce.rawMessage.startsWith(`${field} `)).toBe(true);
    expect(ce.rawMessage).toMatch(rule);
    const [badRequest] = ce.findDetails(BadRequestSchema);
    expect(badRequest?.fieldViolations[0]?.field).toBe(field);
    expect(await storedState(db.sql)).toEqual(before);
  });

  it("S3: after every rejected request the held lease is unchanged", async () => {
    const got = await client.get({ key: held.key });
    expect(got.lease?.runId).toBe(held.runId);
  });
});
