// Bearer-token authentication (DESIGN §7): verifies a JWT with jose against
// an HS256 secret or a JWKS file, and turns its claims into a Principal.
// Every failure is an UnauthenticatedError whose message gives the reason
// and never repeats the token.

import { createLocalJWKSet, errors, type JWTPayload, type JWTVerifyGetKey, jwtVerify } from "jose";
import type { AuthConfig, VerificationKeys } from "../config/ops-config.js";
import { UnauthenticatedError } from "../lease/errors.js";

/** Who is calling: the account it may act for, and what it may do there. */
export interface Principal {
  /** The account from the configured claim. */
  account: string;
  /** The token's `sub`, for session ACLs and logs ("" in development mode). */
  subject: string;
  scopes: ReadonlySet<string>;
  /** True in development mode: no token, any account of the request. */
  anonymous: boolean;
}

export interface Authenticator {
  /** Verifies the `authorization` header value (undefined when absent). */
  authenticate(authorization: string | null): Promise<Principal>;
}

// Tokens are short strings; anything longer is not worth parsing.
const maxTokenLength = 8192;
// A client sends the same token with every call until it refreshes it, and
// verifying a JWT costs more than a lease decision: verified tokens are kept
// (bounded) until they expire, for at most this long.
const verifiedCacheMs = 300_000;
const verifiedCacheSize = 10_000;
// jose's clockTolerance below, in ms: a token is accepted this long past `exp`.
const clockToleranceMs = 5_000;
// Accounts from tokens obey the same rule as account ids in requests, so a
// claim can never name an account that no request could.
const accountPattern = /^[A-Za-z0-9._:@+=-]+$/;

export function createAuthenticator(
  config: AuthConfig,
  keys: VerificationKeys,
  maxIdLength: number,
): Authenticator {
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

  const verified = new Map<string, { principal: Principal; untilMs: number }>();

  return {
    authenticate: async (authorization) => {
      const cached = authorization === null ? undefined : verified.get(authorization);
      if (cached && Date.now() < cached.untilMs) return cached.principal;
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
      const principal: Principal = {
        account,
        subject: typeof payload.sub === "string" ? payload.sub : "",
        scopes: scopesOf(payload),
        anonymous: false,
      };
      const expiresMs =
        typeof payload.exp === "number" ? payload.exp * 1000 + clockToleranceMs : Infinity;
      verified.delete(authorization);
      if (verified.size >= verifiedCacheSize) {
        const oldest = verified.keys().next().value;
        if (oldest !== undefined) verified.delete(oldest);
      }
      verified.set(authorization, {
        principal,
        untilMs: Math.min(expiresMs, Date.now() + verifiedCacheMs),
      });
      return principal;
    },
  };
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
