// Tests start `leasehold` processes from the compiled CLI (bin/leasehold.js
// runs dist/). A vitest global setup: compiles src/ when dist/ is missing or
// older than a source file, so a test never runs yesterday's build.

import { execFileSync } from "node:child_process";
import { readdirSync, statSync, utimesSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("../../", import.meta.url));
const buildInfo = path.join(root, "dist", ".tsbuildinfo");

function newestSource(dir: string): number {
  let newest = 0;
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) newest = Math.max(newest, newestSource(full));
    else if (entry.name.endsWith(".ts")) newest = Math.max(newest, statSync(full).mtimeMs);
  }
  return newest;
}

function builtAt(): number {
  try {
    return statSync(buildInfo).mtimeMs;
  } catch {
    return 0;
  }
}

export function ensureBuild(): void {
  const sources = Math.max(
    newestSource(path.join(root, "src")),
    statSync(path.join(root, "tsconfig.build.json")).mtimeMs,
  );
  if (builtAt() >= sources) return;
  execFileSync(
    process.execPath,
    [path.join(root, "node_modules", "typescript", "bin", "tsc"), "-p", "tsconfig.build.json"],
    { cwd: root, stdio: "inherit" },
  );
  // tsc leaves its build info untouched when no output changed.
  const now = new Date();
  utimesSync(buildInfo, now, now);
}

export function setup(): void {
  ensureBuild();
}
