// The cache of verified tokens (src/auth/authn.ts): keyed by the
// token, not by the header that carried it, and bounded in bytes, so that
// a caller with one valid token cannot fill the server's memory by spelling
// its header in many ways, nor with many large tokens. Unit tests of the
// authenticator: there is no database in this.

import { randomBytes } from "node:crypto";
import { describe, expect, it } from "vitest";
import { createAuthenticator, verifiedCacheBytes, verifiedEntryBytes } from "../src/auth/authn.js";
import type { TokenConfig } from "../src/config/ops-config.js";
import { UnauthenticatedError } from "../src/lease/errors.js";
import { signToken } from "./support/tokens.js";

const secret = new TextEncoder().encode(randomBytes(32).toString("base64url"));
const config: TokenConfig = {
  keys: { kind: "hs256", secret },
  issuer: undefined,
  audience: [],
  accountClaim: "sub",
};

describe("verified token cache", () => {
  it("whitespace and case variants of one header share one cache entry", async () => {
    const authn = createAuthenticator(config, { kind: "hs256", secret }, 128);
    const token = await signToken(secret, "acct");
    const headers = [
      `Bearer ${token}`,
      `bearer ${token}`,
      `BEARER ${token}`,
      `Bearer  ${token}`,
      `Bearer ${token} `,
      ...Array.from(
        { length: 200 },
        (_, i) => `Bearer${" ".repeat(i + 1)}${token}${" ".repeat(i)}`,
      ),
    ];
    for (const header of headers) {
      expect((await authn.authenticate(header)).account).toBe("acct");
    }
    const stats = authn.verifiedCache();
    expect(stats.entries).toBe(1);
    expect(stats.bytes).toBe(
      verifiedEntryBytes(token, {
        account: "acct",
        subject: "acct",
        scopes: new Set(),
        anonymous: false,
      }),
    );
  });

  it("many large valid tokens keep the cache within its byte bound, newest kept", async () => {
    const authn = createAuthenticator(config, { kind: "hs256", secret }, 128);
    // Each token carries about 6 KiB of claims: some 12 KiB of cache each.
    const padding = "p".repeat(6_000);
    const perEntry = verifiedEntryBytes(
      await signToken(secret, "acct-0", { claims: { padding } }),
      { account: "acct-0", subject: "acct-0", scopes: new Set(), anonymous: false },
    );
    const fits = Math.floor(verifiedCacheBytes / perEntry);
    let last = "";
    for (let i = 0; i < fits + 200; i++) {
      last = await signToken(secret, `acct-${i}`, { claims: { padding, n: i } });
      await authn.authenticate(`Bearer ${last}`);
      const { bytes } = authn.verifiedCache();
      if (bytes > verifiedCacheBytes)
        expect.fail(`cache holds ${bytes} bytes after ${i + 1} tokens`);
    }
    const stats = authn.verifiedCache();
    expect(stats.entries).toBeLessThanOrEqual(fits);
    expect(stats.entries).toBeGreaterThan(fits - 10);
    // The newest token is a hit: the cache keeps what is used, not what came first.
    const before = authn.verifiedCache().entries;
    await authn.authenticate(`Bearer ${last}`);
    expect(authn.verifiedCache().entries).toBe(before);
  });

  it("a token without exp is refused naming the claim and the flag, and never cached", async () => {
    const authn = createAuthenticator(config, { kind: "hs256", secret }, 128);
    const token = await signToken(secret, "acct", { expiresIn: null });
    const error = await authn.authenticate(`Bearer ${token}`).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UnauthenticatedError);
    expect((error as UnauthenticatedError).failure).toBe("claims");
    expect((error as Error).message).toMatch(/no "exp" claim.*--allow-tokens-without-exp/);
    expect(authn.verifiedCache().entries).toBe(0);

    const allowing = createAuthenticator(
      { ...config, allowTokensWithoutExp: true },
      { kind: "hs256", secret },
      128,
    );
    const principal = await allowing.authenticate(`Bearer ${token}`);
    expect(principal).toMatchObject({ account: "acct", validUntilMs: undefined });
  });
});
