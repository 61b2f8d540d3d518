// The fencing interceptor on a downstream service of its own: a small ledger
// service (built here from a descriptor, as any team's service would be)
// whose Append writes through the transaction the interceptor opened. Real
// socket, real database, Connect (HTTP/1.1) and gRPC (h2c) clients.

import { randomUUID } from "node:crypto";
import { create, createFileRegistry, type DescMessage, type DescService } from "@bufbuild/protobuf";
import {
  FieldDescriptorProto_Label,
  FieldDescriptorProto_Type,
  FileDescriptorProtoSchema,
} from "@bufbuild/protobuf/wkt";
import {
  Code,
  ConnectError,
  type ConnectRouter,
  createClient,
  type HandlerContext,
  type Transport,
} from "@connectrpc/connect";
import {
  connectNodeAdapter,
  createConnectTransport,
  createGrpcTransport,
} from "@connectrpc/connect-node";
import { beforeAll, describe, expect, it } from "vitest";
import { BadRequestSchema, ErrorInfoSchema } from "../../src/gen/google/rpc/error_details_pb.js";
import { highestToken } from "../../src/guarded/fence.js";
import { fenceClaimHeaders } from "../../src/guarded/headers.js";
import { fencedCallKey, fencingInterceptor } from "../../src/guarded/interceptor.js";
import { createGrantCheck, createLiveCheck } from "../../src/guarded/live-check.js";
import { listen } from "../../src/host/listener.js";
import type { Sql } from "../../src/postgres/pool.js";
import { fencingHeaderNames as fencingHeaders } from "../../src/protocol/headers.js";
import { durationFromMillis } from "../../src/server/rpc/convert.js";
import { openTransaction } from "../support/db.js";
import { useTestServer } from "../support/fixture.js";
import { freshKey, untilExpired } from "../support/leases.js";
import { grpcClient } from "../support/server.js";

const { INT64, STRING } = FieldDescriptorProto_Type;
const { OPTIONAL, REPEATED } = FieldDescriptorProto_Label;

// test.ledger.v1.LedgerService { Append (fenced), Read (not fenced), Follow (streaming) }
const registry = createFileRegistry(
  create(FileDescriptorProtoSchema, {
    name: "test/ledger/v1/ledger.proto",
    package: "test.ledger.v1",
    syntax: "proto3",
    messageType: [
      {
        name: "AppendRequest",
        field: [{ name: "line", number: 1, type: STRING, label: OPTIONAL, jsonName: "line" }],
      },
      {
        name: "AppendResponse",
        field: [
          {
            name: "highest_token",
            number: 1,
            type: INT64,
            label: OPTIONAL,
            jsonName: "highestToken",
          },
        ],
      },
      {
        name: "ReadRequest",
        field: [
          { name: "session_id", number: 1, type: STRING, label: OPTIONAL, jsonName: "sessionId" },
        ],
      },
      {
        name: "ReadResponse",
        field: [{ name: "lines", number: 1, type: STRING, label: REPEATED, jsonName: "lines" }],
      },
    ],
    service: [
      {
        name: "LedgerService",
        method: [
          {
            name: "Append",
            inputType: ".test.ledger.v1.AppendRequest",
            outputType: ".test.ledger.v1.AppendResponse",
          },
          {
            name: "Read",
            inputType: ".test.ledger.v1.ReadRequest",
            outputType: ".test.ledger.v1.ReadResponse",
          },
          {
            name: "Follow",
            inputType: ".test.ledger.v1.ReadRequest",
            outputType: ".test.ledger.v1.ReadResponse",
            serverStreaming: true,
          },
        ],
      },
    ],
  }),
  () => undefined,
);
const LedgerService = registry.getService("test.ledger.v1.LedgerService") as DescService;
const message = (name: string) => registry.getMessage(`test.ledger.v1.${name}`) as DescMessage;

const { db, server: leaseServer, client: leases, defer } = useTestServer();
let ledgerUrl: string;
let liveLedgerUrl: string;
let grantedLedgerUrl: string;

function ledgerRoutes(sql: Sql) {
  return (router: ConnectRouter) => {
    const impl = {
      append: async (req: { line: string }, ctx: HandlerContext) => {
        const call = ctx.values.get(fencedCallKey);
        if (!call) throw new ConnectError("unfenced append", Code.Internal);
        // The service's own write, on the transaction that ran the check.
        await call.tx`
          INSERT INTO ledger_lines (account_id, session_id, token, line)
          VALUES (${call.claim.key.accountId}, ${call.claim.key.sessionId}, ${call.claim.token},
                  ${req.line})`;
        if (req.line === "fail after writing") {
          throw new ConnectError("the handler failed after writing", Code.FailedPrecondition);
        }
        if (req.line === "duplicate") {
          // A bug of the handler's: the same name twice (23505).
          await call.tx`INSERT INTO ledger_names VALUES (${call.claim.key.sessionId})`;
          await call.tx`INSERT INTO ledger_names VALUES (${call.claim.key.sessionId})`;
        }
        if (req.line === "locked row") {
          // Database trouble: a row another transaction holds, until lock_timeout.
          await call.tx`SET LOCAL lock_timeout = '300ms'`;
          await call.tx`UPDATE ledger_counter SET n = n + 1 WHERE id = 1`;
        }
        if (req.line === "slow") {
          // A statement far longer than the statement_timeout set before it.
          await call.tx`SET LOCAL statement_timeout = '100ms'`;
          await call.tx`SELECT pg_sleep(30)`;
        }
        if (req.line === "terminated") {
          // The server ends the handler's connection under it.
          await call.tx`SELECT pg_terminate_backend(pg_backend_pid())`;
        }
        return create(message("AppendResponse"), { highestToken: call.highestToken });
      },
      read: async (req: { sessionId: string }) => {
        const rows = await sql<{ line: string }[]>`
          SELECT line FROM ledger_lines WHERE session_id = ${req.sessionId} ORDER BY id`;
        return create(message("ReadResponse"), { lines: rows.map((r) => r.line) });
      },
      follow: async function* () {
        yield create(message("ReadResponse"), { lines: ["never reached"] });
      },
    };
    // A descriptor built at run time has no generated types to check against.
    router.service(LedgerService, impl as never);
  };
}

/** The ledger's client, typed by hand for the same reason. */
interface LedgerClient {
  append(
    req: { line: string },
    options: { headers: Record<string, string> },
  ): Promise<{ highestToken: bigint }>;
  read(req: { sessionId: string }): Promise<{ lines: string[] }>;
  follow(req: object, options: { headers: Record<string, string> }): AsyncIterable<unknown>;
}

const transports: [string, (baseUrl: string) => Transport][] = [
  ["Connect over HTTP/1.1", (baseUrl) => createConnectTransport({ baseUrl, httpVersion: "1.1" })],
  ["gRPC over h2c", (baseUrl) => createGrpcTransport({ baseUrl })],
];
const ledgerClient = (transport: Transport) =>
  createClient(LedgerService, transport) as unknown as LedgerClient;

async function serve(handler: Parameters<typeof listen>[0]["handler"]) {
  const l = await listen({ host: "127.0.0.1", port: 0, handler });
  defer(() => l.close(0));
  return `http://127.0.0.1:${l.port}`;
}

beforeAll(async () => {
  await db.sql`
    CREATE TABLE ledger_lines (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      account_id text NOT NULL, session_id text NOT NULL, token bigint NOT NULL, line text NOT NULL
    )`;
  await db.sql`CREATE TABLE ledger_names (name text PRIMARY KEY)`;
  await db.sql`CREATE TABLE ledger_counter (id int PRIMARY KEY, n int NOT NULL)`;
  await db.sql`INSERT INTO ledger_counter VALUES (1, 0)`;
  const fenced = (m: { name: string }) => m.name !== "Read";
  ledgerUrl = await serve(
    connectNodeAdapter({
      routes: ledgerRoutes(db.sql),
      interceptors: [fencingInterceptor({ sql: db.sql, fenced })],
    }),
  );
  const live = createLiveCheck(leases, { timeoutMs: 2_000 });
  liveLedgerUrl = await serve(
    connectNodeAdapter({
      routes: ledgerRoutes(db.sql),
      interceptors: [fencingInterceptor({ sql: db.sql, fenced, live })],
    }),
  );
  const granted = createGrantCheck(leases, { timeoutMs: 2_000 });
  grantedLedgerUrl = await serve(
    connectNodeAdapter({
      routes: ledgerRoutes(db.sql),
      interceptors: [fencingInterceptor({ sql: db.sql, fenced, granted })],
    }),
  );
});

async function refusal(call: Promise<unknown>): Promise<ConnectError> {
  return call.then(
    () => expect.fail("expected the call to be refused"),
    (e: unknown) => ConnectError.from(e),
  );
}

const append = (client: LedgerClient, line: string, headers: Record<string, string>) =>
  client.append({ line }, { headers });

async function lines(sessionId: string): Promise<string[]> {
  const rows = await db.sql<{ line: string }[]>`
    SELECT line FROM ledger_lines WHERE session_id = ${sessionId} ORDER BY id`;
  return rows.map((r) => r.line);
}

describe.each(transports)("fencing interceptor, %s", (_name, transport) => {
  const client = () => ledgerClient(transport(ledgerUrl));

  it("S7: a service that never saw the session accepts its first token; the same token writes again", async () => {
    const key = freshKey("ledger");
    const headers = fenceClaimHeaders({ key, token: 12n });
    expect((await append(client(), "one", headers)).highestToken).toBe(12n);
    expect((await append(client(), "two", headers)).highestToken).toBe(12n);
    expect(await lines(key.sessionId)).toEqual(["one", "two"]);
  });

  it("S7: a stale token is ABORTED with STALE_FENCING_TOKEN and highest_token, and the handler never runs", async () => {
    const key = freshKey("ledger");
    await append(client(), "from run B", fenceClaimHeaders({ key, token: 20n }));
    const error = await refusal(
      append(client(), "late write of run A", fenceClaimHeaders({ key, token: 19n })),
    );
    expect(error.code).toBe(Code.Aborted);
    const [info] = error.findDetails(ErrorInfoSchema);
    expect(info?.reason).toBe("STALE_FENCING_TOKEN");
    expect(info?.domain).toBe("leasehold.dev");
    expect(info?.metadata.highest_token).toBe("20");
    expect(await lines(key.sessionId)).toEqual(["from run B"]);
  });

  it("S7: a handler that fails after writing leaves neither its write nor the token's advance", async () => {
    const key = freshKey("ledger");
    await append(client(), "kept", fenceClaimHeaders({ key, token: 3n }));
    const error = await refusal(
      append(client(), "fail after writing", fenceClaimHeaders({ key, token: 50n })),
    );
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(await lines(key.sessionId)).toEqual(["kept"]);
    expect(await highestToken(db.sql, key)).toBe(3n);
  });

  it("S7: a handler's bug (a unique violation) is INTERNAL, not UNAVAILABLE, and writes nothing", async () => {
    const key = freshKey("ledger");
    const error = await refusal(
      append(client(), "duplicate", fenceClaimHeaders({ key, token: 4n })),
    );
    expect(error.code).toBe(Code.Internal);
    expect(error.rawMessage).toBe("internal error");
    expect(await lines(key.sessionId)).toEqual([]);
    expect(await highestToken(db.sql, key)).toBe(0n);
  });

  it("S7, S8: a handler's statement on a row held by an uncommitted transaction is UNAVAILABLE DATABASE_UNAVAILABLE at lock_timeout", async () => {
    const key = freshKey("ledger");
    const holder = await openTransaction(
      db,
      (tx) => tx`SELECT n FROM ledger_counter WHERE id = 1 FOR UPDATE`,
    );
    let error: ConnectError;
    try {
      error = await refusal(append(client(), "locked row", fenceClaimHeaders({ key, token: 4n })));
    } finally {
      await holder.end();
    }
    expect(error.code).toBe(Code.Unavailable);
    const [info] = error.findDetails(ErrorInfoSchema);
    expect(info?.reason).toBe("DATABASE_UNAVAILABLE");
    expect(info?.metadata.sql_state).toBe("55P03");
    expect(await lines(key.sessionId)).toEqual([]);
    // Once the row is free the same call writes.
    expect(
      (await append(client(), "locked row", fenceClaimHeaders({ key, token: 4n }))).highestToken,
    ).toBe(4n);
    expect(await lines(key.sessionId)).toEqual(["locked row"]);
  });

  it("a handler's statement past statement_timeout is DEADLINE_EXCEEDED; its connection ended by the server is UNAVAILABLE", async () => {
    const key = freshKey("ledger");
    const slow = await refusal(append(client(), "slow", fenceClaimHeaders({ key, token: 4n })));
    expect(slow.code).toBe(Code.DeadlineExceeded);
    const ended = await refusal(
      append(client(), "terminated", fenceClaimHeaders({ key, token: 4n })),
    );
    expect(ended.code).toBe(Code.Unavailable);
    expect(ended.findDetails(ErrorInfoSchema)[0]?.reason).toBe("DATABASE_UNAVAILABLE");
    expect(await lines(key.sessionId)).toEqual([]);
    expect(
      (await append(client(), "written", fenceClaimHeaders({ key, token: 4n }))).highestToken,
    ).toBe(4n);
  });

  it("bad input: a missing header is INVALID_ARGUMENT naming it, and nothing is written", async () => {
    const key = freshKey("ledger");
    const all = fenceClaimHeaders({ key, token: 5n });
    for (const name of Object.values(fencingHeaders)) {
      const headers = Object.fromEntries(Object.entries(all).filter(([h]) => h !== name));
      const error = await refusal(append(client(), "x", headers));
      expect(error.code).toBe(Code.InvalidArgument);
      expect(error.rawMessage).toBe(`${name} is required`);
      expect(error.findDetails(BadRequestSchema)[0]?.fieldViolations[0]?.field).toBe(name);
    }
    expect(await lines(key.sessionId)).toEqual([]);
  });

  it("bad input: a malformed, zero or negative token is INVALID_ARGUMENT naming the header", async () => {
    const key = freshKey("ledger");
    for (const token of [
      "abc",
      "1e3",
      "0x10",
      "+5",
      "-5",
      "0",
      "00",
      "9223372036854775808",
      "1.5",
    ]) {
      const headers = {
        ...fenceClaimHeaders({ key, token: 1n }),
        [fencingHeaders.fencingToken]: token,
      };
      const error = await refusal(append(client(), "x", headers));
      expect(error.code, token).toBe(Code.InvalidArgument);
      expect(error.rawMessage.startsWith(`${fencingHeaders.fencingToken} must be`), token).toBe(
        true,
      );
    }
    expect(await lines(key.sessionId)).toEqual([]);
    expect(await highestToken(db.sql, key)).toBe(0n);
  });

  it("bad input: a malformed account or session id is INVALID_ARGUMENT naming its header", async () => {
    const good = fenceClaimHeaders({ key: freshKey("ledger"), token: 1n });
    for (const name of [fencingHeaders.accountId, fencingHeaders.sessionId]) {
      const error = await refusal(append(client(), "x", { ...good, [name]: "has/slash" }));
      expect(error.code).toBe(Code.InvalidArgument);
      expect(error.rawMessage.startsWith(`${name} may contain only`)).toBe(true);
    }
  });

  it("methods left out of `fenced` need no headers", async () => {
    const res = await client().read({ sessionId: "nothing" });
    expect(res.lines).toEqual([]);
  });
});

describe("fencing interceptor, limits and live mode", () => {
  it("a streaming method cannot be guarded: UNIMPLEMENTED, not a silent pass", async () => {
    const client = ledgerClient(createGrpcTransport({ baseUrl: ledgerUrl }));
    const headers = fenceClaimHeaders({ key: freshKey("ledger"), token: 1n });
    const received: unknown[] = [];
    const error = await refusal(
      (async () => {
        for await (const m of client.follow({}, { headers })) received.push(m);
      })(),
    );
    expect(received).toEqual([]);
    expect(error.code).toBe(Code.Unimplemented);
  });

  it("S4, S7 live: the valid lease's token writes; after it expires unreplaced it is refused", async () => {
    const lease = grpcClient(leaseServer.url);
    const key = freshKey("ledger-live");
    const granted = await lease.acquire({ key, ttl: durationFromMillis(30_000), holder: "run-a" });
    const token = granted.lease?.fencingToken ?? 0n;
    const client = ledgerClient(createGrpcTransport({ baseUrl: liveLedgerUrl }));
    await append(client, "while held", fenceClaimHeaders({ key, token }));
    // The holder's last renewal asks for 100 ms; then it stalls past it.
    await lease.renew({ key, runId: granted.lease?.runId ?? "", ttl: durationFromMillis(100) });
    await untilExpired(db.sql, key);
    const error = await refusal(append(client, "after expiry", fenceClaimHeaders({ key, token })));
    expect(error.code).toBe(Code.FailedPrecondition);
    const [info] = error.findDetails(ErrorInfoSchema);
    expect(info?.reason).toBe("LEASE_NOT_HELD");
    expect(info?.metadata.cause).toBe("expired");
    expect(await lines(key.sessionId)).toEqual(["while held"]);
  });

  it("S7 live: a token the lease server never granted is refused", async () => {
    const client = ledgerClient(createGrpcTransport({ baseUrl: liveLedgerUrl }));
    const key = { accountId: "acct", sessionId: `never-${randomUUID()}` };
    const error = await refusal(append(client, "x", fenceClaimHeaders({ key, token: 7n })));
    expect(error.code).toBe(Code.FailedPrecondition);
    expect(error.findDetails(ErrorInfoSchema)[0]?.metadata.cause).toBe("not_found");
  });

  it("S7 granted: a token above every grant cannot raise the fence; the granted token raises it and writes again", async () => {
    const lease = grpcClient(leaseServer.url);
    const key = freshKey("ledger-granted");
    const answer = await lease.acquire({ key, ttl: durationFromMillis(30_000), holder: "run-a" });
    const token = answer.lease?.fencingToken ?? 0n;
    const client = ledgerClient(createGrpcTransport({ baseUrl: grantedLedgerUrl }));
    const forged = await refusal(
      append(client, "forged", fenceClaimHeaders({ key, token: 9_223_372_036_854_775_807n })),
    );
    expect(forged.code).toBe(Code.FailedPrecondition);
    expect(forged.findDetails(ErrorInfoSchema)[0]?.metadata.cause).toBe("not_found");
    expect(await highestToken(db.sql, key)).toBe(0n);
    expect((await append(client, "held", fenceClaimHeaders({ key, token }))).highestToken).toBe(
      token,
    );
    expect((await append(client, "again", fenceClaimHeaders({ key, token }))).highestToken).toBe(
      token,
    );
    expect(await lines(key.sessionId)).toEqual(["held", "again"]);
  });
});
