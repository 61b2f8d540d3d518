import { defineConfig } from "vitest/config";

// Tests that check the server's output with other projects' tools
// (npm run test:tools): promtool, from Debian's prometheus package, lints
// /metrics. `npm test` needs only Node, so they run apart; the npm script's
// pre-script installs the packages when missing (test/tools/install-tools.sh).
export default defineConfig({
  test: {
    include: ["test/tools/**/*.test.ts"],
    globalSetup: ["test/support/global-setup.ts"],
    pool: "forks",
    testTimeout: 60_000,
    hookTimeout: 60_000,
  },
});
