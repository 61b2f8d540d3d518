// Every unary RPC over a real socket, through three clients: the Connect
// client with the gRPC transport (h2c), an independent @grpc/grpc-js client
// that loads the .proto files (the wire as other languages see it), and a
// Connect-protocol JSON request made with plain fetch (what curl sends).

import { randomUUID } from "node:crypto";
import { fileURLToPath } from "node:url";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { describe, expect, it } from "vitest";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { seconds } from "./support/calls.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey, untilExpired } from "./support/leases.js";

const { db, server, client } = useTestServer();

describe("Connect client over gRPC (h2c)", () => {
  it("S3, S5, S6: acquire, a blocked second acquire, renew, get, list, release", async () => {
    const key = freshKey();
    const a = await client.acquire({ key, ttl: seconds(30), holder: "desktop" });
    expect(a.acquired).toBe(true);
    expect(a.lease?.runId).toMatch(/^[0-9a-f-]{36}$/);
    expect(a.lease?.fencingToken).toBeGreaterThan(0n);
    expect(a.lease?.holder).toBe("desktop");
    expect(a.lease?.ttl?.seconds).toBe(30n);
    expect(a.lease?.remaining?.seconds).toBeGreaterThanOrEqual(29n);

    const b = await client.acquire({ key, ttl: seconds(30), holder: "browser" });
    expect(b.acquired).toBe(false);
    expect(b.lease).toBeUndefined();
    expect(b.current?.runId).toBe(a.lease?.runId);
    expect(b.current?.holder).toBe("desktop");

    const runId = a.lease?.runId ?? "";
    const renewed = await client.renew({ key, runId, ttl: seconds(60) });
    expect(renewed.lease?.fencingToken).toBe(a.lease?.fencingToken);
    expect(renewed.lease?.ttl?.seconds).toBe(60n);

    const got = await client.get({ key });
    expect(got.held).toBe(true);
    expect(got.lease?.runId).toBe(runId);

    const listed = await client.list({ accountId: key.accountId, pageSize: 1000 });
    expect(listed.leases.map((l) => l.key?.sessionId)).toContain(key.sessionId);

    expect((await client.release({ key, runId })).released).toBe(true);
    expect((await client.release({ key, runId })).released).toBe(false);
    expect((await client.get({ key })).held).toBe(false);
  });

  it("S4: renewing a lease that expired answers FAILED_PRECONDITION with LEASE_NOT_HELD and its cause", async () => {
    const key = freshKey();
    const a = await client.acquire({ key, ttl: create(DurationSchema, { nanos: 100_000_000 }) });
    await untilExpired(db.sql, key);
    const error = await client.renew({ key, runId: a.lease?.runId ?? "" }).catch((e) => e);
    expect(error).toBeInstanceOf(ConnectError);
    const ce = error as ConnectError;
    expect(ce.code).toBe(Code.FailedPrecondition);
    const [info] = ce.findDetails(ErrorInfoSchema);
    expect(info?.reason).toBe("LEASE_NOT_HELD");
    expect(info?.metadata.cause).toBe("expired");
  });

  it("S4, S5: a same-run Acquire after Release or an admin Revoke answers FAILED_PRECONDITION with LEASE_NOT_HELD and the cause, and grants nothing", async () => {
    for (const how of ["released", "revoked"] as const) {
      const key = freshKey();
      const runId = randomUUID();
      await client.acquire({ key, runId, ttl: seconds(30) });
      if (how === "released") await client.release({ key, runId });
      else await server.streaming.store.revoke(key, "test");
      const error = await client.acquire({ key, runId, ttl: seconds(30) }).catch((e) => e);
      expect(error).toBeInstanceOf(ConnectError);
      const ce = error as ConnectError;
      expect(ce.code).toBe(Code.FailedPrecondition);
      expect(ce.rawMessage).toContain(`run ${runId} had its lease ${how}`);
      const [info] = ce.findDetails(ErrorInfoSchema);
      expect(info?.reason).toBe("LEASE_NOT_HELD");
      expect(info?.metadata.cause).toBe(how);
      expect((await client.get({ key })).held).toBe(false);
    }
  });

  it("S4: Renew says what happened: never held by that run, released, revoked, taken over (message and ErrorInfo cause)", async () => {
    const key = freshKey();
    const a = await client.acquire({ key, ttl: seconds(30) });
    const holder = a.lease?.runId ?? "";
    const answers: [string, string][] = [];
    const renewFails = async (runId: string) => {
      const ce = ConnectError.from(await client.renew({ key, runId }).catch((e) => e));
      expect(ce.code).toBe(Code.FailedPrecondition);
      const [info] = ce.findDetails(ErrorInfoSchema);
      expect(info?.reason).toBe("LEASE_NOT_HELD");
      answers.push([info?.metadata.cause ?? "", ce.rawMessage]);
    };
    await renewFails(randomUUID());
    await client.release({ key, runId: holder });
    await renewFails(holder);
    const b = await client.acquire({ key, ttl: seconds(30) });
    await server.streaming.store.revoke(key, "test");
    await renewFails(b.lease?.runId ?? "");
    await client.acquire({ key, ttl: seconds(30) });
    await renewFails(holder);
    expect(answers).toEqual([
      ["never_held", "lease not held: never held by this run"],
      ["released", "lease not held: released"],
      ["revoked", "lease not held: revoked"],
      ["taken_over", "lease not held: taken over"],
    ]);
  });

  it("S6: a client-chosen run_id makes acquire idempotent: the retry gets the same token", async () => {
    const key = freshKey();
    const runId = randomUUID();
    const first = await client.acquire({ key, runId, ttl: seconds(30) });
    const retry = await client.acquire({ key, runId, ttl: seconds(30) });
    expect(retry.acquired).toBe(true);
    expect(retry.lease?.fencingToken).toBe(first.lease?.fencingToken);
  });

  it("S1: list pages through valid leases with page tokens", async () => {
    const accountId = `acct-${randomUUID().slice(0, 8)}`;
    for (let i = 0; i < 5; i++) {
      await client.acquire({ key: { accountId, sessionId: `s${i}` }, ttl: seconds(30) });
    }
    const seen: string[] = [];
    let pageToken = "";
    do {
      const page = await client.list({ accountId, pageSize: 2, pageToken });
      expect(page.leases.length).toBeLessThanOrEqual(2);
      seen.push(...page.leases.map((l) => l.key?.sessionId ?? ""));
      pageToken = page.nextPageToken;
    } while (pageToken !== "");
    expect(seen).toEqual(["s0", "s1", "s2", "s3", "s4"]);
  });
});

describe("an independent gRPC implementation (@grpc/grpc-js + .proto files)", () => {
  it("S2, S5: acquire, get, renew, list and release over the gRPC wire", async () => {
    const protoDir = fileURLToPath(new URL("../proto/", import.meta.url));
    const definition = protoLoader.loadSync("leasehold/v1/lease.proto", {
      includeDirs: [protoDir],
      keepCase: true,
      longs: String,
      defaults: true,
    });
    const pkg = grpc.loadPackageDefinition(definition) as unknown as {
      leasehold: { v1: { LeaseService: grpc.ServiceClientConstructor } };
    };
    const target = new URL(server.url).host;
    const stub = new pkg.leasehold.v1.LeaseService(target, grpc.credentials.createInsecure());
    const call = <T>(method: string, request: unknown) =>
      new Promise<T>((resolve, reject) => {
        (
          stub[method] as (r: unknown, cb: (e: grpc.ServiceError | null, v: T) => void) => void
        ).call(stub, request, (error, value) => (error ? reject(error) : resolve(value)));
      });
    try {
      const key = { account_id: "grpcjs", session_id: `s-${randomUUID().slice(0, 8)}` };
      type Lease = { run_id: string; fencing_token: string; holder: string };
      const acquired = await call<{ acquired: boolean; lease: Lease }>("Acquire", {
        key,
        ttl: { seconds: 30 },
        holder: "cli",
      });
      expect(acquired.acquired).toBe(true);
      expect(BigInt(acquired.lease.fencing_token)).toBeGreaterThan(0n);
      const blocked = await call<{ acquired: boolean; current: Lease }>("Acquire", {
        key,
        ttl: { seconds: 30 },
      });
      expect(blocked.acquired).toBe(false);
      expect(blocked.current.run_id).toBe(acquired.lease.run_id);
      const got = await call<{ held: boolean; lease: Lease }>("Get", { key });
      expect(got.lease.holder).toBe("cli");
      const renewed = await call<{ lease: Lease }>("Renew", { key, run_id: acquired.lease.run_id });
      expect(renewed.lease.fencing_token).toBe(acquired.lease.fencing_token);
      const listed = await call<{ leases: Lease[] }>("List", { account_id: "grpcjs" });
      expect(listed.leases.map((l) => l.run_id)).toContain(acquired.lease.run_id);
      const released = await call<{ released: boolean }>("Release", {
        key,
        run_id: acquired.lease.run_id,
      });
      expect(released.released).toBe(true);
      const bad = await call("Acquire", { key, ttl: { seconds: 0 } }).catch((e) => e);
      expect((bad as grpc.ServiceError).code).toBe(grpc.status.INVALID_ARGUMENT);
      expect((bad as grpc.ServiceError).details).toContain("ttl");
    } finally {
      stub.close();
    }
  });
});

describe("Connect protocol JSON over HTTP/1.1 (what curl sends)", () => {
  it("S2: acquire and get with plain fetch", async () => {
    const key = { accountId: "curl", sessionId: `s-${randomUUID().slice(0, 8)}` };
    const post = (method: string, body: unknown) =>
      fetch(`${server.url}/leasehold.v1.LeaseService/${method}`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
      });
    const res = await post("Acquire", { key, ttl: "30s", holder: "desktop" });
    expect(res.status).toBe(200);
    const acquired = (await res.json()) as { acquired: boolean; lease: { fencingToken: string } };
    expect(acquired.acquired).toBe(true);
    expect(Number(acquired.lease.fencingToken)).toBeGreaterThan(0);
    const got = (await (await post("Get", { key })).json()) as { held: boolean };
    expect(got.held).toBe(true);
    const bad = await post("Acquire", { key, ttl: "-1s" });
    expect(bad.status).toBe(400);
    const error = (await bad.json()) as { code: string; message: string };
    expect(error.code).toBe("invalid_argument");
    expect(error.message).toMatch(/^ttl /);
  });
});
