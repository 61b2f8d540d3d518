import { defineConfig } from "vitest/config";

// Polyglot client tests (npm run test:polyglot): the Python and Go example
// workers against `leasehold serve` and `leasehold guarded serve`, the
// TypeScript, Python and Go election examples in one election, the Python
// client library's pytest suites and the Go client's `go test -race`. They
// need protoc from Debian (protobuf-compiler, which
// examples/install-toolchains.sh installs when missing), Go 1.26 or later
// installed on the machine (the script checks it; Go modules come from the Go
// module proxy), and the Python client's venv (made from its lock by
// clients/python/scripts/setup.sh, from PyPI), so `npm test`, which needs
// only Node, leaves them out. The setup starts PostgreSQL (embedded unless
// DATABASE_URL is set), then makes the venv and builds the Go worker.
export default defineConfig({
  test: {
    include: ["test/polyglot/**/*.test.ts"],
    globalSetup: ["test/support/global-setup.ts", "test/polyglot/build-setup.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 120_000,
    hookTimeout: 120_000,
  },
});
