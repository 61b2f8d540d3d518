// The session authorization hook with the acl-table implementation: a
// server-side check of (subject, session, action) in session_acl, run before
// any lease logic. A denial is PERMISSION_DENIED and changes nothing (S3).

import { randomUUID } from "node:crypto";
import { Code } from "@connectrpc/connect";
import { beforeAll, describe, expect, it } from "vitest";
import { failure, seconds } from "./support/calls.js";
import { useTestServer } from "./support/fixture.js";
import { storedState } from "./support/leases.js";
import { bearer } from "./support/tokens.js";

const { db, client, keys } = useTestServer({
  keys: true,
  args: ["--account-claim", "org", "--session-authorizer", "acl-table"],
});

const account = "acme";

beforeAll(async () => {
  await db.sql`
    INSERT INTO session_acl (account_id, subject, session_id, actions) VALUES
      (${account}, 'ann', 'shared', ARRAY['acquire', 'renew', 'release', 'read']),
      (${account}, 'bob', 'shared', ARRAY['read']),
      (${account}, 'bob', '*', ARRAY['watch']),
      (${account}, '*', 'public', ARRAY['*'])`;
});

const tokenFor = (subject: string) => keys.token(subject, { claims: { org: account } });

describe("acl-table session authorizer", () => {
  it("S3: a subject with the action on the session is served; one without it is denied before any lease logic", async () => {
    const ann = bearer(await tokenFor("ann"));
    const bob = bearer(await tokenFor("bob"));
    const key = { accountId: account, sessionId: "shared" };
    const a = await client.acquire({ key, ttl: seconds(60) }, ann);
    expect(a.acquired).toBe(true);
    expect((await client.get({ key }, bob)).lease?.runId).toBe(a.lease?.runId);

    const before = await storedState(db.sql);
    for (const call of [
      () => client.acquire({ key, ttl: seconds(60) }, bob),
      () => client.release({ key, runId: a.lease?.runId ?? "" }, bob),
      () => client.renew({ key, runId: a.lease?.runId ?? "" }, bob),
    ]) {
      const error = await failure(call());
      expect(error.code).toBe(Code.PermissionDenied);
      expect(error.rawMessage).toMatch(/^not allowed to (acquire|release|renew) this session$/);
    }
    expect(await storedState(db.sql)).toEqual(before);
  });

  it("no row denies; '*' rows match every subject, session or action", async () => {
    const carol = bearer(await tokenFor("carol"));
    const denied = await failure(
      client.get({ key: { accountId: account, sessionId: `other-${randomUUID()}` } }, carol),
    );
    expect(denied.code).toBe(Code.PermissionDenied);
    const pub = { accountId: account, sessionId: "public" };
    const a = await client.acquire({ key: pub, ttl: seconds(60) }, carol);
    expect(a.acquired).toBe(true);
    expect((await client.release({ key: pub, runId: a.lease?.runId ?? "" }, carol)).released).toBe(
      true,
    );
  });

  it("List needs the action on every session ('*'); Revoke needs the admin scope and the row", async () => {
    const ann = bearer(await tokenFor("ann"));
    const listed = await failure(client.list({ accountId: account }, ann));
    expect(listed.code).toBe(Code.PermissionDenied);
    expect(listed.rawMessage).toMatch(/every session of the account/);
    const admin = bearer(
      await keys.token("ann", { claims: { org: account }, scope: "leasehold:admin" }),
    );
    const revoke = await failure(
      client.revoke({ key: { accountId: account, sessionId: "shared" }, reason: "x" }, admin),
    );
    expect(revoke.code).toBe(Code.PermissionDenied);
    expect(revoke.rawMessage).toBe("not allowed to revoke this session");
  });
});
