#!/usr/bin/env bash
# Static checks of the Go client, as .ci/run runs them: the stubs under gen/
# are what generate.sh makes from proto/ now, the code is gofmt'ed, and
# `go vet` and staticcheck (pinned in tools/go.mod) find nothing. The tests
# (`go test -race ./...`) need real servers and PostgreSQL: `npm run
# test:polyglot` runs them (test/polyglot/go-client.test.ts).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$here"
./generate.sh
if ! git -C "$root" diff --exit-code --stat -- clients/go/gen || [ -n "$(git -C "$root" status --porcelain -- clients/go/gen)" ]; then
  echo "clients/go/gen differs from generate.sh's output: run clients/go/generate.sh and commit the result" >&2
  exit 1
fi
unformatted="$(gofmt -l .)"
if [ -n "$unformatted" ]; then
  echo "not gofmt'ed: $unformatted" >&2
  exit 1
fi
go mod verify >/dev/null
go vet ./...
.bin/staticcheck ./...
echo "clients/go: stubs fresh, gofmt, go vet and staticcheck clean ($(go version | cut -d' ' -f3))"
