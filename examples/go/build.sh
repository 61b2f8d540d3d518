#!/usr/bin/env bash
# Builds the Go example worker offline, against the Go sources Debian
# packages under /usr/share/gocode (golang-google-grpc-dev,
# golang-google-protobuf-dev and their dependencies), with no module proxy:
#
#   1. protoc + protoc-gen-go + protoc-gen-go-grpc generate the stubs from
#      proto/ into a GOPATH of our own, examples/go/gen/src/leasehold.dev/…
#      (the M options give each .proto file a Go import path: the protos carry
#      no go_package option, since their other users do not need one);
#   2. `go build` runs in GOPATH mode (GO111MODULE=off) with
#      GOPATH=examples/go/gen:/usr/share/gocode, GOPROXY=off and GOFLAGS
#      cleared, so every import resolves to that generated code or to
#      Debian's packaged sources, the way Debian builds its own Go packages.
#
# Output: examples/go/gen/bin/worker (gen/ is git-ignored; the build cache is
# kept in gen/cache so that later builds take a second).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
gen="$here/gen"
gocode=/usr/share/gocode

for tool in go protoc protoc-gen-go protoc-gen-go-grpc; do
  if ! command -v "$tool" >/dev/null; then
    echo "$tool not found: run examples/install-toolchains.sh" >&2
    exit 1
  fi
done
for pkg in google.golang.org/grpc google.golang.org/protobuf; do
  if [ ! -d "$gocode/src/$pkg" ]; then
    echo "$gocode/src/$pkg is missing: run examples/install-toolchains.sh" >&2
    exit 1
  fi
done

rm -rf "$gen/src" "$gen/bin"
mkdir -p "$gen/src" "$gen/bin"
prefix=leasehold.dev/examples/gen
mapping="Mleasehold/v1/lease.proto=$prefix/leasehold/v1;leasev1"
mapping+=",Mleasehold/guarded/v1/guarded.proto=$prefix/leasehold/guarded/v1;guardedv1"
mapping+=",Mgoogle/rpc/error_details.proto=$prefix/google/rpc/errdetails;errdetails"
protoc -I "$root/proto" -I /usr/include \
  --go_out="$gen/src" --go_opt="$mapping" \
  --go-grpc_out="$gen/src" --go-grpc_opt="$mapping" \
  leasehold/v1/lease.proto leasehold/guarded/v1/guarded.proto google/rpc/error_details.proto

unformatted="$(gofmt -l "$here"/*.go)"
if [ -n "$unformatted" ]; then
  echo "not gofmt'ed: $unformatted" >&2
  exit 1
fi

export GO111MODULE=off GOPROXY=off GOFLAGS= GOPATH="$gen:$gocode" GOCACHE="$gen/cache"
cd "$here"
go vet .
go build -o "$gen/bin/worker" .
echo "built ${gen#"$root"/}/bin/worker ($(go version | cut -d' ' -f3), $(protoc --version))"
