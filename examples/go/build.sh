#!/usr/bin/env bash
# Builds the Go example worker on the Go client module (clients/go, through
# the replace directive of go.mod) into examples/go/gen/bin/worker, the
# binary test/polyglot/ runs, and the election example (election/) into
# examples/go/gen/bin/election. Dependencies come from the Go module proxy (or
# the module cache), checked against go.sum.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$here"
unformatted="$(gofmt -l .)"
if [ -n "$unformatted" ]; then
  echo "not gofmt'ed: $unformatted" >&2
  exit 1
fi
go vet ./...
go build -o gen/bin/worker .
go build -o gen/bin/election ./election
echo "built ${here#"$root"/}/gen/bin/worker and election ($(go version | cut -d' ' -f3))"
