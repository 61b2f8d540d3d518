// Server reflection, v1 and v1alpha, as a generic gRPC tool uses it: list
// the services, fetch the file that declares one (with its imports), build
// the service from those descriptors alone and call it.

import { create, createFileRegistry, fromBinary } from "@bufbuild/protobuf";
import {
  DurationSchema,
  FileDescriptorProtoSchema,
  FileDescriptorSetSchema,
} from "@bufbuild/protobuf/wkt";
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { describe, expect, it } from "vitest";
import { ServerReflection as V1 } from "../src/gen/grpc/reflection/v1/reflection_pb.js";
import { ServerReflection as V1alpha } from "../src/gen/grpc/reflection/v1alpha/reflection_pb.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";

const { db, server } = useTestServer();

type Request = {
  host?: string;
  messageRequest:
    | { case: "listServices"; value: string }
    | { case: "fileContainingSymbol"; value: string }
    | { case: "fileByFilename"; value: string };
};

// Both versions have the same messages; each test runs over one of them.
for (const [version, service] of [
  ["v1", V1],
  ["v1alpha", V1alpha],
] as const) {
  describe(`grpc.reflection.${version}`, () => {
    // One bidi stream per exchange, as grpcurl opens them.
    async function ask(requests: Request[]) {
      const client = createClient(
        service as typeof V1,
        createGrpcTransport({ baseUrl: server.url }),
      );
      const answers = [];
      async function* send() {
        for (const r of requests) yield r;
      }
      for await (const a of client.serverReflectionInfo(send())) answers.push(a);
      return answers;
    }

    it("lists LeaseService, health and both reflection services", async () => {
      const [answer] = await ask([{ messageRequest: { case: "listServices", value: "" } }]);
      expect(answer?.messageResponse.case).toBe("listServicesResponse");
      const names =
        answer?.messageResponse.case === "listServicesResponse"
          ? answer.messageResponse.value.service.map((s) => s.name)
          : [];
      expect(names).toEqual(
        expect.arrayContaining([
          "leasehold.v1.LeaseService",
          "grpc.health.v1.Health",
          "grpc.reflection.v1.ServerReflection",
          "grpc.reflection.v1alpha.ServerReflection",
        ]),
      );
    });

    it("S1: the descriptors it returns are enough to call LeaseService", async () => {
      const [answer] = await ask([
        {
          messageRequest: {
            case: "fileContainingSymbol",
            value: "leasehold.v1.LeaseService.Acquire",
          },
        },
      ]);
      if (answer?.messageResponse.case !== "fileDescriptorResponse") {
        throw new Error(`unexpected answer ${answer?.messageResponse.case}`);
      }
      const files = answer.messageResponse.value.fileDescriptorProto.map((b) =>
        fromBinary(FileDescriptorProtoSchema, b),
      );
      expect(files[0]?.name).toBe("leasehold/v1/lease.proto");
      expect(files.map((f) => f.name)).toEqual(
        expect.arrayContaining([
          "google/protobuf/duration.proto",
          "google/protobuf/timestamp.proto",
        ]),
      );
      // Only what reflection sent: no generated code of LeaseService below.
      // The requested file comes first; a descriptor set lists imports first.
      const registry = createFileRegistry(
        create(FileDescriptorSetSchema, { file: [...files].reverse() }),
      );
      const leaseService = registry.getService("leasehold.v1.LeaseService");
      expect(leaseService?.methods.map((m) => m.name)).toContain("Acquire");
      if (!leaseService) return;
      const dynamic = createClient(leaseService, createGrpcTransport({ baseUrl: server.url }));
      const acquire = dynamic.acquire as unknown as (
        req: unknown,
      ) => Promise<{ acquired: boolean }>;
      const key = freshKey("reflect");
      const acquired = await acquire({ key, ttl: create(DurationSchema, { seconds: 30n }) });
      expect(acquired.acquired).toBe(true);
      const [row] = await db.sql`SELECT run_id FROM leases WHERE session_id = ${key.sessionId}`;
      expect(row).toBeDefined();
    });

    it("answers NOT_FOUND in band for an unknown symbol or file, and keeps the stream", async () => {
      const answers = await ask([
        { messageRequest: { case: "fileContainingSymbol", value: "no.Such" } },
        { messageRequest: { case: "fileByFilename", value: "no/such.proto" } },
        { messageRequest: { case: "fileByFilename", value: "grpc/health/v1/health.proto" } },
      ]);
      expect(answers.map((a) => a.messageResponse.case)).toEqual([
        "errorResponse",
        "errorResponse",
        "fileDescriptorResponse",
      ]);
      const [first] = answers;
      if (first?.messageResponse.case === "errorResponse") {
        expect(first.messageResponse.value.errorCode).toBe(5);
      }
    });
  });
}
