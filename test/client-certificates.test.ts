// Mutual TLS (DESIGN §7, docs/security.md "Client certificates"): a client
// certificate verified against --tls-client-ca and mapped by --identity-map
// to an account and scopes authenticates a call on every path (Connect over
// HTTP/1.1 and HTTP/2, gRPC-Web, native gRPC, connect-node's gRPC); a
// certificate from another CA, expired, not yet valid or not for client
// authentication is refused with UNAUTHENTICATED naming why; an unmapped one
// with PERMISSION_DENIED; a token for another account beside it with
// UNAUTHENTICATED identity_conflict. The certificates are made at test time
// with openssl (test/support/certificates.ts).

import { readFileSync, renameSync, writeFileSync } from "node:fs";
import path from "node:path";
import { Code, type ConnectError, createClient, type Transport } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { parseIdentityMap } from "../src/auth/identity-map.js";
import { clientTlsOptions, createLeaseClient } from "../src/client/index.js";
import { ConfigError } from "../src/config/settings.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";
import { createTlsCredentials } from "../src/host/tls-credentials.js";
import { createLogger } from "../src/log/logger.js";
import { parseServerConfig } from "../src/server/config/server-config.js";
import type { RunningServer } from "../src/server/server.js";
import { failure, seconds } from "./support/calls.js";
import { type CertFiles, CertificateFolder, type TestCa } from "./support/certificates.js";
import { startCli } from "./support/cli.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { createTestKeys, type TestKeys } from "./support/tokens.js";
import { waitFor } from "./support/wait.js";

const { db, startServer, startGuardedServer } = useTestDatabase();

const spiffe = (workload: string) => `spiffe://test.example/ns/acme/sa/${workload}`;

let certs: CertificateFolder;
let ca: TestCa;
let otherCa: TestCa;
let serverCert: CertFiles;
let worker: CertFiles;
let admin: CertFiles;
let unmapped: CertFiles;
let byCn: CertFiles;
let keys: TestKeys;
let identityMap: string;

beforeAll(async () => {
  // Here, not in one describe's beforeAll: the optional-mode tests use them too.
  keys = await createTestKeys();
  certs = new CertificateFolder();
  ca = certs.ca("client-ca");
  otherCa = certs.ca("other-ca");
  serverCert = certs.leaf(ca, {
    name: "server",
    commonName: "127.0.0.1",
    ips: ["127.0.0.1"],
    usage: "server",
  });
  worker = certs.leaf(ca, { name: "worker", spiffeIds: [spiffe("worker")] });
  admin = certs.leaf(ca, { name: "admin", spiffeIds: [spiffe("ops")] });
  unmapped = certs.leaf(ca, { name: "stranger", spiffeIds: ["spiffe://elsewhere.example/x"] });
  byCn = certs.leaf(ca, { name: "billing", commonName: "billing-worker" });
  identityMap = path.join(certs.dir, "identities.yaml");
  writeFileSync(
    identityMap,
    [
      "identities:",
      `  - spiffe_id: ${spiffe("ops")}`,
      "    account: acme",
      "    scopes: [leasehold:admin]",
      "  - spiffe_id_prefix: spiffe://test.example/ns/acme/",
      "    account: acme",
      "  - subject_cn: billing-worker",
      "    account: billing",
      "",
    ].join("\n"),
  );
});
afterAll(() => certs?.remove());

function serverArgs(mode: "require" | "optional", extra: string[] = []): string[] {
  return [
    "--tls-cert",
    serverCert.certFile,
    "--tls-key",
    serverCert.keyFile,
    "--tls-client-ca",
    ca.certFile,
    "--identity-map",
    identityMap,
    "--tls-client-auth",
    mode,
    ...extra,
  ];
}

type Kind = "connect-h1" | "connect-h2" | "grpc-web" | "grpc";

function transport(kind: Kind, baseUrl: string, client?: CertFiles, token?: string): Transport {
  const nodeOptions = {
    ca: readFileSync(ca.certFile),
    ...(client && { cert: readFileSync(client.certFile), key: readFileSync(client.keyFile) }),
  };
  const interceptors = token
    ? [
        (next: Parameters<import("@connectrpc/connect").Interceptor>[0]) =>
          (req: Parameters<typeof next>[0]) => {
            req.header.set("authorization", `Bearer ${token}`);
            return next(req);
          },
      ]
    : [];
  switch (kind) {
    case "connect-h1":
      return createConnectTransport({ baseUrl, httpVersion: "1.1", nodeOptions, interceptors });
    case "connect-h2":
      return createConnectTransport({ baseUrl, httpVersion: "2", nodeOptions, interceptors });
    case "grpc-web":
      return createGrpcWebTransport({ baseUrl, httpVersion: "2", nodeOptions, interceptors });
    case "grpc":
      return createGrpcTransport({ baseUrl, nodeOptions, interceptors });
  }
}

function causeOf(error: ConnectError): string | undefined {
  return error.findDetails(ErrorInfoSchema)[0]?.metadata.cause;
}

describe("client certificates required", () => {
  let server: RunningServer;
  let connectGrpc: RunningServer;

  beforeAll(async () => {
    server = await startServer(serverArgs("require", keys.args));
    connectGrpc = await startServer(
      serverArgs("require", [...keys.args, "--grpc-path", "connect"]),
    );
  });

  const paths: [string, Kind, () => RunningServer][] = [
    ["Connect over HTTP/1.1", "connect-h1", () => server],
    ["Connect over HTTP/2", "connect-h2", () => server],
    ["gRPC-Web", "grpc-web", () => server],
    ["native gRPC", "grpc", () => server],
    ["connect-node's gRPC", "grpc", () => connectGrpc],
  ];

  for (const [name, kind, target] of paths) {
    it(`${name}: a mapped SPIFFE ID acts for its account, and only for it`, async () => {
      const c = createClient(LeaseService, transport(kind, target().url, worker));
      const key = { accountId: "acme", sessionId: freshKey().sessionId };
      const a = await c.acquire({ key, ttl: seconds(30), holder: "mtls" });
      expect(a.acquired).toBe(true);
      expect((await c.get({ key })).lease?.runId).toBe(a.lease?.runId);
      const other = await failure(c.get({ key: { accountId: "billing", sessionId: "s" } }));
      expect(other.code).toBe(Code.PermissionDenied);
      expect(other.rawMessage).toMatch(/not the account of the caller/);
    });

    it(`${name}: no certificate, another CA's, expired, not yet valid, or a server-only one is refused naming why`, async () => {
      const key = { accountId: "acme", sessionId: "refused" };
      const none = await failure(
        createClient(LeaseService, transport(kind, target().url)).get({ key }),
      );
      expect(none.code).toBe(Code.Unauthenticated);
      expect(causeOf(none)).toBe("certificate_missing");
      const cases: [CertFiles, string, RegExp][] = [
        [
          certs.leaf(otherCa, {
            name: `foreign-${kind}-${name.length}`,
            spiffeIds: [spiffe("worker")],
          }),
          "certificate_untrusted",
          /client certificate refused: it is not issued by a CA of the server's client CA bundle/,
        ],
        [
          certs.leaf(ca, {
            name: `expired-${kind}-${name.length}`,
            spiffeIds: [spiffe("worker")],
            validDays: [-10, -1],
          }),
          "certificate_expired",
          /client certificate refused: it has expired \(CERT_HAS_EXPIRED\)/,
        ],
        [
          certs.leaf(ca, {
            name: `future-${kind}-${name.length}`,
            spiffeIds: [spiffe("worker")],
            validDays: [2, 10],
          }),
          "certificate_not_yet_valid",
          /client certificate refused: it is not valid yet \(CERT_NOT_YET_VALID\)/,
        ],
        [
          certs.leaf(ca, {
            name: `server-only-${kind}-${name.length}`,
            spiffeIds: [spiffe("worker")],
            usage: "server",
          }),
          "certificate_usage",
          /client certificate refused: it is not for TLS client authentication/,
        ],
      ];
      for (const [cert, cause, message] of cases) {
        const refused = await failure(
          createClient(LeaseService, transport(kind, target().url, cert)).get({ key }),
        );
        expect(refused.code, cause).toBe(Code.Unauthenticated);
        expect(causeOf(refused)).toBe(cause);
        expect(refused.rawMessage).toMatch(message);
      }
    });

    it(`${name}: a genuine certificate the identity map does not name is PERMISSION_DENIED`, async () => {
      const c = createClient(LeaseService, transport(kind, target().url, unmapped));
      const refused = await failure(c.get({ key: { accountId: "acme", sessionId: "x" } }));
      expect(refused.code).toBe(Code.PermissionDenied);
      expect(refused.rawMessage).toMatch(
        /the client certificate \(SPIFFE ID spiffe:\/\/elsewhere\.example\/x\) is not in the server's identity map/,
      );
    });
  }

  it("a subject CN maps to its account; a mapped identity's scopes open Revoke, another's do not", async () => {
    const billing = createClient(LeaseService, transport("grpc", server.url, byCn));
    const key = { accountId: "billing", sessionId: freshKey().sessionId };
    expect((await billing.acquire({ key, ttl: seconds(30) })).acquired).toBe(true);
    const notAdmin = await failure(
      createClient(LeaseService, transport("grpc", server.url, worker)).revoke({
        key: { accountId: "acme", sessionId: "s" },
        reason: "test",
      }),
    );
    expect(notAdmin.code).toBe(Code.PermissionDenied);
    const acmeKey = { accountId: "acme", sessionId: freshKey().sessionId };
    const acme = createClient(LeaseService, transport("grpc", server.url, worker));
    expect((await acme.acquire({ key: acmeKey, ttl: seconds(30) })).acquired).toBe(true);
    const ops = createClient(LeaseService, transport("grpc", server.url, admin));
    expect((await ops.revoke({ key: acmeKey, reason: "test" })).revoked).toBe(true);
  });

  it("a bearer token for another account beside the certificate is refused; one for the same account passes", async () => {
    const key = { accountId: "acme", sessionId: freshKey().sessionId };
    const conflicting = createClient(
      LeaseService,
      transport("grpc", server.url, worker, await keys.token("billing")),
    );
    const refused = await failure(conflicting.get({ key }));
    expect(refused.code).toBe(Code.Unauthenticated);
    expect(causeOf(refused)).toBe("identity_conflict");
    const agreeing = createClient(
      LeaseService,
      transport("connect-h1", server.url, worker, await keys.token("acme")),
    );
    expect((await agreeing.get({ key })).held).toBe(false);
  });

  it("refused certificates are counted in /metrics by reason", async () => {
    const key = { accountId: "acme", sessionId: "counted" };
    await failure(createClient(LeaseService, transport("grpc", server.url, unmapped)).get({ key }));
    await failure(createClient(LeaseService, transport("grpc", server.url)).get({ key }));
    const metrics = await metricsText(server);
    expect(metrics).toMatch(
      /leasehold_client_certificates_refused_total\{reason="unmapped"\} [1-9]/,
    );
    expect(metrics).toMatch(
      /leasehold_client_certificates_refused_total\{reason="certificate_missing"\} [1-9]/,
    );
  });

  it("the library client holds a lease with a certificate only, renewed on its KeepAlive stream past its TTL", async () => {
    const client = createLeaseClient({
      baseUrl: server.url,
      protocol: "grpc",
      tls: { caFile: ca.certFile, certFile: worker.certFile, keyFile: worker.keyFile },
    });
    try {
      const key = { accountId: "acme", sessionId: freshKey().sessionId };
      const seen = await client.runExclusive(
        key,
        async (ctx) => {
          // Past the first TTL on the database clock: only a renewal keeps it.
          await db.sql`
            SELECT pg_sleep_until(acquired_at + ttl + interval '50 milliseconds')
            FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
          return {
            aborted: ctx.signal.aborted,
            held: (await client.get({ key })).lease?.runId === ctx.runId,
          };
        },
        { ttlMs: 600 },
      );
      expect(seen).toEqual({ aborted: false, held: true });
    } finally {
      client.close();
    }
  });
});

async function metricsText(server: RunningServer): Promise<string> {
  const https = await import("node:https");
  return new Promise((resolve, reject) => {
    const req = https.get(
      `${server.url}/metrics`,
      {
        ca: readFileSync(ca.certFile),
        cert: readFileSync(worker.certFile),
        key: readFileSync(worker.keyFile),
      },
      (res) => {
        let body = "";
        res.setEncoding("utf8");
        res.on("data", (chunk: string) => {
          body += chunk;
        });
        res.on("end", () => resolve(body));
      },
    );
    req.on("error", reject);
  });
}

describe("client certificates optional", () => {
  let server: RunningServer;

  beforeAll(async () => {
    server = await startServer(serverArgs("optional", keys.args));
  });

  it("a call without a certificate is authenticated by its token; with a certificate, as under require", async () => {
    const key = { accountId: "acme", sessionId: freshKey().sessionId };
    const byToken = createClient(
      LeaseService,
      transport("grpc", server.url, undefined, await keys.token("acme")),
    );
    expect((await byToken.acquire({ key, ttl: seconds(30) })).acquired).toBe(true);
    const nothing = await failure(
      createClient(LeaseService, transport("grpc", server.url)).get({ key }),
    );
    expect(nothing.code).toBe(Code.Unauthenticated);
    expect(causeOf(nothing)).toBe("missing");
    const byCert = createClient(LeaseService, transport("connect-h1", server.url, worker));
    expect((await byCert.get({ key })).held).toBe(true);
    const expired = certs.leaf(ca, {
      name: "optional-expired",
      spiffeIds: [spiffe("worker")],
      validDays: [-5, -1],
    });
    const refused = await failure(
      createClient(LeaseService, transport("grpc", server.url, expired)).get({ key }),
    );
    expect(causeOf(refused)).toBe("certificate_expired");
  });
});

describe("client certificates optional, no token keys", () => {
  it("a call with neither a certificate nor a token is certificate_missing; one with a token is told no token is verified here", async () => {
    const server = await startServer(serverArgs("optional"));
    const key = { accountId: "acme", sessionId: "nothing" };
    const nothing = await failure(
      createClient(LeaseService, transport("grpc", server.url)).get({ key }),
    );
    expect(nothing.code).toBe(Code.Unauthenticated);
    expect(causeOf(nothing)).toBe("certificate_missing");
    expect(nothing.rawMessage).toMatch(/a client certificate is required/);
    const byToken = await failure(
      createClient(LeaseService, transport("grpc", server.url, undefined, "a.b.c")).get({ key }),
    );
    expect(causeOf(byToken)).toBe("malformed");
    expect(byToken.rawMessage).toMatch(/this server verifies no bearer tokens/);
    const byCert = createClient(LeaseService, transport("grpc", server.url, worker));
    expect((await byCert.get({ key })).held).toBe(false);
  });
});

describe("the guarded store", () => {
  it("authenticates its callers by certificate, with the same map and the same account rule", async () => {
    const lease = await startServer([]);
    const store = await startGuardedServer(["--lease-url", lease.url, ...serverArgs("require")]);
    const { GuardedStoreService } = await import("../src/gen/leasehold/guarded/v1/guarded_pb.js");
    const c = createClient(GuardedStoreService, transport("connect-h1", store.url, worker));
    const none = await failure(
      createClient(GuardedStoreService, transport("connect-h1", store.url)).get({
        key: { accountId: "acme", sessionId: "s" },
        name: "doc",
      }),
    );
    expect(none.code).toBe(Code.Unauthenticated);
    expect(causeOf(none)).toBe("certificate_missing");
    const other = await failure(
      c.get({ key: { accountId: "billing", sessionId: "s" }, name: "doc" }),
    );
    expect(other.code).toBe(Code.PermissionDenied);
    const own = await failure(c.get({ key: { accountId: "acme", sessionId: "s" }, name: "doc" }));
    expect(own.code).toBe(Code.NotFound);
  });
});

describe("the guarded store behind a lease server that requires certificates", () => {
  it("confirms a raising write with CheckFence over its own client certificate (--lease-ca, --lease-cert, --lease-key)", async () => {
    const lease = await startServer(serverArgs("require"));
    const storeCert = certs.leaf(ca, { name: "store", spiffeIds: [spiffe("store")] });
    const store = await startGuardedServer([
      "--lease-url",
      lease.url,
      "--lease-ca",
      ca.certFile,
      "--lease-cert",
      storeCert.certFile,
      "--lease-key",
      storeCert.keyFile,
      ...serverArgs("require"),
    ]);
    const { GuardedStoreService } = await import("../src/gen/leasehold/guarded/v1/guarded_pb.js");
    const key = { accountId: "acme", sessionId: freshKey().sessionId };
    const grant = await createClient(LeaseService, transport("grpc", lease.url, worker)).acquire({
      key,
      ttl: seconds(30),
    });
    const documents = createClient(GuardedStoreService, transport("connect-h2", store.url, worker));
    // The first write raises the session's fence: only the lease server's
    // CheckFence, reached with the store's certificate, can confirm it.
    const put = await documents.put({
      key,
      name: "doc",
      value: new TextEncoder().encode("v1"),
      fencingToken: grant.lease?.fencingToken ?? 0n,
    });
    expect(put.highestToken).toBe(grant.lease?.fencingToken);
  });
});

/**
 * A server on copies of the TLS files (`prefix`-named, so a test may rewrite
 * them), and a count of its log lines by how they start.
 */
async function serverOnLiveFiles(prefix: string) {
  const files = {
    cert: path.join(certs.dir, `${prefix}-server.pem`),
    key: path.join(certs.dir, `${prefix}-server-key.pem`),
    ca: path.join(certs.dir, `${prefix}-ca.pem`),
    map: path.join(certs.dir, `${prefix}-identities.yaml`),
  };
  writeFileSync(files.cert, readFileSync(serverCert.certFile));
  writeFileSync(files.key, readFileSync(serverCert.keyFile));
  writeFileSync(files.ca, readFileSync(ca.certFile));
  writeFileSync(files.map, readFileSync(identityMap));
  const lines: { msg?: string }[] = [];
  const logger = createLogger({
    level: "info",
    destination: { write: (l: string) => void lines.push(JSON.parse(l) as { msg?: string }) },
  });
  const server = await startServer(
    [
      "--tls-cert",
      files.cert,
      "--tls-key",
      files.key,
      "--tls-client-ca",
      files.ca,
      "--identity-map",
      files.map,
    ],
    {},
    logger,
  );
  const logged = (start: string) => lines.filter((l) => l.msg?.startsWith(start)).length;
  return { files, server, logged };
}

describe("rotation", () => {
  it("new certificate, key, CA bundle and identity map are taken without a restart, losing no call and no lease", async () => {
    const { files, server, logged } = await serverOnLiveFiles("live");
    const reloaded = () => logged("TLS files reloaded");
    // Replaced by rename, as rotation tools do: never a half-written file.
    const install = (file: string, content: string | Buffer) => {
      writeFileSync(`${file}.tmp`, content);
      renameSync(`${file}.tmp`, file);
    };
    // The next CA: its own server certificate, and a client of it.
    const nextCa = certs.ca("next-ca");
    const nextServer = certs.leaf(nextCa, {
      name: "next-server",
      commonName: "127.0.0.1",
      ips: ["127.0.0.1"],
      usage: "server",
    });
    const nextClient = certs.leaf(nextCa, { name: "next-client", commonName: "rotated-only" });
    const client = createLeaseClient({
      baseUrl: server.url,
      protocol: "grpc",
      // Both CAs for the server's certificate: the client's own trust rotates first.
      tls: { caFile: files.ca, certFile: worker.certFile, keyFile: worker.keyFile },
    });
    const key = { accountId: "acme", sessionId: freshKey().sessionId };
    let cycles = 0;
    const failures: unknown[] = [];
    const stop = new AbortController();
    try {
      const token = await client.runExclusive(
        key,
        async (ctx) => {
          // Load through the rotation: acquire→release cycles beside the held lease.
          const load = (async () => {
            while (!stop.signal.aborted) {
              const k = { accountId: "acme", sessionId: freshKey().sessionId };
              try {
                const a = await client.acquire({ key: k, ttl: seconds(30) });
                if (a.lease) await client.release({ key: k, runId: a.lease.runId });
                cycles += 1;
              } catch (error) {
                failures.push(error);
              }
            }
          })();
          // Installed without yielding: no reload runs between two of them.
          install(
            files.ca,
            Buffer.concat([readFileSync(ca.certFile), readFileSync(nextCa.certFile)]),
          );
          install(
            files.map,
            `${readFileSync(identityMap, "utf8")}  - subject_cn: rotated-only\n    account: rotated\n`,
          );
          install(files.key, readFileSync(nextServer.keyFile));
          install(files.cert, readFileSync(nextServer.certFile));
          // Every file is in place: the next reload the server logs takes them all.
          const installed = reloaded();
          await waitFor(() => reloaded() > installed, {
            what: "the server to log that it reloaded its TLS files",
          });
          // A client of the new CA that trusts only the new CA: the server's
          // new certificate, its new CA bundle and the new map entry at once.
          const rotated = createClient(
            LeaseService,
            createGrpcTransport({
              baseUrl: server.url,
              nodeOptions: {
                ca: readFileSync(nextCa.certFile),
                cert: readFileSync(nextClient.certFile),
                key: readFileSync(nextClient.keyFile),
              },
            }),
          );
          const rotatedKey = { accountId: "rotated", sessionId: freshKey().sessionId };
          expect((await rotated.acquire({ key: rotatedKey, ttl: seconds(30) })).acquired).toBe(
            true,
          );
          // Past the held lease's first TTL: the rotation cost it nothing.
          await db.sql`
            SELECT pg_sleep_until(acquired_at + ttl + interval '50 milliseconds')
            FROM leases WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}`;
          stop.abort();
          await load;
          expect(ctx.signal.aborted).toBe(false);
          return ctx.fencingToken;
        },
        { ttlMs: 2_000 },
      );
      expect(token).toBeGreaterThan(0n);
    } finally {
      stop.abort();
      client.close();
    }
    expect(cycles).toBeGreaterThan(0);
    expect(failures).toEqual([]);
  });
  it("a file rewritten between the start's read and the first check is still reloaded", async () => {
    const file = path.join(certs.dir, "early-ca.pem");
    writeFileSync(file, readFileSync(ca.certFile));
    const lines: { msg?: string }[] = [];
    const logger = createLogger({
      level: "info",
      destination: { write: (l: string) => void lines.push(JSON.parse(l) as { msg?: string }) },
    });
    const credentials = createTlsCredentials(
      {
        certFile: serverCert.certFile,
        keyFile: serverCert.keyFile,
        clients: { caFile: file, identityMapFile: identityMap, mode: "require" },
      },
      logger,
    );
    // Rewritten before anything looks at it: a change judged against the
    // previous check instead of the read would never be seen.
    writeFileSync(file, readFileSync(otherCa.certFile));
    const stop = credentials.watch();
    try {
      await waitFor(() => lines.some((l) => l.msg?.startsWith("TLS files reloaded")), {
        what: "the rewritten CA bundle to be reloaded",
      });
      expect(credentials.files().clientCa?.equals(readFileSync(file))).toBe(true);
    } finally {
      stop();
    }
  });
  it("a half-written or empty CA bundle is not taken: the previous bundle stays in force", async () => {
    const { files, server, logged: count } = await serverOnLiveFiles("half");
    const bundle = readFileSync(ca.certFile, "utf8");
    // Written in place, as a copy or an editor does: seen half-written, then
    // empty. Neither may replace the bundle that verifies every client.
    for (const partial of [bundle.slice(0, Math.floor(bundle.length / 2)), ""]) {
      const refused = count("TLS files not reloaded");
      const taken = count("TLS files reloaded");
      writeFileSync(files.ca, partial);
      await waitFor(
        () => count("TLS files not reloaded") > refused || count("TLS files reloaded") > taken,
        {
          what: "the server to look at the rewritten CA bundle",
        },
      );
      expect(count("TLS files reloaded")).toBe(taken);
      // A new connection with a certificate of the CA still in force.
      const c = createClient(LeaseService, transport("grpc", server.url, worker));
      const key = { accountId: "acme", sessionId: freshKey().sessionId };
      expect((await c.acquire({ key, ttl: seconds(30) })).acquired).toBe(true);
    }
  });
});

describe("client certificate rotation in the TypeScript client", () => {
  it("a new certificate beside the old key is not used until its key arrives: connections made meanwhile keep the previous pair", async () => {
    const server = await startServer(serverArgs("require"));
    const files = {
      cert: path.join(certs.dir, "client-live.pem"),
      key: path.join(certs.dir, "client-live-key.pem"),
    };
    writeFileSync(files.cert, readFileSync(worker.certFile));
    writeFileSync(files.key, readFileSync(worker.keyFile));
    const nodeOptions = clientTlsOptions({
      caFile: ca.certFile,
      certFile: files.cert,
      keyFile: files.key,
    });
    // Each transport opens its own connection, reading the files as it does.
    const get = (accountId: string) =>
      createClient(LeaseService, createGrpcTransport({ baseUrl: server.url, nodeOptions })).get({
        key: { accountId, sessionId: "rotating" },
      });
    expect((await get("acme")).held).toBe(false);
    // A rotation tool writes the certificate, then the key; the new
    // certificate acts for another account, so each call shows which pair
    // its connection presented.
    const next = certs.leaf(ca, { name: "worker-next", commonName: "billing-worker" });
    writeFileSync(files.cert, readFileSync(next.certFile));
    expect((await get("acme")).held).toBe(false);
    writeFileSync(files.key, readFileSync(next.keyFile));
    expect((await get("billing")).held).toBe(false);
    expect((await failure(get("acme"))).code).toBe(Code.PermissionDenied);
  });
});

describe("a client certificate that expires while its connection is open", () => {
  it("a client that has rotated its files keeps its lease and its calls past the old certificate's notAfter", async () => {
    const server = await startServer(serverArgs("require"));
    const files = {
      cert: path.join(certs.dir, "short-live.pem"),
      key: path.join(certs.dir, "short-live-key.pem"),
    };
    // Valid for a few seconds, as an SVID is for an hour.
    const short = certs.leaf(ca, {
      name: "short",
      spiffeIds: [spiffe("worker")],
      validDays: [-1, 6 / 86_400],
    });
    // An upper bound: openssl took its end date before it ran.
    const notAfter = Date.now() + 6_000;
    writeFileSync(files.cert, readFileSync(short.certFile));
    writeFileSync(files.key, readFileSync(short.keyFile));
    const client = createLeaseClient({
      baseUrl: server.url,
      protocol: "grpc",
      tls: { caFile: ca.certFile, certFile: files.cert, keyFile: files.key },
    });
    try {
      const key = { accountId: "acme", sessionId: freshKey().sessionId };
      const seen = await client.runExclusive(
        key,
        async (ctx) => {
          expect((await client.get({ key })).lease?.runId).toBe(ctx.runId);
          // The rotation tool writes the next certificate well before the
          // old one expires; the open connection keeps the old one.
          const next = certs.leaf(ca, { name: "short-next", spiffeIds: [spiffe("worker")] });
          writeFileSync(files.key, readFileSync(next.keyFile));
          writeFileSync(files.cert, readFileSync(next.certFile));
          // Past the old certificate's notAfter, and past a TTL after it.
          await new Promise((resolve) => setTimeout(resolve, notAfter - Date.now() + 2_500));
          return {
            aborted: ctx.signal.aborted,
            reason: String((ctx.signal.reason as Error | undefined)?.message),
            held: (await client.get({ key })).lease?.runId === ctx.runId,
          };
        },
        { ttlMs: 2_000 },
      );
      expect(seen).toEqual({ aborted: false, reason: "undefined", held: true });
    } finally {
      client.close();
    }
  });
});

describe("the CLI", () => {
  it("--ca, --cert and --key hold a lease with a certificate only; without one the refusal names why", async () => {
    const server = await startServer(serverArgs("require"));
    const key = ["--account", "acme", "--session", freshKey().sessionId];
    const tls = ["--ca", ca.certFile, "--cert", worker.certFile, "--key", worker.keyFile];
    const acquired = await startCli([
      "acquire",
      "--server",
      server.url,
      ...tls,
      ...key,
      "--ttl",
      "30s",
    ]).exited;
    expect(acquired.stderr).toBe("");
    expect(acquired.code).toBe(0);
    const held = await startCli([
      "get",
      "--server",
      server.url,
      "--protocol",
      "grpc",
      ...tls,
      ...key,
      "--json",
    ]).exited;
    expect(held.code).toBe(0);
    expect(JSON.parse(held.stdout)).toMatchObject({ held: true });
    const refused = await startCli(["get", "--server", server.url, "--ca", ca.certFile, ...key])
      .exited;
    expect(refused.code).toBe(1);
    expect(refused.stderr).toMatch(/a client certificate is required/);
    const halfway = await startCli([
      "get",
      "--server",
      server.url,
      "--cert",
      worker.certFile,
      ...key,
    ]).exited;
    expect(halfway.code).toBe(2);
    expect(halfway.stderr).toMatch(/--cert and --key go together/);
  });
});

describe("configuration", () => {
  const base = () => ["--tls-cert", serverCert.certFile, "--tls-key", serverCert.keyFile];
  const configError = (argv: string[]): string => {
    try {
      parseServerConfig(argv, {});
    } catch (error) {
      expect(error).toBeInstanceOf(ConfigError);
      return (error as Error).message;
    }
    throw new Error("the configuration was accepted");
  };

  it("client certificates need TLS, a CA bundle and an identity map, and one of the two modes", () => {
    expect(configError(["--tls-client-ca", ca.certFile, "--identity-map", identityMap])).toMatch(
      /client certificates need TLS: set --tls-cert/,
    );
    expect(configError([...base(), "--tls-client-ca", ca.certFile])).toMatch(
      /--tls-client-ca needs --identity-map \(LEASEHOLD_IDENTITY_MAP\)/,
    );
    expect(configError([...base(), "--identity-map", identityMap])).toMatch(
      /--identity-map and --tls-client-auth need --tls-client-ca/,
    );
    expect(
      configError([
        ...base(),
        "--tls-client-ca",
        ca.certFile,
        "--identity-map",
        identityMap,
        "--tls-client-auth",
        "maybe",
      ]),
    ).toMatch(
      /--tls-client-auth \(LEASEHOLD_TLS_CLIENT_AUTH\) must be require or optional, got "maybe"/,
    );
    // Client certificates are authentication: such a server may listen beyond loopback.
    const config = parseServerConfig(
      [
        ...base(),
        "--tls-client-ca",
        ca.certFile,
        "--identity-map",
        identityMap,
        "--listen",
        "0.0.0.0:0",
      ],
      {},
    );
    expect(config.tls?.clients).toMatchObject({ mode: "require", identityMapFile: identityMap });
  });

  it("an identity map names the entry and the rule it breaks", () => {
    const bad: [string, RegExp][] = [
      ["identities: [", /is not YAML or JSON/],
      ["accounts: []", /must be a mapping with a list "identities"/],
      [
        "identities:\n  - account: acme",
        /identities\[0\] must have exactly one of spiffe_id, spiffe_id_prefix, subject_cn, dns_name/,
      ],
      [
        "identities:\n  - spiffe_id_prefix: spiffe://td/ns/acme\n    account: acme",
        /identities\[0\]\.spiffe_id_prefix must end with \/ \(a path segment boundary\)/,
      ],
      [
        // Ends with /, but names no trust domain: it would admit every
        // SPIFFE ID of every trust domain the CA bundle vouches for.
        "identities:\n  - spiffe_id_prefix: spiffe://\n    account: acme",
        /identities\[0\]\.spiffe_id_prefix must name a trust domain \(spiffe:\/\/trust-domain\/…\)/,
      ],
      [
        "identities:\n  - spiffe_id_prefix: spiffe:///ns/\n    account: acme",
        /identities\[0\]\.spiffe_id_prefix must name a trust domain/,
      ],
      [
        "identities:\n  - spiffe_id: https://td/x\n    account: acme",
        /identities\[0\]\.spiffe_id must start with spiffe:\/\//,
      ],
      [
        "identities:\n  - subject_cn: a\n    account: 'no spaces'",
        /identities\[0\]\.account must name an account/,
      ],
      [
        "identities:\n  - subject_cn: a\n    account: acme\n    scope: x",
        /identities\[0\]\.scope is not a field/,
      ],
      [
        "identities:\n  - subject_cn: a\n    account: acme\n    scopes: [a b]",
        /identities\[0\]\.scopes must be a list of scope names/,
      ],
    ];
    for (const [text, rule] of bad) {
      expect(() => parseIdentityMap(text, "ids.yaml", 128), text).toThrow(rule);
    }
  });

  it("the first matching entry decides; a prefix matches at a segment boundary only", () => {
    const map = parseIdentityMap(
      [
        "identities:",
        "  - spiffe_id_prefix: spiffe://td/ns/acme/",
        "    account: acme",
        "  - spiffe_id: spiffe://td/ns/acme/sa/ops",
        "    account: never-reached",
        "  - dns_name: worker.example",
        "    account: dns",
        "    scopes: [s1]",
      ].join("\n"),
      "ids.yaml",
      128,
    );
    const cert = (spiffeId: string | undefined, dnsNames: string[] = []) => ({
      verified: true as const,
      spiffeId,
      commonName: undefined,
      dnsNames,
      validUntilMs: Date.now() + 60_000,
      fingerprint: "00",
    });
    expect(map.identityOf(cert("spiffe://td/ns/acme/sa/ops"))).toMatchObject({
      account: "acme",
      subject: "spiffe://td/ns/acme/sa/ops",
    });
    expect(map.identityOf(cert("spiffe://td/ns/acme-evil/sa/x"))).toBeUndefined();
    expect(map.identityOf(cert(undefined, ["other.example", "worker.example"]))).toMatchObject({
      account: "dns",
      subject: "worker.example",
      scopes: new Set(["s1"]),
    });
  });
});
