// A run that acquires a lease, reports it on stdout, then does "work"
// forever without renewing: the test kills it with SIGKILL.
// Usage: node --import tsx acquire-and-hang.ts URL ACCOUNT SESSION TTL_MS

import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { grpcClient } from "./server.js";

const [url, accountId, sessionId, ttlMs] = process.argv.slice(2);
const client = grpcClient(url ?? "");
const ms = Number(ttlMs);
const result = await client.acquire({
  key: { accountId, sessionId },
  ttl: create(DurationSchema, { seconds: BigInt(Math.floor(ms / 1000)), nanos: (ms % 1000) * 1e6 }),
  holder: `pid-${process.pid}`,
});
process.stdout.write(
  `${JSON.stringify({ acquired: result.acquired, runId: result.lease?.runId, token: String(result.lease?.fencingToken) })}\n`,
);
setInterval(() => {}, 1 << 30);
