// gRPC health over a real socket. The flip test runs its own embedded
// PostgreSQL, stops it under a serving Leasehold and starts it again: Watch
// reports NOT_SERVING and then SERVING, event by event, without sleeps.

import { rm } from "node:fs/promises";
import path from "node:path";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  Health,
  HealthCheckResponse_ServingStatus as Status,
} from "../src/gen/grpc/health/v1/health_pb.js";
import {
  type EmbeddedDatabase,
  makeDataParent,
  startEmbeddedPostgres,
} from "../src/postgres/embedded-postgres.js";
import type { RunningServer } from "../src/server/server.js";
import { useTestServer } from "./support/fixture.js";
import { startTestServer } from "./support/server.js";

const healthClient = (url: string) => createClient(Health, createGrpcTransport({ baseUrl: url }));

describe("grpc.health.v1 on a healthy server", () => {
  const { server } = useTestServer();

  it("Check answers SERVING for the server and for LeaseService, NOT_FOUND for others", async () => {
    const health = healthClient(server.url);
    expect((await health.check({ service: "" })).status).toBe(Status.SERVING);
    expect((await health.check({ service: "leasehold.v1.LeaseService" })).status).toBe(
      Status.SERVING,
    );
    const error = await health.check({ service: "no.such.Service" }).catch((e) => e);
    expect(ConnectError.from(error).code).toBe(Code.NotFound);
    const list = await health.list({});
    expect(Object.keys(list.statuses)).toContain("leasehold.v1.LeaseService");
  });

  it("Watch of an unknown service answers SERVICE_UNKNOWN and stays open", async () => {
    const controller = new AbortController();
    const stream = healthClient(server.url).watch(
      { service: "no.such.Service" },
      { signal: controller.signal },
    );
    for await (const m of stream) {
      expect(m.status).toBe(Status.SERVICE_UNKNOWN);
      break;
    }
    controller.abort();
  });
});

describe("health follows the database", () => {
  let dir: string;
  let pg: EmbeddedDatabase;
  let server: RunningServer | undefined;

  beforeAll(async () => {
    dir = await makeDataParent("leasehold-health-");
    pg = await startEmbeddedPostgres({ dataDir: path.join(dir, "pgdata") });
  });
  afterAll(async () => {
    await server?.close();
    await pg?.stop().catch(() => {});
    await rm(dir, { recursive: true, force: true });
  });

  it("NOT_SERVING while PostgreSQL is stopped, SERVING again when it returns", async () => {
    server = await startTestServer(pg.url, ["--health-interval", "100ms"]);
    const health = healthClient(server.url);
    const controller = new AbortController();
    const statuses = health.watch({ service: "" }, { signal: controller.signal });
    const it = statuses[Symbol.asyncIterator]();
    const next = async () => (await it.next()).value?.status;

    expect(await next()).toBe(Status.SERVING);
    await pg.stop();
    expect(await next()).toBe(Status.NOT_SERVING);
    expect((await health.check({ service: "" })).status).toBe(Status.NOT_SERVING);

    pg = await startEmbeddedPostgres({ dataDir: path.join(dir, "pgdata"), port: pg.port });
    expect(await next()).toBe(Status.SERVING);
    expect((await health.check({ service: "" })).status).toBe(Status.SERVING);
    controller.abort();
  });
});
