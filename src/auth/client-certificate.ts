// What a TLS connection says about its client certificate (DESIGN §7,
// docs/security.md "Client certificates"): whether one was presented, whether
// it verified against the configured CA bundle and, if not, why, in words
// and as an auth failure a client can act on; and the names an identity map
// matches (the SPIFFE ID of the URI SAN, the subject CN, the DNS SANs).
//
// The TLS server asks for a certificate but refuses none at the handshake:
// a handshake alert reaches a client as a bare reset in most stacks, while a
// call refused with UNAUTHENTICATED names the reason. The verdict of a
// connection never changes, so it is read once per socket.

import type { TLSSocket } from "node:tls";
import type { AuthFailure } from "../protocol/errors.js";

/** A client certificate that verified against the configured CA bundle. */
export interface VerifiedCertificate {
  readonly verified: true;
  /** The one `spiffe://` URI SAN of an X.509-SVID; undefined when there is none. */
  readonly spiffeId: string | undefined;
  /** The subject's common name; undefined when it has none. */
  readonly commonName: string | undefined;
  readonly dnsNames: readonly string[];
  /** notAfter, wall clock ms: calls of the connection are refused from then on. */
  readonly validUntilMs: number;
  /** SHA-256 fingerprint, for logs. */
  readonly fingerprint: string;
}

/** A certificate that was presented and refused, with the reason. */
export interface RefusedCertificate {
  readonly verified: false;
  readonly failure: AuthFailure;
  readonly message: string;
}

/** The client certificate of a connection; undefined: none was presented (or no TLS). */
export type ClientCertificate = VerifiedCertificate | RefusedCertificate;

const notIssuedHere = "it is not issued by a CA of the server's client CA bundle (--tls-client-ca)";

// OpenSSL's verification codes (as Node names them): the failure each is, in
// words (Node's own message is often the bare code). Any other code is
// certificate_untrusted with Node's message.
const refusalOfCode: Record<string, [AuthFailure, string]> = {
  CERT_HAS_EXPIRED: ["certificate_expired", "it has expired"],
  CERT_NOT_YET_VALID: ["certificate_not_yet_valid", "it is not valid yet"],
  INVALID_PURPOSE: ["certificate_usage", "it is not for TLS client authentication"],
  UNABLE_TO_GET_ISSUER_CERT: ["certificate_untrusted", notIssuedHere],
  UNABLE_TO_GET_ISSUER_CERT_LOCALLY: ["certificate_untrusted", notIssuedHere],
  UNABLE_TO_VERIFY_LEAF_SIGNATURE: ["certificate_untrusted", notIssuedHere],
  DEPTH_ZERO_SELF_SIGNED_CERT: ["certificate_untrusted", `it is self-signed: ${notIssuedHere}`],
  SELF_SIGNED_CERT_IN_CHAIN: ["certificate_untrusted", notIssuedHere],
  CERT_SIGNATURE_FAILURE: ["certificate_untrusted", "its signature does not verify"],
};

// clientAuth, and anyExtendedKeyUsage, of RFC 5280's extended key usages.
const clientAuthUsages = ["1.3.6.1.5.5.7.3.2", "2.5.29.37.0"];

const verdicts = new WeakMap<TLSSocket, ClientCertificate | null>();

/** The client certificate of `socket`, read once per connection; undefined without one. */
export function clientCertificateOf(socket: TLSSocket): ClientCertificate | undefined {
  let verdict = verdicts.get(socket);
  if (verdict === undefined) {
    verdict = readCertificate(socket);
    verdicts.set(socket, verdict);
  }
  return verdict ?? undefined;
}

function readCertificate(socket: TLSSocket): ClientCertificate | null {
  const peer = socket.getPeerCertificate();
  // Node answers an empty object (or null once the socket closed) when the
  // client sent no certificate.
  if (!peer || Object.keys(peer).length === 0) return null;
  if (!socket.authorized) {
    const error = socket.authorizationError as (Error & { code?: string }) | string | null;
    const code = (typeof error === "object" && error !== null ? error.code : String(error)) ?? "";
    const text = typeof error === "object" && error !== null ? error.message : String(error);
    const [failure, why] = refusalOfCode[code] ?? ["certificate_untrusted", text];
    return refused(failure, `${why} (${code})`);
  }
  // OpenSSL checks the purpose of the chain; a leaf whose extended key usage
  // leaves out clientAuth is refused here as well, whatever the CA allowed.
  const usages = peer.ext_key_usage;
  if (usages !== undefined && !usages.some((u) => clientAuthUsages.includes(u))) {
    return refused(
      "certificate_usage",
      "it is not for TLS client authentication (its extended key usage lacks clientAuth)",
    );
  }
  const names = subjectAltNames(peer.subjectaltname ?? "");
  const spiffeIds = names.filter((n) => n.kind === "URI" && n.value.startsWith("spiffe://"));
  if (spiffeIds.length > 1) {
    // An X.509-SVID has exactly one: which workload would this be?
    return refused("certificate_invalid", "it names more than one SPIFFE ID (URI SAN)");
  }
  const cn = peer.subject?.CN;
  return {
    verified: true,
    spiffeId: spiffeIds[0]?.value,
    commonName: Array.isArray(cn) ? cn[0] : cn,
    dnsNames: names.filter((n) => n.kind === "DNS").map((n) => n.value),
    validUntilMs: Date.parse(peer.valid_to),
    fingerprint: peer.fingerprint256,
  };
}

function refused(failure: AuthFailure, why: string): RefusedCertificate {
  return { verified: false, failure, message: `client certificate refused: ${why}` };
}

interface AltName {
  kind: string;
  value: string;
}

/**
 * Node's subjectaltname text: `DNS:a.example, URI:spiffe://td/w`. A value
 * holding a comma, quote or other special character is a JSON string
 * (`URI:"spiffe://td/a,b"`), so the text is read entry by entry, not split.
 */
export function subjectAltNames(text: string): AltName[] {
  const names: AltName[] = [];
  const entry = /([A-Za-z ]+):("(?:[^"\\]|\\.)*"|[^,]*)(?:, |$)/y;
  while (entry.lastIndex < text.length) {
    const start = entry.lastIndex;
    const m = entry.exec(text);
    if (!m || entry.lastIndex === start) break;
    const raw = m[2] ?? "";
    let value = raw;
    if (raw.startsWith('"')) {
      try {
        value = JSON.parse(raw) as string;
      } catch {
        value = raw;
      }
    }
    names.push({ kind: m[1] ?? "", value });
  }
  return names;
}
