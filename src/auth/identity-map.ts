// The identity map (`--identity-map FILE`, docs/security.md "Client
// certificates"): which account, and which scopes, a verified client
// certificate acts with. The operator writes it, in YAML or JSON:
//
//   identities:
//     - spiffe_id: spiffe://prod.example/ns/agents/sa/runner
//       account: acme
//       scopes: [leasehold:admin]
//     - spiffe_id_prefix: spiffe://prod.example/ns/acme/
//       account: acme
//     - subject_cn: billing-worker
//       account: billing
//     - dns_name: fence.internal.example
//       account: acme
//       scopes: [leasehold:fence]
//
// The first entry that matches, in file order, decides, as in a firewall's
// rule list: a reader sees which one wins without knowing a precedence.
// A certificate no entry matches is refused with PERMISSION_DENIED: it is
// genuine, but nobody said what it may do.

import { parse as parseYaml } from "yaml";
import { ConfigError } from "../config/settings.js";
import type { VerifiedCertificate } from "./client-certificate.js";

/** What a matched certificate acts as: the same fields a token gives. */
export interface MappedIdentity {
  account: string;
  /** For session ACLs, the audit trail and logs: the SPIFFE ID, CN or DNS name matched. */
  subject: string;
  scopes: ReadonlySet<string>;
}

export interface IdentityMap {
  /** The identity of a verified certificate; undefined when no entry matches. */
  identityOf(certificate: VerifiedCertificate): MappedIdentity | undefined;
  readonly entries: number;
}

type Matcher =
  | { kind: "spiffe_id"; value: string }
  | { kind: "spiffe_id_prefix"; value: string }
  | { kind: "subject_cn"; value: string }
  | { kind: "dns_name"; value: string };

interface Entry {
  match: Matcher;
  account: string;
  scopes: ReadonlySet<string>;
}

const matcherKinds = ["spiffe_id", "spiffe_id_prefix", "subject_cn", "dns_name"] as const;
const entryFields = new Set<string>([...matcherKinds, "account", "scopes"]);
// The account rule of tokens' account claims (authn.ts): a certificate can
// never name an account that no request could.
const accountPattern = /^[A-Za-z0-9._:@+=-]+$/;
const scopePattern = /^[\x21-\x7e]+$/;

/**
 * Parses an identity map from the text of `file` (YAML, of which JSON is a
 * part). Every mistake is a ConfigError naming the file, the entry and the
 * rule; a server does not start, or keeps its previous map, on one.
 */
export function parseIdentityMap(text: string, file: string, maxIdLength: number): IdentityMap {
  const fail = (where: string, rule: string): never => {
    throw new ConfigError(`--identity-map ${file}: ${where} ${rule}`);
  };
  let doc: unknown;
  try {
    doc = parseYaml(text);
  } catch (error) {
    fail("is not", `YAML or JSON: ${(error as Error).message.split("\n")[0]}`);
  }
  if (
    typeof doc !== "object" ||
    doc === null ||
    !Array.isArray((doc as Record<string, unknown>).identities)
  ) {
    fail("must be", 'a mapping with a list "identities"');
  }
  const list = (doc as { identities: unknown[] }).identities;
  const entries = list.map((raw, i): Entry => {
    const where = `identities[${i}]`;
    if (typeof raw !== "object" || raw === null || Array.isArray(raw)) {
      return fail(where, "must be a mapping");
    }
    const item = raw as Record<string, unknown>;
    for (const key of Object.keys(item)) {
      if (!entryFields.has(key)) {
        fail(`${where}.${key}`, `is not a field (fields: ${[...entryFields].join(", ")})`);
      }
    }
    const kinds = matcherKinds.filter((k) => item[k] !== undefined);
    if (kinds.length !== 1) {
      fail(where, `must have exactly one of ${matcherKinds.join(", ")}`);
    }
    const kind = kinds[0] as Matcher["kind"];
    const value = item[kind];
    if (typeof value !== "string" || value === "")
      fail(`${where}.${kind}`, "must be a non-empty string");
    const text = value as string;
    if ((kind === "spiffe_id" || kind === "spiffe_id_prefix") && !text.startsWith("spiffe://")) {
      fail(`${where}.${kind}`, `must start with spiffe://, got ${JSON.stringify(text)}`);
    }
    // Without the slash, spiffe://td/ns/a would also match spiffe://td/ns/ab.
    if (kind === "spiffe_id_prefix" && !text.endsWith("/")) {
      fail(
        `${where}.${kind}`,
        `must end with / (a path segment boundary), got ${JSON.stringify(text)}`,
      );
    }
    // Without a trust domain, spiffe:// would match every workload of every
    // trust domain the CA bundle vouches for.
    if (kind === "spiffe_id_prefix" && !/^spiffe:\/\/[^/]+\//.test(text)) {
      fail(
        `${where}.${kind}`,
        `must name a trust domain (spiffe://trust-domain/…), got ${JSON.stringify(text)}`,
      );
    }
    const account = item.account;
    if (
      typeof account !== "string" ||
      account === "" ||
      account.length > maxIdLength ||
      !accountPattern.test(account)
    ) {
      fail(
        `${where}.account`,
        `must name an account (letters, digits and . _ : @ + = -, at most ${maxIdLength} characters)`,
      );
    }
    const scopes = item.scopes ?? [];
    if (
      !Array.isArray(scopes) ||
      !scopes.every((s) => typeof s === "string" && scopePattern.test(s))
    ) {
      fail(`${where}.scopes`, "must be a list of scope names (printable characters, no spaces)");
    }
    return {
      match: { kind, value: text },
      account: account as string,
      scopes: new Set(scopes as string[]),
    };
  });
  return {
    entries: entries.length,
    identityOf: (certificate) => {
      for (const entry of entries) {
        const subject = matchOf(entry.match, certificate);
        if (subject !== undefined) {
          return { account: entry.account, subject, scopes: entry.scopes };
        }
      }
      return undefined;
    },
  };
}

/** The certificate's name that `match` accepts, or undefined. */
function matchOf(match: Matcher, certificate: VerifiedCertificate): string | undefined {
  switch (match.kind) {
    case "spiffe_id":
      return certificate.spiffeId === match.value ? certificate.spiffeId : undefined;
    case "spiffe_id_prefix":
      return certificate.spiffeId?.startsWith(match.value) ? certificate.spiffeId : undefined;
    case "subject_cn":
      return certificate.commonName === match.value ? certificate.commonName : undefined;
    case "dns_name":
      return certificate.dnsNames.includes(match.value) ? match.value : undefined;
  }
}

/** Who a certificate is, in words for an error message: its SPIFFE ID, else its CN. */
export function describeCertificate(certificate: VerifiedCertificate): string {
  if (certificate.spiffeId) return `SPIFFE ID ${certificate.spiffeId}`;
  if (certificate.commonName) return `subject CN ${JSON.stringify(certificate.commonName)}`;
  if (certificate.dnsNames.length > 0) return `DNS name ${certificate.dnsNames[0]}`;
  return `fingerprint ${certificate.fingerprint}`;
}
