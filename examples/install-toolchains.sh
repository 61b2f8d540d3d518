#!/usr/bin/env bash
# Installs the Debian packages the polyglot tests build with, when any is
# missing (as .ci/run does for Chromium), and checks the Go toolchain: the
# Go client (clients/go) and examples/go are Go modules built with the Go
# this machine has (1.26 or later; Debian's golang-go is older), their
# dependencies from the Go module proxy. The Python side needs no Debian
# package: the Python worker runs on the client library in clients/python,
# whose venv clients/python/scripts/setup.sh makes from PyPI
# (test/polyglot/build-setup.ts runs it).
#
#   protobuf-compiler             protoc, and the well-known types in /usr/include
set -euo pipefail

# Go: the module's go.mod asks for 1.26; an older go would try to fetch a
# newer toolchain, which these machines cannot.
if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then
  export PATH="$PATH:/usr/local/go/bin"
fi
go_version="$(go env GOVERSION 2>/dev/null || true)"
if [[ ! "$go_version" =~ ^go1\.(2[6-9]|[3-9][0-9]) ]]; then
  echo "Go 1.26 or later is needed for clients/go and examples/go, found: ${go_version:-no go on PATH}" >&2
  exit 1
fi

packages=(
  protobuf-compiler
)

missing=()
for pkg in "${packages[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "installing Debian packages: ${missing[*]}"
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "missing Debian packages (${missing[*]}): run as root, or install them with" >&2
    echo "  apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
# Try with the package lists at hand first; refresh them only if that fails.
if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
  "${sudo[@]}" apt-get update
  "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi
