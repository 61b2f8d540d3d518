// Authentication by client certificate (mutual TLS), beside or instead of
// bearer tokens (docs/security.md "Client certificates"). The certificate
// verified at the handshake against `--tls-client-ca` is mapped to an
// account and scopes by the identity map; the principal it gives is what
// authorization, quotas, the audit trail and the web page see, exactly as a
// token's would be.
//
//   require   every call needs a verified, mapped certificate; a bearer
//             token may come with it (below)
//   optional  a call without a certificate is authenticated by its bearer
//             token alone; one with a certificate, as under require
//
// A call that brings both is checked on both: the token must verify and name
// the certificate's account (else UNAUTHENTICATED identity_conflict), and
// the call then acts with the token's subject and scopes — the token is what
// the application chose for this call, the certificate pins the account. The
// call is accepted until the earlier of the two expires.

import type { ClientAuthMode } from "../config/host-config.js";
import type { TokenConfig } from "../config/ops-config.js";
import { PermissionDeniedError, UnauthenticatedError } from "../lease/errors.js";
import type { AuthFailure } from "../protocol/errors.js";
import { type Authenticator, createAuthenticator, type Principal } from "./authn.js";
import { describeCertificate, type IdentityMap, parseIdentityMap } from "./identity-map.js";

export interface CertificateAuthOptions {
  mode: ClientAuthMode;
  /** The identity map in force (it is reloaded when its file changes). */
  identities: () => IdentityMap;
  /** Bearer tokens, when the server has token keys too. */
  tokens: Authenticator | undefined;
  /** Called for every refused certificate, with the failure (for metrics). */
  onRefused?: (failure: AuthFailure | "unmapped") => void;
}

export function createCertificateAuthenticator(options: CertificateAuthOptions): Authenticator {
  const { mode, tokens } = options;
  const refuse = (failure: AuthFailure, message: string): never => {
    options.onRefused?.(failure);
    throw new UnauthenticatedError(message, failure);
  };
  const tokenOf = async (authorization: string | null): Promise<Principal> => {
    if (tokens === undefined) {
      return refuse(
        "malformed",
        "this server verifies no bearer tokens (it has no token keys): authenticate with a client certificate alone",
      );
    }
    return tokens.authenticate(authorization);
  };
  return {
    authenticate: async (authorization, certificate) => {
      const hasToken = authorization !== null && authorization !== "";
      if (certificate === undefined) {
        // Under optional, but with no token keys, a certificate is the only
        // way in: a call that brought neither lacks the certificate.
        if (mode === "require" || (tokens === undefined && !hasToken)) {
          return refuse(
            "certificate_missing",
            "a client certificate is required: connect over TLS with a certificate issued by the server's client CA",
          );
        }
        return tokenOf(authorization);
      }
      if (!certificate.verified) return refuse(certificate.failure, certificate.message);
      if (Date.now() >= certificate.validUntilMs) {
        // Verified at the handshake, expired since, on a connection kept open.
        return refuse(
          "certificate_expired",
          "client certificate refused: it has expired since the connection opened",
        );
      }
      const identity = options.identities().identityOf(certificate);
      if (identity === undefined) {
        options.onRefused?.("unmapped");
        throw new PermissionDeniedError(
          `the client certificate (${describeCertificate(certificate)}) is not in the server's identity map`,
        );
      }
      if (!hasToken) {
        return {
          account: identity.account,
          subject: identity.subject,
          scopes: identity.scopes,
          anonymous: false,
          validUntilMs: certificate.validUntilMs,
          expiresWith: "certificate",
        };
      }
      const token = await tokenOf(authorization);
      if (token.account !== identity.account) {
        return refuse(
          "identity_conflict",
          "the bearer token's account is not the client certificate's: send one or the other, or both for the same account",
        );
      }
      const tokenUntil = token.validUntilMs ?? Number.POSITIVE_INFINITY;
      return {
        ...token,
        validUntilMs: Math.min(tokenUntil, certificate.validUntilMs),
        expiresWith: certificate.validUntilMs < tokenUntil ? "certificate" : "token",
      };
    },
  };
}

/** What a server's callers authenticate with: tokens, client certificates, or both. */
export interface CallerAuthOptions {
  tokens: TokenConfig;
  maxIdLength: number;
  /** Client certificates, when the server asks for them. */
  clientCertificates?: {
    mode: ClientAuthMode;
    identityMapFile: string;
    /** Reads the identity map now and whenever the server's TLS files are reloaded. */
    use(user: (files: { identityMap: string | undefined }) => () => void): void;
  };
  onRefused?: (failure: AuthFailure | "unmapped") => void;
}

/**
 * The authenticator of a server's callers; undefined in development mode
 * (neither token keys nor client certificates). An identity map that does
 * not parse stops the start here, and a reload, with a ConfigError.
 */
export function createCallerAuthenticator(options: CallerAuthOptions): Authenticator | undefined {
  const { tokens: config, maxIdLength, clientCertificates: clients } = options;
  const tokens = config.keys ? createAuthenticator(config, config.keys, maxIdLength) : undefined;
  if (clients === undefined) return tokens;
  let identities: IdentityMap | undefined;
  clients.use((files) => {
    const next = parseIdentityMap(files.identityMap ?? "", clients.identityMapFile, maxIdLength);
    return () => {
      identities = next;
    };
  });
  return createCertificateAuthenticator({
    mode: clients.mode,
    identities: () => identities as IdentityMap,
    tokens,
    onRefused: options.onRefused,
  });
}
