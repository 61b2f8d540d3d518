// Keys and bearer tokens for tests of authentication: an HS256 secret in a
// file (as operators configure it), and a token minter for any claims.

import { randomBytes } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import os from "node:os";
import path from "node:path";
import { SignJWT } from "jose";
import { afterAll } from "vitest";

export interface TestKeys {
  /** Flags that make a test server require these keys. */
  args: string[];
  secret: Uint8Array;
  /** A valid token for `account` with the given scopes and claims. */
  token(account: string, options?: TokenOptions): Promise<string>;
}

export interface TokenOptions {
  scope?: string;
  subject?: string;
  /** Seconds from now (default 600); negative for an expired token; null: no `exp` claim. */
  expiresIn?: number | null;
  secret?: Uint8Array;
  claims?: Record<string, unknown>;
}

export const adminScope = "leasehold:admin";

// The secrets' folders, removed when the test file ends (its servers are
// stopped by then: their own afterAll hooks ran first, registered later).
const keyDirs: string[] = [];
afterAll(async () => {
  for (const dir of keyDirs.splice(0)) await rm(dir, { recursive: true, force: true });
});

export async function createTestKeys(): Promise<TestKeys> {
  const dir = await mkdtemp(path.join(os.tmpdir(), "leasehold-keys-"));
  keyDirs.push(dir);
  const text = randomBytes(32).toString("base64url");
  const file = path.join(dir, "jwt-secret");
  await writeFile(file, `${text}\n`, { mode: 0o600 });
  const secret = new TextEncoder().encode(text);
  return {
    args: ["--jwt-secret-file", file],
    secret,
    token: (account, options = {}) => signToken(options.secret ?? secret, account, options),
  };
}

export function signToken(
  secret: Uint8Array,
  account: string,
  options: TokenOptions = {},
): Promise<string> {
  const now = Math.floor(Date.now() / 1000);
  const jwt = new SignJWT({
    ...(options.scope === undefined ? {} : { scope: options.scope }),
    ...options.claims,
  })
    .setProtectedHeader({ alg: "HS256" })
    .setSubject(options.subject ?? account)
    .setIssuedAt(now - 60);
  if (options.expiresIn !== null) jwt.setExpirationTime(now + (options.expiresIn ?? 600));
  return jwt.sign(secret);
}

/** Call options carrying a bearer token. */
export function bearer(token: string): { headers: Record<string, string> } {
  return { headers: { authorization: `Bearer ${token}` } };
}
