#!/usr/bin/env bash
# Installs the Debian packages the Go example builds with, when any is
# missing (as .ci/run does for Chromium), from Debian's apt repositories.
# The Python side needs none: the Python worker runs on the client library
# in clients/python, whose venv clients/python/scripts/setup.sh makes from
# PyPI (test/polyglot/build-setup.ts runs it).
#
#   protobuf-compiler             protoc, and the well-known types in /usr/include
#   golang-go                     the Go toolchain
#   protoc-gen-go, protoc-gen-go-grpc  Go code generators
#   golang-google-grpc-dev        grpc-go's sources under /usr/share/gocode
#   golang-google-protobuf-dev    google.golang.org/protobuf's sources
#   golang-github-golang-protobuf-1-5-dev
#       named explicitly: golang-google-grpc-dev accepts it or the older 1-3
#       package, and apt picks 1-3 by itself, which predates
#       google.golang.org/protobuf and cannot build what protoc-gen-go 1.28
#       generates.
set -euo pipefail

packages=(
  protobuf-compiler
  golang-go
  protoc-gen-go
  protoc-gen-go-grpc
  golang-google-grpc-dev
  golang-google-protobuf-dev
  golang-github-golang-protobuf-1-5-dev
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
