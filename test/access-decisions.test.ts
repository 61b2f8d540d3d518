// A KeepAlive stream's session decisions (rpc/access.ts): remembered so that
// a renewal every few seconds does not query the session authorizer each
// time, and bounded by the leases a stream may carry, so that a stream that
// renews ever new sessions holds no more memory than its leases.

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";
import type { SessionAuthorizer } from "../src/auth/session-authorizer.js";
import { KeepAliveRequestSchema } from "../src/gen/leasehold/v1/lease_pb.js";
import { defaultLimits } from "../src/lease/limits.js";
import { createAccess } from "../src/server/rpc/access.js";

describe("a KeepAlive stream's session decisions", () => {
  it("are remembered, at most as many as the leases a stream may carry (--max-leases-per-stream)", async () => {
    const asked: string[] = [];
    const authorizer: SessionAuthorizer = {
      allows: async (_principal, sessionId) => {
        asked.push(sessionId);
        return true;
      },
    };
    const maxLeasesPerStream = 3;
    const access = createAccess({
      protectedServices: new Set(),
      authenticator: undefined,
      authorizer,
      adminScope: "leasehold:admin",
      fenceScope: "leasehold:fence",
      limits: { ...defaultLimits, maxLeasesPerStream },
    });
    const decided = new Map<string, number>();
    const renew = (sessionId: string) =>
      access.check(
        "KeepAlive",
        KeepAliveRequestSchema,
        create(KeepAliveRequestSchema, {
          key: { accountId: "acct", sessionId },
          runId: randomUUID(),
        }),
        undefined,
        decided,
      );
    for (let i = 0; i < 50; i++) {
      await renew(`s${i}`);
      expect(decided.size).toBeLessThanOrEqual(maxLeasesPerStream);
    }
    expect(asked).toHaveLength(50);
    // The stream's current leases are still remembered: no new question.
    await renew("s49");
    await renew("s48");
    expect(asked).toHaveLength(50);
    // A session forgotten long ago is asked again, which is always correct.
    await renew("s0");
    expect(asked).toHaveLength(51);
  });
});
