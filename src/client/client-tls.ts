// TLS of the client: the CA that an https:// server's certificate is checked
// against, and the client certificate it presents to a server that asks for
// one (mutual TLS, docs/security.md "Client certificates"). Given as files,
// which are read again for each new connection once they change on disk, so
// a rotated certificate (cert-manager, SPIRE's helper) is used without a
// restart; open connections keep the one they were made with.

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
  const define = (name: "ca" | "cert" | "key", file: string | undefined) => {
    if (file === undefined) return;
    const read = cachedFile(file);
    read(); // an unreadable file fails here, when the client is made
    Object.defineProperty(options, name, { enumerable: true, get: read });
  };
  define("ca", tls.caFile);
  define("cert", tls.certFile);
  define("key", tls.keyFile);
  return options;
}

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
