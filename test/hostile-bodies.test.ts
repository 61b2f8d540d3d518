// Request bodies of callers that are not allowed in (docs/security.md,
// "Bodies before authentication"), against `leasehold guarded serve` and
// `leasehold serve` as their own processes, whose memory is measured.
//
// One HTTP/2 connection opens 60 streams of one method that takes a body
// (the store's Put, the lease server's Acquire), each sending 5 MB and never
// ending, with no authorization header (and, on the store, with a token whose
// account is not the one the request's headers name). Every stream must be
// refused from its headers, before its body is read — UNAUTHENTICATED
// (PERMISSION_DENIED), the stream reset — and the server's RSS must grow by
// less than 50 MiB, on each protocol: Connect, gRPC-Web and gRPC (the lease
// server's native gRPC path; connect-node's on the store). Before, the store
// read every body whole before authenticating: about 5 MB per stream.

import { readFileSync } from "node:fs";
import http2 from "node:http2";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { useTestDatabase } from "./support/fixture.js";
import type { ServerProcess } from "./support/server.js";
import { createTestKeys } from "./support/tokens.js";
import { within } from "./support/wait.js";

const { spawnServer, spawnGuardedServer } = useTestDatabase();

const streams = 60;
const bodyBytes = 5 * 1024 * 1024;
const growthLimitMiB = 50;

let lease: ServerProcess;
let store: ServerProcess;
let otherAccountToken = "";
const report: Record<string, unknown> = {};

beforeAll(async () => {
  const keys = await createTestKeys();
  otherAccountToken = `Bearer ${await keys.token("mallory")}`;
  lease = await spawnServer(keys.args);
  store = await spawnGuardedServer([...keys.args, "--lease-url", lease.url], {
    LEASEHOLD_LEASE_TOKEN: await keys.token("store", { scope: "leasehold:fence" }),
  });
}, 120_000);

afterAll(() => {
  console.log(`hostile bodies summary\n${JSON.stringify(report, null, 2)}`);
});

/** Resident memory of a server process, in MiB. */
function rssMiB(server: ServerProcess): number {
  const status = readFileSync(`/proc/${server.child.pid}/status`, "utf8");
  return Number(/VmRSS:\s+(\d+) kB/.exec(status)?.[1] ?? Number.NaN) / 1024;
}

interface Protocol {
  name: string;
  headers: Record<string, string>;
  /** The body: a message as this protocol frames it. */
  body(bytes: number): Buffer;
}

/** A gRPC envelope declaring a message that fills `bytes` with its header. */
const envelope = (bytes: number): Buffer => {
  const body = Buffer.alloc(bytes);
  body.writeUInt32BE(bytes - 5, 1);
  return body;
};

const protocols: Protocol[] = [
  {
    name: "Connect",
    headers: { "content-type": "application/proto", "connect-protocol-version": "1" },
    body: (bytes) => Buffer.alloc(bytes),
  },
  {
    name: "gRPC-Web",
    headers: { "content-type": "application/grpc-web+proto", "x-grpc-web": "1" },
    body: envelope,
  },
  { name: "gRPC", headers: { "content-type": "application/grpc", te: "trailers" }, body: envelope },
];

/** The code a stream was answered with, in any protocol's way of sending it. */
function codeOf(status: number, headers: http2.IncomingHttpHeaders, body: string): string {
  const grpc = headers["grpc-status"];
  if (typeof grpc === "string") return grpcCodes[Number(grpc)] ?? `grpc-status ${grpc}`;
  try {
    const code = (JSON.parse(body) as { code?: string }).code;
    if (code !== undefined) return code;
  } catch {
    // The body was cut off with the stream: the status says it.
  }
  return connectStatuses[status] ?? `HTTP ${status}`;
}

const connectStatuses: Record<number, string> = {
  401: "unauthenticated",
  403: "permission_denied",
};

const grpcCodes: Record<number, string> = {
  0: "ok",
  7: "permission_denied",
  16: "unauthenticated",
};

interface Outcome {
  /** The code answered, or "unanswered" when the server took the whole body instead. */
  code: string;
  /** The server reset the stream (or closed it) while the client still sent. */
  reset: boolean;
}

/**
 * Opens `streams` streams on one connection, each writing `bodyBytes` and
 * never ending. Resolves once every stream is answered or has had its whole
 * body taken by the server, with the RSS growth at that moment.
 */
async function flood(
  server: ServerProcess,
  path: string,
  protocol: Protocol,
  extraHeaders: Record<string, string>,
): Promise<{ outcomes: Outcome[]; growthMiB: number }> {
  const before = rssMiB(server);
  // Room for every body the client queues (300 MB): Node's default of
  // 10 MB would have the client's own session refuse its streams.
  const session = http2.connect(server.url, { maxSessionMemory: 1024 });
  session.on("error", () => {});
  const body = protocol.body(bodyBytes);
  try {
    const outcomes = await Promise.all(
      Array.from(
        { length: streams },
        () =>
          new Promise<Outcome>((resolve) => {
            const stream = session.request(
              { ":method": "POST", ":path": path, ...protocol.headers, ...extraHeaders },
              { endStream: false },
            );
            let status = 0;
            let headers: http2.IncomingHttpHeaders = {};
            let text = "";
            let answered = false;
            stream.on("error", () => {});
            stream.on("response", (h) => {
              status = Number(h[":status"]);
              headers = h;
              answered = true;
            });
            stream.on("trailers", (t) => {
              headers = { ...headers, ...t };
            });
            stream.setEncoding("utf8");
            stream.on("data", (chunk: string) => {
              text += chunk;
            });
            const settle = (reset: boolean) =>
              resolve({ code: answered ? codeOf(status, headers, text) : "unanswered", reset });
            // The server reset the stream while it was still sending.
            stream.once("aborted", () => settle(true));
            stream.once("close", () => settle(stream.rstCode !== undefined));
            // All of it taken: the server read the body instead of refusing it.
            stream.write(body, () => {
              if (!answered) settle(false);
            });
          }),
      ),
    );
    return { outcomes, growthMiB: rssMiB(server) - before };
  } finally {
    session.destroy();
  }
}

const putPath = "/leasehold.guarded.v1.GuardedStoreService/Put";

const cases: { server: () => ServerProcess; name: string; path: string }[] = [
  { server: () => store, name: "guarded store", path: putPath },
  { server: () => lease, name: "lease server", path: "/leasehold.v1.LeaseService/Acquire" },
];

/**
 * Floods `server` (see flood) and checks that every stream was answered
 * `code` and reset, and that RSS grew less than the limit.
 */
async function expectRefusedFromHeaders(
  label: string,
  server: ServerProcess,
  path: string,
  protocol: Protocol,
  headers: Record<string, string>,
  code: string,
): Promise<void> {
  const { outcomes, growthMiB } = await within(flood(server, path, protocol, headers), {
    what: "every stream answered or its body taken",
    timeoutMs: 120_000,
  });
  const codes = tally(outcomes.map((o) => o.code));
  report[label] = {
    codes,
    reset: outcomes.filter((o) => o.reset).length,
    rssGrowthMiB: Math.round(growthMiB),
  };
  expect(growthMiB).toBeLessThan(growthLimitMiB);
  expect(codes).toEqual({ [code]: streams });
  expect(outcomes.every((o) => o.reset)).toBe(true);
}

describe("60 streams of 5 MB that never end, on one HTTP/2 connection", () => {
  for (const c of cases) {
    for (const protocol of protocols) {
      it(`${c.name}, ${protocol.name}, no authorization header: every stream is UNAUTHENTICATED from its headers and reset; RSS grows < ${growthLimitMiB} MiB`, async () => {
        await expectRefusedFromHeaders(
          `${c.name} ${protocol.name} unauthenticated`,
          c.server(),
          c.path,
          protocol,
          {},
          "unauthenticated",
        );
      });
    }
  }

  for (const protocol of protocols) {
    it(`guarded store, ${protocol.name}, a token of another account than leasehold-account-id names: every stream is PERMISSION_DENIED from its headers and reset; RSS grows < ${growthLimitMiB} MiB`, async () => {
      await expectRefusedFromHeaders(
        `guarded store ${protocol.name} other account`,
        store,
        putPath,
        protocol,
        {
          authorization: otherAccountToken,
          "leasehold-account-id": "acme",
          "leasehold-session-id": "s",
          "leasehold-fencing-token": "1",
        },
        "permission_denied",
      );
    });
  }
});

function tally(codes: string[]): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const code of codes) counts[code] = (counts[code] ?? 0) + 1;
  return counts;
}
