// The web page's files, served by the lease server on the RPC port: content
// types, caching of hashed assets, and no way out of the page's folder.
// Requests are sent with node:http so that paths reach the server exactly as
// written (fetch would normalise `..` away before sending).

import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import http from "node:http";
import os from "node:os";
import path from "node:path";
import { beforeAll, describe, expect, it } from "vitest";
import type { RunningServer } from "../src/server/server.js";
import { useTestDatabase } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { connectClient } from "./support/server.js";

interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: string;
}

function request(
  baseUrl: string,
  rawPath: string,
  options: { method?: string; headers?: http.OutgoingHttpHeaders } = {},
): Promise<Answer> {
  const { hostname, port } = new URL(baseUrl);
  return new Promise((resolve, reject) => {
    const req = http.request(
      { hostname, port, path: rawPath, method: options.method ?? "GET", headers: options.headers },
      (res) => {
        let body = "";
        res.setEncoding("utf8");
        res.on("data", (chunk: string) => {
          body += chunk;
        });
        res.on("end", () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body }));
      },
    );
    req.on("error", reject);
    req.end();
  });
}

const secret = "database password: hunter2";
let dir: string;
let server: RunningServer;
let unbuilt: RunningServer;
const { startServer, defer } = useTestDatabase();

beforeAll(async () => {
  // <dir>/secret.txt and <dir>/site/.env lie outside what may be served.
  dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-static-"));
  const site = path.join(dir, "site");
  await mkdir(path.join(site, "assets"), { recursive: true });
  await writeFile(path.join(dir, "secret.txt"), secret);
  await writeFile(path.join(site, ".env"), secret);
  await writeFile(path.join(site, "index.html"), "<!doctype html><title>page</title>");
  await writeFile(path.join(site, "assets", "index-AbC123.js"), "console.log('page');");
  await writeFile(path.join(site, "assets", "index-AbC123.css"), "body{}");
  defer(() => rm(dir, { recursive: true, force: true }));
  server = await startServer(["--web-dir", site]);
  unbuilt = await startServer(["--web-dir", path.join(dir, "missing")]);
});

describe("the web page on the RPC port", () => {
  it("serves index.html at / as HTML that is revalidated, with a same-origin content policy", async () => {
    const page = await request(server.url, "/");
    expect(page.status).toBe(200);
    expect(page.body).toContain("<title>page</title>");
    expect(page.headers["content-type"]).toBe("text/html; charset=utf-8");
    expect(page.headers["cache-control"]).toBe("no-cache");
    expect(page.headers["content-security-policy"]).toContain("connect-src 'self'");
    expect(page.headers["x-content-type-options"]).toBe("nosniff");
    expect((await request(server.url, "/index.html?x=1")).body).toBe(page.body);
  });

  it("serves hashed assets with their content type and as immutable", async () => {
    const js = await request(server.url, "/assets/index-AbC123.js");
    expect(js.status).toBe(200);
    expect(js.headers["content-type"]).toBe("text/javascript; charset=utf-8");
    expect(js.headers["cache-control"]).toBe("public, max-age=31536000, immutable");
    const css = await request(server.url, "/assets/index-AbC123.css");
    expect(css.headers["content-type"]).toBe("text/css; charset=utf-8");
  });

  it("answers 304 to a request that already has the current version", async () => {
    const first = await request(server.url, "/");
    const etag = first.headers.etag;
    expect(etag).toBeTruthy();
    const again = await request(server.url, "/", { headers: { "if-none-match": etag } });
    expect(again.status).toBe(304);
    expect(again.body).toBe("");
  });

  it("answers HEAD without a body and other methods with 405", async () => {
    const head = await request(server.url, "/", { method: "HEAD" });
    expect(head.status).toBe(200);
    expect(head.body).toBe("");
    const post = await request(server.url, "/", { method: "POST" });
    expect(post.status).toBe(405);
    expect(post.headers.allow).toBe("GET, HEAD");
  });

  it.each([
    "/../secret.txt",
    "/assets/../../secret.txt",
    "/%2e%2e/secret.txt",
    "/assets/..%2f..%2fsecret.txt",
    "/assets/..%5c..%5csecret.txt",
    "/.env",
    "/%2eenv",
    "/index.html%00.js",
    "/%E0%A4%A",
    "//etc/passwd",
  ])("never serves a file outside the page's folder: %s", async (rawPath) => {
    const answer = await request(server.url, rawPath);
    expect(answer.status).toBe(404);
    expect(answer.body).not.toContain(secret);
  });

  it("says how to build the page when it is not built, and RPCs still work", async () => {
    const answer = await request(unbuilt.url, "/");
    expect(answer.status).toBe(404);
    expect(answer.body).toContain("npm run build:web");
    const client = connectClient(unbuilt.url);
    const got = await client.get({ key: freshKey() });
    expect(got.held).toBe(false);
  });

  it("leaves RPC paths to the lease service on the same port", async () => {
    const client = connectClient(server.url);
    const key = freshKey();
    const acquired = await client.acquire({ key, ttl: { seconds: 30n }, holder: "desktop" });
    expect(acquired.acquired).toBe(true);
    expect((await request(server.url, "/leasehold.v1.LeaseService/Nope")).status).toBe(404);
  });
});
