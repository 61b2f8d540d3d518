#!/usr/bin/env bash
# Creates clients/python/.venv (git-ignored) from requirements-dev.lock, the
# hash-pinned lock of the package's runtime, fence extra and development
# tools, and installs the package into it in editable mode. Idempotent: a
# venv already made from the current lock is left as it is. Needs only a
# Python 3.11+ interpreter and pip (PyPI reached through pip's own client).
#
# The lock is made with uv (not needed here):
#   uv pip compile pyproject.toml --extra dev --extra fence --python-version 3.11 \
#     --generate-hashes -o requirements-dev.lock
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="$here/.venv"
python="${LEASEHOLD_PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null &&
      "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
      python="$candidate"
      break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "clients/python needs Python 3.11 or later (set LEASEHOLD_PYTHON to its interpreter)" >&2
  exit 1
fi

stamp="$venv/.lock-sha256"
want="$(sha256sum "$here/requirements-dev.lock" "$here/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --require-hashes --no-deps -r "$here/requirements-dev.lock"
# The package itself, editable and without dependencies (the lock has them).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --no-deps --no-build-isolation -e "$here"
echo "$want" >"$stamp"
echo "clients/python/.venv made from requirements-dev.lock ($("$venv/bin/python" --version))"
