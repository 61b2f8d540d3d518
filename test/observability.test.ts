// Request logs and /metrics over real sockets: one JSON line per RPC with
// request id, account, method, code and latency, and never a bearer token;
// Prometheus counters that move with what the server did.

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import { createLogger } from "../src/log/logger.js";
import { failure, seconds } from "./support/calls.js";
import { useTestServer } from "./support/fixture.js";
import { untilExpired } from "./support/leases.js";
import { grpcClient } from "./support/server.js";
import { adminScope, bearer } from "./support/tokens.js";

const lines: string[] = [];
const { db, server, client, keys, startServer } = useTestServer({
  keys: true,
  args: ["--max-leases-per-account", "3", "--access-log-sample", "1"],
  logger: createLogger({
    level: "debug",
    destination: { write: (line: string) => void lines.push(line) },
  }),
});

const logged = () => lines.map((l) => JSON.parse(l) as Record<string, unknown>);

async function scrape(): Promise<string> {
  const res = await fetch(`${server.url}/metrics`);
  expect(res.status).toBe(200);
  expect(res.headers.get("content-type")).toMatch(/text\/plain/);
  return res.text();
}

function value(text: string, series: string): number {
  const line = text.split("\n").find((l) => l.startsWith(`${series} `));
  return line === undefined ? 0 : Number(line.slice(series.length + 1));
}

describe("request logs", () => {
  it("one line per RPC with request id, account, method, code and latency; no token anywhere", async () => {
    const token = await keys.token("logs-acct", { scope: adminScope });
    const requestId = `req-${randomUUID()}`;
    const key = { accountId: "logs-acct", sessionId: "s1" };
    await client.acquire(
      { key, ttl: seconds(30) },
      { headers: { ...bearer(token).headers, "x-request-id": requestId } },
    );
    const denied = await failure(
      client.get({ key: { accountId: "someone-else", sessionId: "s1" } }, bearer(token)),
    );
    expect(denied.code).toBe(Code.PermissionDenied);
    expect(denied.metadata.get("x-request-id")).toMatch(/^[0-9a-f-]{36}$/);
    const bad = await failure(
      client.get({ key }, { headers: { authorization: `Bearer ${token}x` } }),
    );
    expect(bad.code).toBe(Code.Unauthenticated);

    const ours = logged().find((l) => l.requestId === requestId);
    expect(ours).toMatchObject({
      msg: "rpc",
      method: "leasehold.v1.LeaseService/Acquire",
      account: "logs-acct",
      code: "ok",
    });
    expect(typeof ours?.latencyMs).toBe("number");
    expect(logged()).toContainEqual(
      expect.objectContaining({
        method: "leasehold.v1.LeaseService/Get",
        account: "logs-acct",
        code: "permission_denied",
      }),
    );
    expect(logged()).toContainEqual(
      expect.objectContaining({ method: "leasehold.v1.LeaseService/Get", code: "unauthenticated" }),
    );
    const all = lines.join("");
    // The token, its signature part, and the header never reach the log.
    expect(all).not.toContain(token);
    expect(all).not.toContain(token.split(".")[2] ?? "");
    expect(all.toLowerCase()).not.toContain("bearer");
    expect(all.toLowerCase()).not.toContain("authorization");
  });
});

describe("request log sampling", () => {
  it("by default a successful call writes no line and a failed one does", async () => {
    const quietLines: string[] = [];
    const quiet = await startServer(
      [],
      {},
      createLogger({
        level: "debug",
        destination: { write: (line: string) => void quietLines.push(line) },
      }),
    );
    try {
      const c = grpcClient(quiet.url);
      const key = { accountId: "quiet-acct", sessionId: "s1" };
      const ok = `req-${randomUUID()}`;
      const bad = `req-${randomUUID()}`;
      await c.get({ key }, { headers: { "x-request-id": ok } });
      await failure(
        c.get({ key: { ...key, sessionId: "" } }, { headers: { "x-request-id": bad } }),
      );
      const ids = quietLines.map((l) => (JSON.parse(l) as { requestId?: string }).requestId);
      expect(ids).toContain(bad);
      expect(ids).not.toContain(ok);
    } finally {
      await quiet.close();
    }
  });
});

describe("/metrics", () => {
  it("counts grants, renewals, releases, revocations, losses and quota refusals; latency by method and code", async () => {
    const token = await keys.token("metrics-acct", { scope: adminScope });
    const auth = bearer(token);
    const before = await scrape();
    const key = (s: string) => ({ accountId: "metrics-acct", sessionId: s });

    const a = await client.acquire({ key: key("a"), ttl: seconds(30) }, auth);
    await client.renew({ key: key("a"), runId: a.lease?.runId ?? "" }, auth);
    await client.release({ key: key("a"), runId: a.lease?.runId ?? "" }, auth);
    const b = await client.acquire(
      { key: key("b"), ttl: create(DurationSchema, { nanos: 100_000_000 }) },
      auth,
    );
    await untilExpired(db.sql, key("b"));
    const lost = await failure(client.renew({ key: key("b"), runId: b.lease?.runId ?? "" }, auth));
    expect(lost.code).toBe(Code.FailedPrecondition);
    // The expired lease of b is taken over: an expiry this instance found.
    await client.acquire({ key: key("b"), ttl: seconds(30) }, auth);
    await client.acquire({ key: key("c"), ttl: seconds(30) }, auth);
    await client.revoke({ key: key("c"), reason: "metrics test" }, auth);
    // b, d and e make the quota of 3.
    for (const s of ["d", "e"]) await client.acquire({ key: key(s), ttl: seconds(30) }, auth);
    const refused = await failure(client.acquire({ key: key("f"), ttl: seconds(30) }, auth));
    expect(refused.code).toBe(Code.ResourceExhausted);

    const after = await scrape();
    const delta = (series: string) => value(after, series) - value(before, series);
    expect(delta("leasehold_lease_grants_total")).toBe(6);
    expect(delta("leasehold_lease_renewals_total")).toBe(1);
    expect(delta("leasehold_lease_releases_total")).toBe(1);
    expect(delta("leasehold_lease_revocations_total")).toBe(1);
    expect(delta('leasehold_lease_losses_total{reason="expired"}')).toBe(1);
    expect(delta("leasehold_quota_rejections_total")).toBe(1);
    expect(value(after, "leasehold_leases_held")).toBeGreaterThanOrEqual(0);
    expect(value(after, "leasehold_db_up")).toBe(1);
    expect(value(after, "leasehold_db_pool_size")).toBe(20);
    // The pool's counter, made before the registry, is served with it (nothing cancelled here).
    expect(after).toContain("\nleasehold_db_sync_replication_cancelled_total 0\n");
    expect(
      delta(
        'leasehold_rpc_duration_seconds_count{method="leasehold.v1.LeaseService/Acquire",code="resource_exhausted"}',
      ),
    ).toBe(1);
    expect(after).toContain("leasehold_notification_lag_seconds");
    expect(after).toContain("leasehold_process_cpu_seconds_total");
    expect(after).toContain("leasehold_nodejs_active_handles{");
  });

  it("other methods on /metrics are refused and other paths reach the RPC router", async () => {
    expect((await fetch(`${server.url}/metrics`, { method: "POST" })).status).toBe(405);
    expect((await fetch(`${server.url}/nothing-here`)).status).toBe(404);
  });
});
