// A check of the suites' histories by a linearizability checker from outside
// the project (docs/testing.md); its own module, so Porcupine stays out of the
// client library's module graph.
module leasehold.dev/test/faults/porcupine

go 1.26.0

require github.com/anishathalye/porcupine v1.3.1
