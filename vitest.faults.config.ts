import { defineConfig } from "vitest/config";

// The fault suite (test/faults/): its own PostgreSQL and server processes,
// run one file at a time so faults of one file never land on another.
export default defineConfig({
  test: {
    include: ["test/faults/**/*.test.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 600_000,
    hookTimeout: 120_000,
  },
});
