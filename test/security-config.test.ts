// Development mode, key configuration and TLS (DESIGN §7): without keys the
// server accepts calls without tokens only on loopback, and refuses to start
// anywhere else, saying how to configure keys; JWKS keys (RS256, ES256) with
// issuer, audience and a custom account claim; TLS from certificate files
// for gRPC (h2 by ALPN) and Connect over HTTP/1.1 on one port.

import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { Code, createClient } from "@connectrpc/connect";
import { createConnectTransport, createGrpcTransport } from "@connectrpc/connect-node";
import { exportJWK, generateKeyPair, SignJWT } from "jose";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { isLoopback } from "../src/config/ops-config.js";
import { ConfigError } from "../src/config/settings.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { parseGuardedConfig } from "../src/guarded/config.js";
import { createLogger } from "../src/log/logger.js";
import { parseServerConfig } from "../src/server/config/server-config.js";
import type { RunningServer } from "../src/server/server.js";
import { failure, seconds } from "./support/calls.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { grpcClient } from "./support/server.js";
import { bearer, createTestKeys } from "./support/tokens.js";

const { startServer, spawnServer } = useTestDatabase();
let dir: string;

beforeAll(async () => {
  dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-security-"));
});
afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

function configError(argv: string[], env: NodeJS.ProcessEnv = {}): string {
  try {
    parseServerConfig(argv, env);
  } catch (error) {
    expect(error).toBeInstanceOf(ConfigError);
    return (error as Error).message;
  }
  throw new Error("the configuration was accepted");
}

describe("development mode", () => {
  it("loopback addresses are 127.0.0.0/8, ::1 and localhost", () => {
    for (const host of ["127.0.0.1", "127.1.2.3", "::1", "localhost", "::ffff:127.0.0.1"]) {
      expect(isLoopback(host)).toBe(true);
    }
    for (const host of ["0.0.0.0", "::", "10.0.0.1", "example.com", "::ffff:10.0.0.1"]) {
      expect(isLoopback(host)).toBe(false);
    }
  });

  it("without keys, a non-loopback address is refused with how to configure keys", () => {
    for (const listen of ["0.0.0.0:7070", "[::]:7070", "10.1.2.3:7070"]) {
      const message = configError(["--listen", listen]);
      expect(message).toMatch(/refusing to listen on .* without authentication keys/);
      expect(message).toMatch(/LEASEHOLD_JWT_SECRET/);
      expect(message).toMatch(/--jwks-file/);
    }
  });

  it("`leasehold serve` exits with status 2 and the explanation", async () => {
    const error = await spawnServer(["--listen", "0.0.0.0:0"]).catch((e: Error) => e);
    expect(String(error)).toMatch(/server exited with 2/);
    expect(String(error)).toMatch(/refusing to listen on 0\.0\.0\.0 without authentication keys/);
  });

  it("on loopback without keys, calls need no token and a warning is logged", async () => {
    const lines: string[] = [];
    const server = await startServer(
      [],
      {},
      createLogger({ destination: { write: (l: string) => void lines.push(l) } }),
    );
    try {
      const got = await grpcClient(server.url).get({ key: freshKey() });
      expect(got.held).toBe(false);
      const warning = lines.map((l) => JSON.parse(l)).find((l) => l.level === 40);
      expect(warning?.msg).toMatch(/development mode/);
    } finally {
      await server.close();
    }
  });

  it("with keys, the server listens beyond loopback and requires tokens", async () => {
    const keys = await createTestKeys();
    const server = await startServer([...keys.args, "--listen", "0.0.0.0:0"]);
    try {
      const url = `http://127.0.0.1:${server.port}`;
      const error = await failure(grpcClient(url).get({ key: freshKey() }));
      expect(error.code).toBe(Code.Unauthenticated);
      const ok = await grpcClient(url).get({ key: freshKey() }, bearer(await keys.token("acct")));
      expect(ok.held).toBe(false);
    } finally {
      await server.close();
    }
  });
});

describe("key settings", () => {
  it("rejects a short secret, two key sources, and a missing file, naming the setting", async () => {
    expect(configError([], { LEASEHOLD_JWT_SECRET: "short" })).toMatch(/at least 32 bytes, got 5/);
    const secretFile = path.join(dir, "secret");
    await writeFile(secretFile, "x".repeat(40));
    expect(
      configError(["--jwt-secret-file", secretFile], { LEASEHOLD_JWT_SECRET: "y".repeat(40) }),
    ).toMatch(/set only one of/);
    expect(configError(["--jwks-file", path.join(dir, "missing.json")])).toMatch(
      /--jwks-file \(LEASEHOLD_JWKS_FILE\): cannot read/,
    );
    await writeFile(path.join(dir, "bad.json"), "{");
    expect(configError(["--jwks-file", path.join(dir, "bad.json")])).toMatch(
      /is not a JSON Web Key Set/,
    );
    // The secret is read from the environment only: no flag shows it in `ps`.
    expect(() => parseServerConfig(["--jwt-secret", "z".repeat(40)], {})).toThrow(/Unknown option/);
  });

  it("rejects half a TLS pair, a short tombstone horizon and a bad integer", () => {
    expect(configError(["--tls-cert", "cert.pem"])).toMatch(/needs both --tls-cert/);
    expect(configError(["--tombstone-horizon", "30s"])).toMatch(
      /--tombstone-horizon .* at least 1m and 10 times --statement-timeout/,
    );
    expect(configError(["--max-leases-per-account=-1"])).toMatch(
      /--max-leases-per-account .* must be an integer from 0/,
    );
    expect(configError(["--session-authorizer", "ldap"])).toMatch(/own-account or acl-table/);
  });

  it("the request bounds of both servers: --read-timeout at least 100ms (default 10s), --max-streams-per-connection from 1 (default 100)", () => {
    const guarded = (argv: string[]) =>
      parseGuardedConfig(["--lease-url", "http://127.0.0.1:7070", ...argv], {});
    for (const parse of [(argv: string[]) => parseServerConfig(argv, {}), guarded]) {
      expect(parse([])).toMatchObject({ readTimeoutMs: 10_000, maxStreamsPerConnection: 100 });
      expect(parse(["--read-timeout", "2s", "--max-streams-per-connection", "8"])).toMatchObject({
        readTimeoutMs: 2_000,
        maxStreamsPerConnection: 8,
      });
      expect(() => parse(["--read-timeout", "50ms"])).toThrow(
        /--read-timeout \(LEASEHOLD_READ_TIMEOUT\) must be at least 100ms/,
      );
      expect(() => parse(["--max-streams-per-connection", "0"])).toThrow(
        /--max-streams-per-connection \(LEASEHOLD_MAX_STREAMS_PER_CONNECTION\) must be an integer from 1 to 100000, got "0"/,
      );
    }
  });
});

describe("tokens without exp", () => {
  it("`leasehold serve` refuses a token without exp (UNAUTHENTICATED, cause claims); --allow-tokens-without-exp on accepts it", async () => {
    const keys = await createTestKeys();
    const token = await keys.token("acct", { expiresIn: null });
    const key = { accountId: "acct", sessionId: "no-exp" };
    const strict = await startServer(keys.args);
    const lenient = await startServer([...keys.args, "--allow-tokens-without-exp", "on"]);
    try {
      const error = await failure(grpcClient(strict.url).get({ key }, bearer(token)));
      expect(error.code).toBe(Code.Unauthenticated);
      expect(error.rawMessage).toMatch(/no "exp" claim/);
      expect(error.findDetails(ErrorInfoSchema)[0]?.metadata).toMatchObject({ cause: "claims" });
      expect((await grpcClient(lenient.url).get({ key }, bearer(token))).held).toBe(false);
    } finally {
      await Promise.all([strict.close(), lenient.close()]);
    }
  });

  it("the setting is on or off, from the flag or LEASEHOLD_ALLOW_TOKENS_WITHOUT_EXP", () => {
    expect(parseServerConfig([], {}).ops.auth.allowTokensWithoutExp).toBe(false);
    expect(
      parseServerConfig([], { LEASEHOLD_ALLOW_TOKENS_WITHOUT_EXP: "on" }).ops.auth
        .allowTokensWithoutExp,
    ).toBe(true);
    expect(configError(["--allow-tokens-without-exp", "yes"])).toMatch(
      /--allow-tokens-without-exp \(LEASEHOLD_ALLOW_TOKENS_WITHOUT_EXP\) must be on or off, got "yes"/,
    );
  });
});

describe("JWKS keys, issuer, audience and a custom account claim", () => {
  let server: RunningServer;
  type PrivateKey = Awaited<ReturnType<typeof generateKeyPair>>["privateKey"];
  const signers: { alg: string; key: PrivateKey; kid: string }[] = [];

  beforeAll(async () => {
    const keys = [];
    for (const [alg, kid] of [
      ["ES256", "ec-1"],
      ["RS256", "rsa-1"],
    ] as const) {
      const pair = await generateKeyPair(alg, { extractable: true });
      keys.push({ ...(await exportJWK(pair.publicKey)), kid, alg, use: "sig" });
      signers.push({ alg, key: pair.privateKey, kid });
    }
    const jwksFile = path.join(dir, "jwks.json");
    await writeFile(jwksFile, JSON.stringify({ keys }));
    server = await startServer([
      "--jwks-file",
      jwksFile,
      "--jwt-issuer",
      "https://issuer.example",
      "--jwt-audience",
      "leasehold,other",
      "--account-claim",
      "org",
    ]);
  });

  const sign = (
    signer: { alg: string; key: PrivateKey; kid: string },
    claims: Record<string, unknown>,
    issuer = "https://issuer.example",
    audience = "leasehold",
  ) =>
    new SignJWT(claims)
      .setProtectedHeader({ alg: signer.alg, kid: signer.kid })
      .setIssuer(issuer)
      .setAudience(audience)
      .setSubject("user-1")
      .setExpirationTime("5m")
      .sign(signer.key);

  it("ES256 and RS256 tokens are accepted; the account comes from the configured claim", async () => {
    const client = grpcClient(server.url);
    for (const signer of signers) {
      const token = await sign(signer, { org: "acme" });
      const key = { accountId: "acme", sessionId: `jwks-${signer.alg}` };
      const a = await client.acquire({ key, ttl: seconds(30) }, bearer(token));
      expect(a.acquired).toBe(true);
      // `sub` is user-1, but the account is the `org` claim.
      const denied = await failure(
        client.get({ key: { accountId: "user-1", sessionId: "s" } }, bearer(token)),
      );
      expect(denied.code).toBe(Code.PermissionDenied);
    }
  });

  it("a wrong issuer or audience, a missing account claim, or an HS256 token is UNAUTHENTICATED", async () => {
    const client = grpcClient(server.url);
    const [es] = signers;
    if (!es) throw new Error("no signer");
    const key = { accountId: "acme", sessionId: "s" };
    const cases: [string, RegExp][] = [
      [await sign(es, { org: "acme" }, "https://evil.example"), /token not accepted: .*"iss"/],
      [await sign(es, { org: "acme" }, undefined, "someone-else"), /token not accepted: .*"aud"/],
      [await sign(es, {}), /token claim "org" must name an account/],
      [
        await new SignJWT({ org: "acme" })
          .setProtectedHeader({ alg: "HS256" })
          .sign(new TextEncoder().encode("k".repeat(40))),
        /token algorithm is not accepted/,
      ],
    ];
    for (const [token, reason] of cases) {
      const error = await failure(client.get({ key }, bearer(token)));
      expect(error.code).toBe(Code.Unauthenticated);
      expect(error.rawMessage).toMatch(reason);
    }
  });
});

describe("TLS", () => {
  const fixtures = fileURLToPath(new URL("./fixtures/tls/", import.meta.url));
  let server: RunningServer;
  let ca: string;

  beforeAll(async () => {
    ca = await readFile(path.join(fixtures, "cert.pem"), "utf8");
    server = await startServer([
      "--tls-cert",
      path.join(fixtures, "cert.pem"),
      "--tls-key",
      path.join(fixtures, "key.pem"),
    ]);
  });

  it("serves gRPC over h2 and Connect over HTTP/1.1 on one TLS port", async () => {
    expect(server.url).toMatch(/^https:\/\/127\.0\.0\.1:\d+$/);
    const grpc = createClient(
      LeaseService,
      createGrpcTransport({ baseUrl: server.url, nodeOptions: { ca } }),
    );
    const key = freshKey("tls");
    const a = await grpc.acquire({ key, ttl: seconds(30) });
    expect(a.acquired).toBe(true);
    const h1 = createClient(
      LeaseService,
      createConnectTransport({ baseUrl: server.url, httpVersion: "1.1", nodeOptions: { ca } }),
    );
    expect((await h1.get({ key })).lease?.runId).toBe(a.lease?.runId);
  });

  it("refuses cleartext and clients that do not trust the certificate", async () => {
    const plain = grpcClient(`http://127.0.0.1:${server.port}`);
    // failure() throws if the call succeeds.
    await failure(plain.get({ key: freshKey() }));
    const untrusting = createClient(LeaseService, createGrpcTransport({ baseUrl: server.url }));
    const untrusted = await failure(untrusting.get({ key: freshKey() }));
    expect(untrusted.rawMessage).toMatch(/self[- ]signed|certificate/i);
  });
});
