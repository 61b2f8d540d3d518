// TLS of the client: the CA that an https:// server's certificate is checked
// against, and the client certificate it presents to a server that asks for
// one (mutual TLS, docs/security.md "Client certificates"). Given as files,
// which are read again for each new connection once they change on disk, so
// a rotated certificate (cert-manager, SPIRE's helper) is used without a
// restart; open connections keep the one they were made with.

import { createPrivateKey, X509Certificate } from "node:crypto";
import { readFileSync, statSync } from "node:fs";
import type { SecureContextOptions } from "node:tls";

/** What `clientTlsOptions` gives: it fits http2.connect's and https.request's options. */
export type ClientTlsOptions = Pick<SecureContextOptions, "ca" | "cert" | "key">;

/** TLS files of a client; every one is optional. */
export interface ClientTls {
  /** PEM CA bundle that replaces Node's default CAs for the server's certificate. */
  caFile?: string;
  /** PEM client certificate chain, presented to servers that ask for one (with `keyFile`). */
  certFile?: string;
  /** PEM private key of `certFile`. */
  keyFile?: string;
}

/**
 * Options for `http2.connect` and `https.request` that read the files of
 * `tls` as each connection is made: getters, evaluated when Node copies the
 * options for a new connection, each file re-read only after its
 * modification time or inode changed.
 */
export function clientTlsOptions(tls: ClientTls): ClientTlsOptions {
  if ((tls.certFile === undefined) !== (tls.keyFile === undefined)) {
    throw new TypeError(
      "tls.certFile and tls.keyFile go together: a client certificate needs its key",
    );
  }
  const options: ClientTlsOptions = {};
  const define = (name: "ca" | "cert" | "key", read: () => Buffer) => {
    read(); // an unreadable file fails here, when the client is made
    Object.defineProperty(options, name, { enumerable: true, get: read });
  };
  if (tls.caFile !== undefined) define("ca", cachedFile(tls.caFile));
  if (tls.certFile !== undefined && tls.keyFile !== undefined) {
    const pair = cachedPair(cachedFile(tls.certFile), cachedFile(tls.keyFile));
    define("cert", () => pair().cert);
    define("key", () => pair().key);
  }
  return options;
}

/**
 * The certificate and key as a pair that belongs together: a rotation
 * writes one file, then the other, and a connection made in between would
 * present a certificate with a key that is not its own (refused at once by
 * OpenSSL, "key values mismatch"). A new pair is taken only once the key
 * matches the certificate; until then the previous pair stays.
 */
function cachedPair(cert: () => Buffer, key: () => Buffer): () => { cert: Buffer; key: Buffer } {
  let pair: { cert: Buffer; key: Buffer } | undefined;
  return () => {
    const next = { cert: cert(), key: key() };
    if (pair !== undefined && next.cert === pair.cert && next.key === pair.key) return pair;
    if (pair === undefined || matches(next.cert, next.key)) pair = next;
    return pair;
  };
}

function matches(cert: Buffer, key: Buffer): boolean {
  try {
    return new X509Certificate(cert).checkPrivateKey(createPrivateKey(key));
  } catch {
    return false;
  }
}

/** The file's contents, read again only after its inode, modification time or size changed. */
function cachedFile(file: string): () => Buffer {
  let content: Buffer | undefined;
  let stamp = "";
  return () => {
    try {
      const stat = statSync(file);
      const now = `${stat.ino}:${stat.mtimeMs}:${stat.size}`;
      if (content === undefined || now !== stamp) {
        content = readFileSync(file);
        stamp = now;
      }
    } catch (error) {
      // A file being replaced may be briefly absent: keep the last good one.
      if (content === undefined) {
        throw new TypeError(`cannot read the TLS file ${file}: ${(error as Error).message}`);
      }
    }
    return content;
  };
}
