#!/usr/bin/env node
// The `leasehold` command: the compiled CLI in dist/ (`npm run build`, which
// `npm start` and `npm test` run first).
import { existsSync } from "node:fs";

const main = new URL("../dist/cli/main.js", import.meta.url);
if (!existsSync(main)) {
  process.stderr.write(
    "leasehold: dist/ is not built; run `npm run build` in the package folder first\n",
  );
  process.exit(1);
}
await import(main.href);
