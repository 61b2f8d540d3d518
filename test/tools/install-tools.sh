#!/usr/bin/env bash
# Installs the Debian packages the tools suite (npm run test:tools) runs,
# when missing, as examples/install-toolchains.sh does for the polyglot
# examples:
#
#   prometheus    promtool, which lints a live server's /metrics
set -euo pipefail

if command -v promtool >/dev/null; then
  exit 0
fi

missing=(prometheus)
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
