import { defineConfig } from "vitest/config";

// The scale check (npm run test:scale, in .ci/run): 10,000 leases kept alive
// on 100 KeepAlive streams with acquire→release cycles meanwhile
// (test/scale/). It fails on errors, never on timings, but takes tens of
// seconds on two cores, so it runs apart from npm test, alone.
export default defineConfig({
  test: {
    include: ["test/scale/**/*.test.ts"],
    globalSetup: ["test/support/global-setup.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 300_000,
    hookTimeout: 120_000,
  },
});
