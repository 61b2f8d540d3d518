import { defineConfig } from "vitest/config";

// Hostile input at volume and HTTP/2 abuse (npm run test:hostile): more than
// 10,000 generated requests and thousands of connections against two
// `leasehold serve` processes, and request bodies of callers not let in
// against both servers (test/hostile-bodies.test.ts). It takes over a minute, and must not share the
// machine's two cores with other test files while it measures the servers'
// memory and connection timeouts, so `npm test` leaves it out.
export default defineConfig({
  test: {
    include: [
      "test/hostile-volume.test.ts",
      "test/hostile-bodies.test.ts",
      "test/hostile-keep.test.ts",
    ],
    globalSetup: ["test/support/global-setup.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 300_000,
    hookTimeout: 120_000,
  },
});
