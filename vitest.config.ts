import { defineConfig } from "vitest/config";

// `npm test` runs two projects, one after the other (sequence.groupOrder):
// the unit and integration tests on one shared embedded PostgreSQL, then the
// fault suite (test/faults/), which starts its own PostgreSQL and server
// processes and injects faults into them, so it must not share the machine's
// two cores with the first project. The browser tests and the polyglot client
// tests have their own configs (vitest.e2e.config.ts, vitest.polyglot.config.ts):
// they need Debian's Chromium, and Debian's protoc, grpcio and Go; and so has
// the tools suite (vitest.tools.config.ts), for Debian's promtool. So has the
// hostile volume suite (vitest.hostile.config.ts, npm run test:hostile): it
// takes minutes and measures its servers' memory. And so has the HA suite
// (vitest.ha.config.ts, npm run test:ha): Patroni, etcd and HAProxy from Debian.
// And the scale check (vitest.scale.config.ts, npm run test:scale): 10,000
// leases kept alive, tens of seconds on two cores.
export default defineConfig({
  test: {
    projects: [
      {
        test: {
          name: "unit",
          include: ["test/**/*.test.ts"],
          exclude: [
            "test/faults/**",
            "test/e2e/**",
            "test/polyglot/**",
            "test/tools/**",
            "test/ha/**",
            "test/hostile-volume.test.ts",
            "test/scale/**",
            "test/hostile-bodies.test.ts",
            "test/hostile-keep.test.ts",
            "node_modules/**",
          ],
          globalSetup: ["test/support/global-setup.ts"],
          pool: "forks",
          testTimeout: 60_000,
          hookTimeout: 60_000,
          sequence: { groupOrder: 0 },
        },
      },
      {
        test: {
          name: "faults",
          include: ["test/faults/**/*.test.ts"],
          globalSetup: ["test/support/ensure-build.ts"],
          pool: "forks",
          // One file at a time, so faults of one file never land on another.
          fileParallelism: false,
          testTimeout: 600_000,
          hookTimeout: 120_000,
          sequence: { groupOrder: 1 },
        },
      },
    ],
  },
});
