// Certificates for the mutual TLS tests, made at test time with the openssl
// command (no private key is checked in): a CA, a server certificate for
// 127.0.0.1, and client certificates with a SPIFFE ID, a CN or DNS names,
// any validity window and either usage. `openssl ca` is used for leaves
// because it takes explicit start and end dates (an expired certificate,
// one not valid yet).

import { execFileSync } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";

export interface CertFiles {
  certFile: string;
  keyFile: string;
}

export interface TestCa extends CertFiles {
  name: string;
  dir: string;
}

export interface LeafOptions {
  /** File name stem, unique per folder. */
  name: string;
  commonName?: string;
  /** URI SAN, e.g. spiffe://test.example/ns/a/sa/worker. */
  spiffeIds?: string[];
  dnsNames?: string[];
  ips?: string[];
  /** clientAuth (default), serverAuth, or both. */
  usage?: "client" | "server" | "both";
  /** Validity in days from now: [start, end]; default [-1, 30]. Negative is the past. */
  validDays?: [number, number];
}

/** A folder of certificates, removed by `remove()`. */
export class CertificateFolder {
  readonly dir: string;

  constructor() {
    this.dir = mkdtempSync(path.join(tmpdir(), "leasehold-certs-"));
  }

  /** A self-signed CA. */
  ca(name: string): TestCa {
    const certFile = path.join(this.dir, `${name}.pem`);
    const keyFile = path.join(this.dir, `${name}-key.pem`);
    openssl([
      "req",
      "-x509",
      "-newkey",
      "ec",
      "-pkeyopt",
      "ec_paramgen_curve:P-256",
      "-nodes",
      "-keyout",
      keyFile,
      "-out",
      certFile,
      "-days",
      "30",
      "-subj",
      `/CN=${name}`,
      "-addext",
      "basicConstraints=critical,CA:TRUE",
      "-addext",
      "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    const dir = path.join(this.dir, `${name}-db`);
    mkdirSync(dir);
    writeFileSync(path.join(dir, "index.txt"), "");
    writeFileSync(path.join(dir, "serial"), "1000\n");
    return { name, dir, certFile, keyFile };
  }

  /** A leaf certificate signed by `ca`. */
  leaf(ca: TestCa, options: LeafOptions): CertFiles {
    const base = path.join(this.dir, options.name);
    const keyFile = `${base}-key.pem`;
    const csrFile = `${base}.csr`;
    const certFile = `${base}.pem`;
    const subject = options.commonName ? `/CN=${options.commonName}` : "/O=leasehold-test";
    openssl([
      "req",
      "-new",
      "-newkey",
      "ec",
      "-pkeyopt",
      "ec_paramgen_curve:P-256",
      "-nodes",
      "-keyout",
      keyFile,
      "-out",
      csrFile,
      "-subj",
      subject,
    ]);
    const sans = [
      ...(options.spiffeIds ?? []).map((id) => `URI:${id}`),
      ...(options.dnsNames ?? []).map((d) => `DNS:${d}`),
      ...(options.ips ?? []).map((ip) => `IP:${ip}`),
    ];
    const usage = options.usage ?? "client";
    const ext = [
      "[leaf]",
      "basicConstraints=critical,CA:FALSE",
      "keyUsage=critical,digitalSignature,keyEncipherment",
      `extendedKeyUsage=${usage === "client" ? "clientAuth" : usage === "server" ? "serverAuth" : "serverAuth,clientAuth"}`,
      ...(sans.length > 0 ? [`subjectAltName=${sans.join(",")}`] : []),
    ];
    const extFile = `${base}.ext`;
    writeFileSync(extFile, `${ext.join("\n")}\n`);
    const configFile = `${base}.cnf`;
    writeFileSync(
      configFile,
      [
        "[ca]",
        "default_ca=test",
        "[test]",
        `dir=${ca.dir}`,
        "database=$dir/index.txt",
        "serial=$dir/serial",
        `new_certs_dir=${ca.dir}`,
        "default_md=sha256",
        "policy=any",
        "unique_subject=no",
        "copy_extensions=none",
        "[any]",
        "commonName=optional",
        "organizationName=optional",
        "",
      ].join("\n"),
    );
    const [start, end] = options.validDays ?? [-1, 30];
    openssl([
      "ca",
      "-batch",
      "-notext",
      "-config",
      configFile,
      "-cert",
      ca.certFile,
      "-keyfile",
      ca.keyFile,
      "-in",
      csrFile,
      "-out",
      certFile,
      "-startdate",
      asn1Time(start),
      "-enddate",
      asn1Time(end),
      "-extfile",
      extFile,
      "-extensions",
      "leaf",
    ]);
    return { certFile, keyFile };
  }

  remove(): void {
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** YYYYMMDDHHMMSSZ, `days` from now. */
function asn1Time(days: number): string {
  const d = new Date(Date.now() + days * 86_400_000);
  return `${d.toISOString().replace(/[-:T]/g, "").slice(0, 14)}Z`;
}

function openssl(args: string[]): void {
  execFileSync("openssl", args, { stdio: ["ignore", "ignore", "pipe"] });
}
