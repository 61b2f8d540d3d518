// The authorization matrix (DESIGN §7): every LeaseService RPC, streams
// included, × no token, malformed, bad signature, expired, another account,
// missing scope, allowed — over a real socket, on a server with keys. A
// refused call changes nothing stored (S3) and its message says nothing
// about the account it tried to reach.

import { randomBytes, randomUUID } from "node:crypto";
import { Code, ConnectError } from "@connectrpc/connect";
import { beforeAll, describe, expect, it } from "vitest";
import { createLeaseClient, UnauthenticatedError } from "../src/client/index.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { seconds } from "./support/calls.js";
import { useTestServer } from "./support/fixture.js";
import { storedState } from "./support/leases.js";
import { adminScope, bearer, signToken } from "./support/tokens.js";

const { db, server, client, keys } = useTestServer({ keys: true });
let held: { key: { accountId: string; sessionId: string }; runId: string; token: bigint };

const account = "alice";

beforeAll(async () => {
  const key = { accountId: account, sessionId: "held" };
  const a = await client.acquire(
    { key, ttl: seconds(600), holder: "desktop" },
    bearer(await keys.token(account)),
  );
  held = { key, runId: a.lease?.runId ?? "", token: a.lease?.fencingToken ?? 0n };
});

type Options = { headers?: Record<string, string>; signal?: AbortSignal };

/** Reads the first message of a stream, then ends the call. */
async function first<T>(open: (signal: AbortSignal) => AsyncIterable<T>): Promise<T | undefined> {
  const controller = new AbortController();
  try {
    for await (const m of open(controller.signal)) return m;
    return undefined;
  } finally {
    controller.abort();
  }
}

/** One request message, then the stream stays open until the call ends. */
async function* oneThenWait<T>(message: T, signal: AbortSignal): AsyncIterable<T> {
  yield message;
  await new Promise<void>((resolve) => signal.addEventListener("abort", () => resolve()));
}

// Each RPC as the matrix calls it; `allowedTarget` names a session the
// allowed case may change (Acquire and Revoke act on fresh ones).
const rpcs: Record<string, (o: Options, allowed?: boolean) => Promise<unknown>> = {
  Acquire: (o) =>
    client.acquire(
      { key: { accountId: account, sessionId: `acq-${randomUUID()}` }, ttl: seconds(30) },
      o,
    ),
  Renew: (o) => client.renew({ key: held.key, runId: held.runId }, o),
  Release: (o) =>
    client.release({ key: { accountId: account, sessionId: "never" }, runId: randomUUID() }, o),
  Get: (o) => client.get({ key: held.key }, o),
  List: (o) => client.list({ accountId: account }, o),
  KeepAlive: (o) =>
    first((signal) =>
      client.keepAlive(oneThenWait({ key: held.key, runId: held.runId }, signal), {
        ...o,
        signal,
      }),
    ),
  Watch: (o) => first((signal) => client.watch({ key: held.key }, { ...o, signal })),
  RequestHandoff: (o) =>
    client.requestHandoff({ key: held.key, requesterHolder: "browser", reason: "matrix" }, o),
  History: (o) => client.history({ key: held.key }, o),
  CheckFence: (o) => client.checkFence({ key: held.key, fencingToken: held.token }, o),
  Revoke: async (o, allowed) => {
    if (!allowed) return client.revoke({ key: held.key, reason: "matrix" }, o);
    // A lease of its own to revoke, so the allowed case leaves `held` alone.
    const key = { accountId: account, sessionId: `rev-${randomUUID()}` };
    await client.acquire({ key, ttl: seconds(30) }, bearer(await keys.token(account)));
    return client.revoke({ key, reason: "matrix" }, o);
  },
};

const outcome = (call: Promise<unknown>) =>
  call.then(
    () => undefined,
    (e: unknown) => ConnectError.from(e),
  );

type Case = {
  name: string;
  options: () => Promise<Options>;
  code: Code;
  message: RegExp;
  /** The ErrorInfo `cause` of an UNAUTHENTICATED refusal. */
  failure?: string;
};

const cases: Case[] = [
  {
    name: "no token",
    options: async () => ({}),
    code: Code.Unauthenticated,
    message: /missing bearer token/,
    failure: "missing",
  },
  {
    name: "malformed token",
    options: async () => bearer("not-a.jwt"),
    code: Code.Unauthenticated,
    message: /malformed token/,
    failure: "malformed",
  },
  {
    name: "bad signature",
    options: async () => bearer(await signToken(randomBytes(32), account, { scope: adminScope })),
    code: Code.Unauthenticated,
    message: /signature is not valid/,
    failure: "bad_signature",
  },
  {
    name: "expired token",
    options: async () => bearer(await keys.token(account, { scope: adminScope, expiresIn: -3600 })),
    code: Code.Unauthenticated,
    message: /token expired/,
    failure: "expired",
  },
  {
    name: "another account",
    options: async () => bearer(await keys.token("mallory", { scope: adminScope })),
    code: Code.PermissionDenied,
    message: /account_id is not the account of the caller's token/,
  },
];

describe("authorization matrix: every RPC × every credential", () => {
  for (const [rpc, call] of Object.entries(rpcs)) {
    describe(rpc, () => {
      for (const c of cases) {
        it(`S3: ${c.name} gets ${Code[c.code]}, a reason, and changes nothing`, async () => {
          const before = await storedState(db.sql);
          const error = await outcome(call(await c.options()));
          expect(error?.code).toBe(c.code);
          expect(error?.rawMessage).toMatch(c.message);
          if (c.failure !== undefined) {
            expect(error?.findDetails(ErrorInfoSchema)[0]).toMatchObject({
              reason: "UNAUTHENTICATED",
              metadata: { cause: c.failure },
            });
          }
          // Nothing about the account the call tried to reach.
          if (c.code === Code.PermissionDenied) expect(error?.rawMessage).not.toContain(account);
          expect(await storedState(db.sql)).toEqual(before);
        });
      }

      it("missing admin scope: only Revoke refuses it", async () => {
        const before = rpc === "Revoke" ? undefined : await storedState(db.sql);
        const error = await outcome(call(bearer(await keys.token(account))));
        if (rpc === "Revoke") {
          expect(error?.code).toBe(Code.PermissionDenied);
          expect(error?.rawMessage).toMatch(/Revoke needs the scope leasehold:admin/);
        } else {
          expect(error?.code).not.toBe(Code.PermissionDenied);
          expect(error?.code).not.toBe(Code.Unauthenticated);
          expect(before).toBeDefined();
        }
      });

      it("a guarded resource's token (fence scope, its own account): only CheckFence serves another account", async () => {
        const before = await storedState(db.sql);
        const resource = bearer(await keys.token("guarded-store", { scope: "leasehold:fence" }));
        const error = await outcome(call(resource));
        if (rpc === "CheckFence") {
          expect(error).toBeUndefined();
        } else {
          expect(error?.code).toBe(Code.PermissionDenied);
          expect(error?.rawMessage).not.toContain(account);
        }
        expect(await storedState(db.sql)).toEqual(before);
      });

      it("allowed: the account's own token (with the admin scope) is served", async () => {
        const error = await outcome(
          call(bearer(await keys.token(account, { scope: adminScope })), true),
        );
        expect(error).toBeUndefined();
      });
    });
  }
});

describe("the client library's view of a refusal", () => {
  it("an expired token is an UnauthenticatedError whose failure says expired", async () => {
    const expired = await keys.token(account, { expiresIn: -3600 });
    const leases = createLeaseClient({ baseUrl: server.url, token: expired });
    try {
      const error = await leases.get({ key: held.key }).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(UnauthenticatedError);
      expect((error as UnauthenticatedError).failure).toBe("expired");
    } finally {
      leases.close();
    }
  });
});

describe("streams are checked message by message", () => {
  it("S3: a KeepAlive stream that names another account after its own ends PERMISSION_DENIED", async () => {
    const token = await keys.token(account);
    const controller = new AbortController();
    async function* requests() {
      yield { key: held.key, runId: held.runId };
      yield { key: { accountId: "mallory", sessionId: "x" }, runId: randomUUID() };
      await new Promise<void>((resolve) =>
        controller.signal.addEventListener("abort", () => resolve()),
      );
    }
    const before = await db.sql`SELECT * FROM leases WHERE account_id = 'mallory'`;
    const seen: unknown[] = [];
    const error = await outcome(
      (async () => {
        for await (const m of client.keepAlive(requests(), {
          ...bearer(token),
          signal: controller.signal,
        })) {
          seen.push(m);
        }
      })(),
    );
    controller.abort();
    expect(error?.code).toBe(Code.PermissionDenied);
    expect(error?.rawMessage).not.toContain("mallory");
    expect([...(await db.sql`SELECT * FROM leases WHERE account_id = 'mallory'`)]).toEqual([
      ...before,
    ]);
  });

  it("a token's account claim must be a valid account id", async () => {
    const token = await keys.token("has space");
    const error = await outcome(client.get({ key: held.key }, bearer(token)));
    expect(error?.code).toBe(Code.Unauthenticated);
    expect(error?.rawMessage).toMatch(/token claim "sub" must name an account/);
  });

  it("the authorization header must be a Bearer token", async () => {
    const error = await outcome(
      client.get({ key: held.key }, { headers: { authorization: "Basic YWxpY2U6c2VjcmV0" } }),
    );
    expect(error?.code).toBe(Code.Unauthenticated);
    expect(error?.rawMessage).toMatch(/must be 'Bearer <JWT>'/);
  });
});
