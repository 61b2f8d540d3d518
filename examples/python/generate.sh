#!/usr/bin/env bash
# Generates the Python stubs of the example worker from proto/ into
# examples/python/gen/ (git-ignored: they depend on the protoc and grpcio of
# the machine), with Debian's protobuf-compiler and protobuf-compiler-grpc.
# The well-known types (google/protobuf/duration.proto, …) come from
# /usr/include, where protobuf-compiler puts them.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/gen"

plugin="$(command -v grpc_python_plugin || true)"
if ! command -v protoc >/dev/null || [ -z "$plugin" ]; then
  echo "protoc or grpc_python_plugin not found: run examples/install-toolchains.sh" >&2
  exit 1
fi

rm -rf "$out"
mkdir -p "$out"
includes=(-I "$root/proto" -I "$root/examples/proto" -I /usr/include)
# Messages of every file; gRPC stubs only of the files that define services.
protoc "${includes[@]}" --python_out="$out" \
  leasehold/v1/lease.proto \
  leasehold/guarded/v1/guarded.proto \
  google/rpc/error_details.proto \
  google/rpc/status.proto
protoc "${includes[@]}" --plugin=protoc-gen-grpc_python="$plugin" --grpc_python_out="$out" \
  leasehold/v1/lease.proto \
  leasehold/guarded/v1/guarded.proto
echo "generated Python stubs in ${out#"$root"/} ($(protoc --version))"
