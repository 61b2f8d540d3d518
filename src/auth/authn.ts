// Bearer-token authentication (DESIGN §7): verifies a JWT with jose against
// an HS256 secret or a JWKS file, and turns its claims into a Principal.
// Every failure is an UnauthenticatedError whose message gives the reason
// and never repeats the token.

import { createLocalJWKSet, errors, type JWTPayload, type JWTVerifyGetKey, jwtVerify } from "jose";
import { LRUCache } from "lru-cache";
import type { TokenConfig, VerificationKeys } from "../config/ops-config.js";
import { UnauthenticatedError } from "../lease/errors.js";
import type { ClientCertificate } from "./client-certificate.js";

/** Who is calling: the account it may act for, and what it may do there. */
export interface Principal {
  /** The account from the configured claim. */
  account: string;
  /** The token's `sub`, for session ACLs and logs ("" in development mode). */
  subject: string;
  scopes: ReadonlySet<string>;
  /** True in development mode: no token, any account of the request. */
  anonymous: boolean;
  /** When the token stops being accepted (its `exp`, wall clock, ms); undefined: never. */
  validUntilMs?: number;
  /**
   * What ends the principal at `validUntilMs`: its token (the default) or
   * its connection's client certificate, whose stream then ends with
   * `certificate_expired` (a client reconnects with its rotated certificate)
   * rather than `expired` (fetch a new token).
   */
  expiresWith?: "token" | "certificate";
}

export interface Authenticator {
  /**
   * Verifies the caller's credentials: the `authorization` header value (null
   * when absent) and the connection's client certificate (undefined when it
   * presented none, or the server asks for none).
   */
  authenticate(authorization: string | null, certificate?: ClientCertificate): Promise<Principal>;
}

/** What the cache of verified tokens holds right now. */
export interface VerifiedCacheStats {
  entries: number;
  /** Counted as `verifiedEntryBytes` does; never above `verifiedCacheBytes`. */
  bytes: number;
}

/** The authenticator of `createAuthenticator`, whose cache can be inspected (tests, metrics). */
export interface CachingAuthenticator extends Authenticator {
  verifiedCache(): VerifiedCacheStats;
}

// Tokens are short strings; anything longer is not worth parsing.
const maxTokenLength = 8192;
// A client sends the same token with every call until it refreshes it, and
// verifying a JWT costs more than a lease decision: verified tokens are kept
// until they expire, for at most this long. The cache is keyed by the token,
// not the header, so spellings of one header ("Bearer  t", "bearer t ") share
// one entry, and it is bounded in bytes, since a token may be 8 KiB: 16 MiB
// holds some 16,000 tokens of a usual 1 KiB, least recently used out first.
const verifiedCacheMs = 300_000;
export const verifiedCacheBytes = 16 << 20;
// jose's clockTolerance below, in ms: a token is accepted this long past `exp`.
const clockToleranceMs = 5_000;
// Accounts from tokens obey the same rule as account ids in requests, so a
// claim can never name an account that no request could.
const accountPattern = /^[A-Za-z0-9._:@+=-]+$/;

export function createAuthenticator(
  config: TokenConfig,
  keys: VerificationKeys,
  maxIdLength: number,
): CachingAuthenticator {
  const algorithms = keys.kind === "hs256" ? ["HS256"] : ["RS256", "ES256"];
  const key: Uint8Array | JWTVerifyGetKey =
    keys.kind === "hs256" ? keys.secret : createLocalJWKSet(keys.jwks);
  const options = {
    algorithms,
    issuer: config.issuer,
    audience: config.audience.length > 0 ? config.audience : undefined,
    // Tolerates small clock differences between the issuer and this server.
    clockTolerance: 5,
  };

  const verified = new LRUCache<string, { principal: Principal; untilMs: number }>({
    maxSize: verifiedCacheBytes,
    sizeCalculation: (entry, token) => verifiedEntryBytes(token, entry.principal),
  });

  return {
    verifiedCache: () => ({ entries: verified.size, bytes: verified.calculatedSize }),
    authenticate: async (authorization) => {
      if (authorization === null || authorization === "") {
        throw new UnauthenticatedError(
          "missing bearer token: send the header 'authorization: Bearer <JWT>'",
          "missing",
        );
      }
      const m = /^Bearer +(\S+) *$/i.exec(authorization);
      if (!m?.[1]) {
        throw new UnauthenticatedError(
          "the authorization header must be 'Bearer <JWT>'",
          "malformed",
        );
      }
      const token = m[1];
      const cached = verified.get(token);
      if (cached) {
        if (Date.now() < cached.untilMs) return cached.principal;
        verified.delete(token);
      }
      if (token.length > maxTokenLength) {
        throw new UnauthenticatedError(
          `malformed token: longer than ${maxTokenLength} characters`,
          "malformed",
        );
      }
      let payload: JWTPayload;
      try {
        // jose's overloads differ only in the key's type.
        payload =
          typeof key === "function"
            ? (await jwtVerify(token, key, options)).payload
            : (await jwtVerify(token, key, options)).payload;
      } catch (error) {
        throw refusalOf(error);
      }
      const account = payload[config.accountClaim];
      if (
        typeof account !== "string" ||
        account.length === 0 ||
        account.length > maxIdLength ||
        !accountPattern.test(account)
      ) {
        throw new UnauthenticatedError(
          `token claim "${config.accountClaim}" must name an account (letters, digits and . _ : @ + = -, at most ${maxIdLength} characters)`,
          "account_claim",
        );
      }
      // A token without `exp` would be accepted for as long as its key is:
      // a leaked one could not be made useless short of rotating the key.
      if (typeof payload.exp !== "number" && !config.allowTokensWithoutExp) {
        throw new UnauthenticatedError(
          'token not accepted: it has no "exp" claim (a server started with --allow-tokens-without-exp on accepts such tokens)',
          "claims",
        );
      }
      const expiresMs =
        typeof payload.exp === "number" ? payload.exp * 1000 + clockToleranceMs : Infinity;
      const principal: Principal = {
        account,
        subject: typeof payload.sub === "string" ? payload.sub : "",
        scopes: scopesOf(payload),
        anonymous: false,
        validUntilMs: Number.isFinite(expiresMs) ? expiresMs : undefined,
      };
      verified.set(token, {
        principal,
        untilMs: Math.min(expiresMs, Date.now() + verifiedCacheMs),
      });
      return principal;
    },
  };
}

/**
 * What one cached token costs, roughly: its text and the principal's strings
 * (UTF-16, two bytes a character) plus a fixed overhead for the objects.
 */
export function verifiedEntryBytes(token: string, principal: Principal): number {
  let chars = token.length + principal.account.length + principal.subject.length;
  for (const scope of principal.scopes) chars += scope.length;
  return 2 * chars + 256;
}

/** The refusal of a failed verification, in words a client can act on. */
function refusalOf(error: unknown): UnauthenticatedError {
  if (error instanceof errors.JWTExpired)
    return new UnauthenticatedError("token expired", "expired");
  if (error instanceof errors.JWTClaimValidationFailed) {
    return new UnauthenticatedError(`token not accepted: ${error.message}`, "claims");
  }
  if (
    error instanceof errors.JWSSignatureVerificationFailed ||
    error instanceof errors.JWKSNoMatchingKey ||
    error instanceof errors.JWKSMultipleMatchingKeys
  ) {
    return new UnauthenticatedError(
      "token signature is not valid for the configured keys",
      "bad_signature",
    );
  }
  if (error instanceof errors.JOSEAlgNotAllowed || error instanceof errors.JOSENotSupported) {
    return new UnauthenticatedError("token algorithm is not accepted", "algorithm");
  }
  return new UnauthenticatedError("malformed token: not a signed JWT", "malformed");
}

function scopesOf(payload: JWTPayload): ReadonlySet<string> {
  const scope = payload.scope;
  if (typeof scope === "string") return new Set(scope.split(" ").filter((s) => s !== ""));
  if (Array.isArray(scope)) return new Set(scope.filter((s) => typeof s === "string"));
  return new Set();
}
