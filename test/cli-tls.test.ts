// The CLI against a TLS server whose certificate a private CA signed (made
// here with openssl; no key is checked in), and plain HTTP sent to a TLS
// port. Before: "self-signed certificate" and nothing else to go on, no way
// to give the CA but NODE_EXTRA_CA_CERTS (mentioned nowhere); plain HTTP got
// an empty reply.

import { execFileSync } from "node:child_process";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { RunningServer } from "../src/server/server.js";
import { runCli } from "./support/cli.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";

const { startServer } = useTestDatabase();
let dir: string;
let server: RunningServer;
let caFile: string;

function openssl(args: string[]): void {
  execFileSync("openssl", args, { cwd: dir, stdio: "ignore" });
}

beforeAll(async () => {
  dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-tls-"));
  // A CA, and a server certificate for 127.0.0.1 signed by it.
  openssl([
    "req",
    "-x509",
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:P-256",
    "-nodes",
    "-keyout",
    "ca.key",
    "-out",
    "ca.pem",
    "-days",
    "1",
    "-subj",
    "/CN=Leasehold test CA",
  ]);
  openssl([
    "req",
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:P-256",
    "-nodes",
    "-keyout",
    "server.key",
    "-out",
    "server.csr",
    "-subj",
    "/CN=127.0.0.1",
  ]);
  await writeFile(path.join(dir, "san.ext"), "subjectAltName=IP:127.0.0.1\n");
  openssl([
    "x509",
    "-req",
    "-in",
    "server.csr",
    "-CA",
    "ca.pem",
    "-CAkey",
    "ca.key",
    "-CAcreateserial",
    "-out",
    "server.pem",
    "-days",
    "1",
    "-extfile",
    "san.ext",
  ]);
  caFile = path.join(dir, "ca.pem");
  server = await startServer([
    "--tls-cert",
    path.join(dir, "server.pem"),
    "--tls-key",
    path.join(dir, "server.key"),
  ]);
});

afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

describe("the CLI and a TLS server of a private CA", () => {
  it("without the CA it says what to do; with --ca or LEASEHOLD_CA it answers, over Connect and gRPC", async () => {
    const key = freshKey("tls-cli");
    const flags = ["--server", server.url, "--account", key.accountId, "--session", key.sessionId];
    const untrusted = await runCli(["get", ...flags], { NODE_EXTRA_CA_CERTS: "" });
    expect(untrusted.code).toBe(69);
    expect(untrusted.stderr).toBe(
      `leasehold get: the TLS certificate of ${server.url} is not trusted (unable to verify the first certificate): ` +
        "give the certificate of the CA that signed it with --ca FILE (LEASEHOLD_CA), or set NODE_EXTRA_CA_CERTS=FILE\n",
    );

    const acquired = await runCli(["acquire", ...flags, "--ca", caFile, "--ttl", "30s"]);
    expect(acquired.stderr).toBe("");
    expect(acquired.code).toBe(0);
    const overGrpc = await runCli(["get", ...flags, "--protocol", "grpc"], {
      LEASEHOLD_CA: caFile,
    });
    expect(overGrpc.code).toBe(0);
    expect(overGrpc.stdout).toContain(`${key.accountId}/${key.sessionId}`);

    const missing = await runCli(["get", ...flags, "--ca", path.join(dir, "nope.pem")]);
    expect(missing.code).toBe(2);
    expect(missing.stderr).toMatch(
      /^leasehold get: --ca \(LEASEHOLD_CA\) must be a readable PEM file/,
    );
  });

  it("plain HTTP sent to the TLS port is answered 400, saying the port speaks TLS", async () => {
    const socket = net.connect(server.port, "127.0.0.1");
    socket.write(`GET /metrics HTTP/1.1\r\nhost: 127.0.0.1:${server.port}\r\n\r\n`);
    let answer = "";
    socket.on("data", (chunk: Buffer) => {
      answer += chunk.toString();
    });
    await new Promise((resolve) => socket.once("close", resolve));
    expect(answer.split("\r\n")[0]).toBe("HTTP/1.1 400 Bad Request");
    expect(answer).toContain("This port speaks TLS: use https://");
  });
});
