// The call policy's Connect adapter (policy-interceptor.ts) around streaming
// calls, on stand-in KeepAlive and Watch handlers (the real ones live in
// their own modules and have their own tests): every KeepAlive message is
// checked as it arrives, Watch is checked before its handler runs, and Watch
// streams per account are bounded. test/call-policy.test.ts runs the same
// rules over real sockets on every path.

import { randomBytes, randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  createClient,
  createRouterTransport,
  type ServiceImpl,
} from "@connectrpc/connect";
import { describe, expect, it } from "vitest";
import { createAuthenticator } from "../src/auth/authn.js";
import { ownAccountAuthorizer } from "../src/auth/session-authorizer.js";
import { createAccountSlots } from "../src/call/account-slots.js";
import { createCallObserver } from "../src/call/call-observer.js";
import { createCallPolicy } from "../src/call/call-policy.js";
import { policyInterceptor } from "../src/call/policy-interceptor.js";
import type { AuthConfig } from "../src/config/ops-config.js";
import {
  KeepAliveResponseSchema,
  LeaseService,
  WatchResponseSchema,
} from "../src/gen/leasehold/v1/lease_pb.js";
import { defaultLimits } from "../src/lease/limits.js";
import { createLogger } from "../src/log/logger.js";
import { LimitName } from "../src/protocol/errors.js";
import { createMetrics } from "../src/server/observability/metrics.js";
import { createAccess } from "../src/server/rpc/access.js";
import { signToken } from "./support/tokens.js";

const secret = new TextEncoder().encode(randomBytes(32).toString("base64url"));
const auth: AuthConfig = {
  keys: { kind: "hs256", secret },
  issuer: undefined,
  audience: [],
  accountClaim: "sub",
  adminScope: "leasehold:admin",
  fenceScope: "leasehold:fence",
  sessionAuthorizer: "own-account",
};

const logger = createLogger({ level: "silent" });

function setup(maxWatchers = 10) {
  const seen: { keepAlive: string[]; watch: string[] } = { keepAlive: [], watch: [] };
  const impl: Partial<ServiceImpl<typeof LeaseService>> = {
    async *keepAlive(requests) {
      for await (const r of requests) {
        seen.keepAlive.push(`${r.key?.accountId}/${r.key?.sessionId}`);
        yield create(KeepAliveResponseSchema, { key: r.key, runId: r.runId });
      }
    },
    async *watch(req, context) {
      seen.watch.push(`${req.key?.accountId}/${req.key?.sessionId}`);
      yield create(WatchResponseSchema, {});
      await new Promise<void>((resolve) =>
        context.signal.addEventListener("abort", () => resolve(), { once: true }),
      );
    },
  };
  const slots = createAccountSlots(maxWatchers, "Watch streams", LimitName.watchersPerAccount);
  const transport = createRouterTransport(({ service }) => service(LeaseService, impl), {
    router: {
      interceptors: [
        policyInterceptor(
          createCallPolicy({
            observer: createCallObserver({
              logger,
              metrics: createMetrics({ poolSize: 1, countHeld: async () => 0, logger }),
              accessLogSample: 0,
            }),
            access: createAccess({
              protectedServices: new Set([LeaseService.typeName]),
              authenticator: createAuthenticator(auth, { kind: "hs256", secret }, 128),
              authorizer: ownAccountAuthorizer,
              adminScope: auth.adminScope,
              fenceScope: auth.fenceScope,
              limits: defaultLimits,
            }),
            watchSlots: slots,
          }),
        ),
      ],
    },
  });
  return { client: createClient(LeaseService, transport), seen, slots };
}

const headers = async (account: string) => ({
  authorization: `Bearer ${await signToken(secret, account)}`,
});

describe("KeepAlive", () => {
  it("S3: each message is checked as it arrives; one naming another account ends the stream before the handler sees it", async () => {
    const { client, seen } = setup();
    async function* requests() {
      yield { key: { accountId: "alice", sessionId: "a" }, runId: randomUUID() };
      yield { key: { accountId: "alice", sessionId: "b" }, runId: randomUUID() };
      yield { key: { accountId: "mallory", sessionId: "m" }, runId: randomUUID() };
      yield { key: { accountId: "alice", sessionId: "c" }, runId: randomUUID() };
    }
    const answers: string[] = [];
    const error = await (async () => {
      for await (const a of client.keepAlive(requests(), { headers: await headers("alice") })) {
        answers.push(a.key?.sessionId ?? "");
      }
    })().then(
      () => undefined,
      (e: unknown) => ConnectError.from(e),
    );
    expect(error?.code).toBe(Code.PermissionDenied);
    expect(error?.rawMessage).not.toContain("mallory");
    expect(seen.keepAlive).toEqual(["alice/a", "alice/b"]);
    expect(answers).toEqual(["a", "b"]);
  });

  it("a stream without a token never reaches the handler", async () => {
    const { client, seen } = setup();
    async function* requests() {
      yield { key: { accountId: "alice", sessionId: "a" }, runId: randomUUID() };
    }
    const error = await (async () => {
      for await (const _ of client.keepAlive(requests())) {
        // no answers expected
      }
    })().then(
      () => undefined,
      (e: unknown) => ConnectError.from(e),
    );
    expect(error?.code).toBe(Code.Unauthenticated);
    expect(seen.keepAlive).toEqual([]);
  });
});

describe("Watch", () => {
  it("S3: another account's Watch is refused before the handler runs", async () => {
    const { client, seen } = setup();
    const error = await (async () => {
      for await (const _ of client.watch(
        { key: { accountId: "victim", sessionId: "" } },
        { headers: await headers("alice") },
      )) {
        // no answers expected
      }
    })().then(
      () => undefined,
      (e: unknown) => ConnectError.from(e),
    );
    expect(error?.code).toBe(Code.PermissionDenied);
    expect(seen.watch).toEqual([]);
  });

  it("the account's Watch streams are bounded; ending one frees its slot", async () => {
    const { client, slots } = setup(2);
    const h = await headers("alice");
    const open = () => {
      const controller = new AbortController();
      const it = client
        .watch(
          { key: { accountId: "alice", sessionId: "" } },
          { headers: h, signal: controller.signal },
        )
        [Symbol.asyncIterator]();
      return { first: it.next(), it, stop: () => controller.abort() };
    };
    const a = open();
    const b = open();
    await a.first;
    await b.first;
    expect(slots.used("alice")).toBe(2);
    const c = open();
    const refused = await c.first.then(
      () => undefined,
      (e: unknown) => ConnectError.from(e),
    );
    expect(refused?.code).toBe(Code.ResourceExhausted);
    expect(slots.used("alice")).toBe(2);
    a.stop();
    await a.it.next().catch(() => undefined);
    await expect.poll(() => slots.used("alice")).toBe(1);
    const d = open();
    await d.first;
    expect(slots.used("alice")).toBe(2);
    b.stop();
    d.stop();
  });
});
