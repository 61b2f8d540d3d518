import { defineConfig } from "vitest/config";

// Browser tests (npm run test:e2e): Debian's Chromium driven by
// playwright-core against `leasehold serve` on a fresh database. They run one
// file at a time: each starts a browser, and the machine has two cores.
export default defineConfig({
  test: {
    include: ["test/e2e/**/*.test.ts"],
    globalSetup: ["test/support/global-setup.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 120_000,
    hookTimeout: 120_000,
  },
});
