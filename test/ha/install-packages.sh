#!/usr/bin/env bash
# Installs the Debian packages the HA suite runs (npm run test:ha), when any
# is missing, and makes sure the `15/main` cluster that postgresql-15's
# package creates is stopped and does not start again: the suite's members
# have their own folders and ports, and nothing may come to depend on a
# PostgreSQL on 5432 that the suite does not manage.
#
#   patroni        3.0.2, the cluster manager (its etcd3 section speaks etcd's
#                  v3 gRPC gateway over HTTP, with no further package)
#   etcd-server    3.4, the DCS (three members)
#   etcd-client    etcdctl, to tell the members' health
#   haproxy        2.6, routes to the member whose REST API answers /primary
#   postgresql-15  the members' binaries (/usr/lib/postgresql/15/bin)
set -euo pipefail

packages=(patroni etcd-server etcd-client haproxy postgresql-15)

missing=()
for pkg in "${packages[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$pkg")
  fi
done

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "the HA suite runs Patroni as the postgres user: run it as root (or with sudo)" >&2
    exit 1
  fi
  sudo=(sudo)
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The package lists are refreshed once, only if installing from the lists
  # at hand fails.
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  fi
fi

# Debian's packages may start their own daemons on install (etcd on 2379,
# haproxy on its default config, the 15/main cluster on 5432). The suite
# runs its own, on other ports; stop the packaged ones and keep them from
# starting at boot.
if command -v pg_lsclusters >/dev/null && pg_lsclusters -h 2>/dev/null | awk '$1 == 15 && $2 == "main"' | grep -q .; then
  if pg_lsclusters -h | awk '$1 == 15 && $2 == "main" && $4 == "online"' | grep -q .; then
    "${sudo[@]}" pg_ctlcluster 15 main stop
  fi
  # start.conf "disabled": neither pg_ctlcluster nor the systemd generator
  # starts it again.
  if [ -w /etc/postgresql/15/main/start.conf ] || [ ${#sudo[@]} -gt 0 ]; then
    echo disabled | "${sudo[@]}" tee /etc/postgresql/15/main/start.conf >/dev/null
  fi
fi
for unit in etcd haproxy patroni; do
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    "${sudo[@]}" systemctl disable --now "$unit" >/dev/null 2>&1 || true
  fi
done
