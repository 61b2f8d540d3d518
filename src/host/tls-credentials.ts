// The TLS files of a server, reloaded without a restart: its certificate
// and key, the client CA bundle and the identity map (docs/security.md
// "Client certificates"). Files are checked for changes every second (by
// path, so a file replaced by rename or a swapped symlink, as cert-manager
// and SPIRE's helpers do, is seen as well as one rewritten in place), and all
// of them at once on SIGHUP.
//
// A reload is all or nothing: every file is read, and every user of them
// (the listener's secure context, the identity map of the authenticator)
// checks its part first — the key must match the certificate, the bundle
// must parse, the map must be valid — and only when all agree do they take
// the new files. A half-written rotation (a new certificate beside the old
// key) keeps the previous files in force, logged, until the rest arrives.
// New connections get the new files; open connections keep the certificate
// they were verified with, so a rotation loses no call and no stream.

import { X509Certificate } from "node:crypto";
import { readFileSync, statSync } from "node:fs";
import type tls from "node:tls";
import type { TlsConfig } from "../config/host-config.js";
import type { Logger } from "../log/logger.js";

/** How often the files are looked at for a change. */
const checkIntervalMs = 1_000;

/** The contents of the TLS files. */
export interface TlsFiles {
  cert: Buffer;
  key: Buffer;
  /** The client CA bundle; undefined without client certificates. */
  clientCa: Buffer | undefined;
  /** The identity map's text; undefined without client certificates. */
  identityMap: string | undefined;
}

/**
 * A user of the files: checks them and returns what puts them in force (run
 * only when every user accepted), or throws to keep the previous ones.
 */
export type TlsFilesUser = (files: TlsFiles) => () => void;

export interface TlsCredentials {
  /** The files in force. */
  files(): TlsFiles;
  /**
   * Adds a user and puts the files in force for it at once; throws what the
   * user throws (a bad file at start stops the start).
   */
  use(user: TlsFilesUser): void;
  /** Re-reads every file; false (and the previous files kept) when one is unusable. */
  reload(): boolean;
  /** Starts watching the files and SIGHUP; returns what stops it. */
  watch(): () => void;
}

/** The secure context options of a set of files: certificate, key, client CA. */
export function secureContextOf(files: TlsFiles): tls.SecureContextOptions {
  const { cert, key, clientCa } = files;
  return clientCa ? { cert, key, ca: clientCa } : { cert, key };
}

const pemCertificate = /-----BEGIN CERTIFICATE-----[^-]*-----END CERTIFICATE-----/g;

/**
 * Throws unless `bundle` (the client CA bundle) holds at least one PEM
 * certificate and every one of them is whole. Node's secure context takes
 * whatever parses and drops the rest without a word, so a bundle seen
 * half-written, or empty, would replace the one in force and refuse every
 * new client.
 */
export function checkCaBundle(bundle: Buffer): void {
  const text = bundle.toString("utf8");
  const blocks = text.match(pemCertificate) ?? [];
  if (blocks.length === 0) throw new Error("--tls-client-ca holds no PEM certificate");
  if (text.split("-----BEGIN ").length - 1 !== blocks.length) {
    throw new Error("--tls-client-ca holds an incomplete or non-certificate PEM block");
  }
  for (const block of blocks) {
    try {
      new X509Certificate(block);
    } catch (error) {
      throw new Error(
        `--tls-client-ca holds a certificate that does not parse: ${(error as Error).message}`,
      );
    }
  }
}

export function createTlsCredentials(config: TlsConfig, logger: Logger): TlsCredentials {
  const named: [string, string | undefined][] = [
    ["--tls-cert", config.certFile],
    ["--tls-key", config.keyFile],
    ["--tls-client-ca", config.clients?.caFile],
    ["--identity-map", config.clients?.identityMapFile],
  ];
  const paths = named.flatMap(([, file]) => (file === undefined ? [] : [file]));
  // What each file looked like when it was last read: a change is judged
  // against it, not against the previous check, so a file rewritten between
  // a read and the first check (a rotation during the start) is still seen.
  let seen = "";
  const signature = () =>
    paths
      .map((path) => {
        try {
          const { ino, size, mtimeMs, ctimeMs } = statSync(path);
          return `${ino}:${size}:${mtimeMs}:${ctimeMs}`;
        } catch {
          return "missing";
        }
      })
      .join("|");
  const read = (): TlsFiles => {
    // Looked at before reading: a write after this is a change to the next check.
    seen = signature();
    const file = (i: number) => {
      const [name, path] = named[i] as [string, string | undefined];
      if (path === undefined) return undefined;
      try {
        return readFileSync(path);
      } catch (error) {
        throw new Error(`${name} ${path}: ${(error as Error).message}`);
      }
    };
    return {
      cert: file(0) as Buffer,
      key: file(1) as Buffer,
      clientCa: file(2),
      identityMap: file(3)?.toString("utf8"),
    };
  };
  let files = read();
  const users: TlsFilesUser[] = [];

  const reload = (): boolean => {
    try {
      const next = read();
      const commits = users.map((user) => user(next));
      files = next;
      for (const commit of commits) commit();
    } catch (error) {
      logger.error(
        { err: (error as Error).message, files: paths },
        "TLS files not reloaded: the previous ones stay in force",
      );
      return false;
    }
    logger.info({ files: paths }, "TLS files reloaded: new connections use them");
    return true;
  };

  return {
    files: () => files,
    use: (user) => {
      user(files)();
      users.push(user);
    },
    reload,
    watch: () => {
      // One reload for a burst of changes (a rotation writes several files):
      // it runs once the files have stayed as they are for 100 ms.
      let pending: NodeJS.Timeout | undefined;
      let last = seen;
      const check = () => {
        const now = signature();
        if (now === seen || now === last) return;
        last = now;
        clearTimeout(pending);
        pending = setTimeout(reload, 100);
        pending.unref();
      };
      // Looked at by path; the timer keeps no process alive on its own.
      const checking = setInterval(check, checkIntervalMs);
      checking.unref();
      const onHangup = () => {
        clearTimeout(pending);
        reload();
      };
      process.on("SIGHUP", onHangup);
      return () => {
        clearTimeout(pending);
        clearInterval(checking);
        process.off("SIGHUP", onHangup);
      };
    },
  };
}
