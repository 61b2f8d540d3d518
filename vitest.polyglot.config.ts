import { configDefaults, defineConfig } from "vitest/config";

// Polyglot client tests (npm run test:polyglot): the Python and Go example
// workers against `leasehold serve` and `leasehold guarded serve`, the
// Python client library's pytest suites and the Go client's `go test -race`
// (the TypeScript, Python and Go election examples in one election run with
// npm run test:elections, below). They need protoc from Debian (protobuf-compiler, which
// examples/install-toolchains.sh installs when missing), Go 1.26 or later
// installed on the machine (the script checks it; Go modules come from the Go
// module proxy), and the Python client's venv (made from its lock by
// clients/python/scripts/setup.sh, from PyPI), so `npm test`, which needs
// only Node, leaves them out. The setup starts PostgreSQL (embedded unless
// DATABASE_URL is set), then makes the venv and builds the Go worker.
//
// The election examples' test (test/polyglot/elections.test.ts) runs with
// `npm run test:elections` (LEASEHOLD_ELECTION_EXAMPLES=1) and is not yet in
// this suite's default run: in one clean-clone run of 12, a TypeScript replica
// reported a term lost within half a second of its grant, where a SIGTERM
// should have cancelled it; until that is explained it would make CI fail
// for a reason nobody can name (docs/testing.md).
export default defineConfig({
  test: {
    include: ["test/polyglot/**/*.test.ts"],
    exclude: process.env.LEASEHOLD_ELECTION_EXAMPLES
      ? configDefaults.exclude
      : [...configDefaults.exclude, "test/polyglot/elections.test.ts"],
    globalSetup: ["test/support/global-setup.ts", "test/polyglot/build-setup.ts"],
    pool: "forks",
    fileParallelism: false,
    testTimeout: 120_000,
    hookTimeout: 120_000,
  },
});
