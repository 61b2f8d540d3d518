#!/usr/bin/env bash
# Generates the Go stubs under clients/go/gen from proto/ with buf (from
# node_modules) and protoc-gen-go / protoc-gen-go-grpc at the versions pinned
# in clients/go/tools/go.mod, installed into clients/go/.bin. The stubs are
# committed; .ci/run checks that this leaves them unchanged.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
(cd "$here/tools" && GOBIN="$here/.bin" go install tool)
cd "$root"
PATH="$here/.bin:$PATH" npx --no-install buf generate --template clients/go/buf.gen.yaml
