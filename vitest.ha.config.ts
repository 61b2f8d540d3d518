import { defineConfig } from "vitest/config";

// The HA suite (npm run test:ha): Leasehold on Patroni, etcd and HAProxy
// (deploy/ha), under the fault suite's clients and checker. It needs Debian's
// patroni, etcd-server, haproxy and postgresql-15 (test/ha/install-packages.sh,
// run by pretest:ha) and root, to run Patroni as the postgres user; so
// `npm test`, which needs only Node, leaves it out.
export default defineConfig({
  test: {
    include: ["test/ha/**/*.test.ts"],
    globalSetup: ["test/support/ensure-build.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 600_000,
    hookTimeout: 600_000,
  },
});
