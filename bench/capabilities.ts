// Which streaming features the server under test has. Scenarios 2–4 need
// Watch, KeepAlive and Acquire with `wait`, which arrive together; a server
// built without them answers Watch with UNIMPLEMENTED, and those scenarios
// are then reported as skipped rather than run against a server that would
// ignore `wait` and spin.

import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "../src/client/grpc-transport.js";
import { LeaseService } from "../src/gen/leasehold/v1/lease_pb.js";

export async function serverStreams(baseUrl: string): Promise<boolean> {
  const client = createClient(LeaseService, createGrpcTransport({ baseUrl }));
  const stop = new AbortController();
  try {
    for await (const _ of client.watch(
      { key: { accountId: "bench-probe", sessionId: "probe" } },
      { signal: stop.signal, timeoutMs: 10_000 },
    )) {
      return true;
    }
    return true;
  } catch (error) {
    if (ConnectError.from(error).code === Code.Unimplemented) return false;
    throw error;
  } finally {
    stop.abort();
  }
}
