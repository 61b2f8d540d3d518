// The client's side of "streams outlive no token" (DESIGN §7): the server
// ends a KeepAlive stream with UNAUTHENTICATED (cause expired) once its
// token has expired. A client with a token function reopens the stream with
// a fresh token and keeps its leases (L2 is not triggered by a token's
// expiry); a client with a fixed token loses them, and the loss says why.
// Over gRPC (the native path, and connect-node's with --grpc-path connect)
// and the Connect protocol.

import { beforeAll, describe, expect, it } from "vitest";
import { type ClientEvent, LeaseLostError, UnauthenticatedError } from "../src/client/index.js";
import type { LeaseServer } from "../src/server/server.js";
import { useTestDatabase } from "./support/fixture.js";
import { createTestKeys, type TestKeys } from "./support/tokens.js";
import { waitFor } from "./support/wait.js";

const { db, startServer, libraryClient } = useTestDatabase();
let keys: TestKeys;
const servers = {} as Record<"native" | "connect", LeaseServer>;
const account = "token-acct";

beforeAll(async () => {
  keys = await createTestKeys();
  for (const mode of ["native", "connect"] as const) {
    servers[mode] = await startServer([...keys.args, "--grpc-path", mode]);
  }
});

// jose accepts a token 5 s past its `exp` (the verifier's clock tolerance):
// one that expired 3 s ago is accepted for one to two seconds more.
const shortLived = () => keys.token(account, { expiresIn: -3 });

const expiresAt = async (sessionId: string): Promise<number> => {
  const [row] = await db.sql<{ ms: number }[]>`
    SELECT (extract(epoch FROM expires_at) * 1000)::float8 AS ms FROM leases
    WHERE account_id = ${account} AND session_id = ${sessionId}`;
  return row?.ms ?? 0;
};

const cases = [
  { mode: "native", protocol: "grpc" },
  { mode: "connect", protocol: "grpc" },
  { mode: "native", protocol: "connect" },
] as const;

describe("a KeepAlive stream ended by its token's expiry", () => {
  for (const { mode, protocol } of cases) {
    it(`L2: with a token function, runExclusive reopens it with a fresh token and keeps its lease past the token's expiry (${protocol}, --grpc-path ${mode})`, async () => {
      const events: ClientEvent[] = [];
      let tokens = 0;
      const client = libraryClient({
        baseUrl: servers[mode].url,
        protocol,
        token: () => {
          tokens += 1;
          return shortLived();
        },
        onEvent: (e) => events.push(e),
      });
      const sessionId = `refresh-${mode}-${protocol}`;
      const result = await client.runExclusive(
        { accountId: account, sessionId },
        async ({ signal, fencingToken }) => {
          // The server ends the stream at the first token's expiry…
          await waitFor(
            () =>
              events.some(
                (e) =>
                  e.type === "keepalive-failed" &&
                  e.error instanceof UnauthenticatedError &&
                  e.error.failure === "expired" &&
                  e.retryInMs !== undefined,
              ),
            { what: "the stream to end at the token's expiry" },
          );
          const reopenedAt = events.length;
          await waitFor(() => events.slice(reopenedAt).some((e) => e.type === "keepalive-open"), {
            what: "the stream to reopen",
          });
          // …and the reopened stream renews the lease with the fresh token.
          const before = await expiresAt(sessionId);
          await waitFor(async () => (await expiresAt(sessionId)) > before, {
            what: "a renewal on the reopened stream",
          });
          expect(signal.aborted).toBe(false);
          return fencingToken;
        },
        { ttlMs: 3_000 },
      );
      expect(typeof result).toBe("bigint");
      // A token for the acquire, the first stream, the reopened one (at least).
      expect(tokens).toBeGreaterThanOrEqual(3);
    });
  }

  it("L2: with a fixed token that expires, the lease is lost and the reason says the token expired and cannot be renewed", async () => {
    const client = libraryClient({
      baseUrl: servers.native.url,
      protocol: "grpc",
      token: await shortLived(),
    });
    const error = await client
      .runExclusive(
        { accountId: account, sessionId: "fixed-token" },
        (ctx) =>
          new Promise((_, reject) => {
            ctx.signal.addEventListener("abort", () => reject(ctx.signal.reason), { once: true });
          }),
        { ttlMs: 3_000 },
      )
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(LeaseLostError);
    const lost = error as LeaseLostError;
    expect(lost.lossReason).toBe("token_expired");
    expect(lost.message).toMatch(/token expired, and a fixed token cannot be renewed/);
    expect(lost.cause).toBeInstanceOf(UnauthenticatedError);
    expect((lost.cause as UnauthenticatedError).failure).toBe("expired");
  });
});
