#!/usr/bin/env bash
# Installs what idem's tests need on a fresh machine, and nothing when it is already there:
# - redis-server and redis-cli (Debian packages) for the Redis store tests, the Redis
#   Cluster ones included;
# - PostgreSQL server binaries (Debian package) for the PostgreSQL store tests, which
#   start private servers of their own (the cluster the package creates is not started);
# - cargo-deny, for CI's license/ban/source checks;
# - a Python venv at .venv with grpcio, for the interop tests.
# Idempotent; safe to run on every CI run.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi

apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then $SUDO apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server"
  apt_install redis-server
fi
redis-server --version
# redis-cli creates and reshards the Redis Cluster tests' clusters (Debian: redis-tools,
# which redis-server depends on).
if ! command -v redis-cli >/dev/null 2>&1; then
  echo "installing redis-tools (redis-cli)"
  apt_install redis-tools
fi
redis-cli --version

# Debian keeps initdb/postgres in /usr/lib/postgresql/<major>/bin, off PATH; the tests
# look there (or in $PG_BIN).
pg_bin() { { ls -d /usr/lib/postgresql/*/bin 2>/dev/null || true; } | sort -V | tail -n 1; }
if [ -z "${PG_BIN:-}" ] && { [ -z "$(pg_bin)" ] || [ ! -x "$(pg_bin)/initdb" ]; }; then
  echo "installing postgresql"
  # Keep the package from starting its own cluster: a policy-rc.d that says no, only
  # for this install, and only when none is there already.
  policy=/usr/sbin/policy-rc.d
  added_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    added_policy=1
  fi
  apt_install postgresql
  if [ -n "$added_policy" ]; then $SUDO rm -f "$policy"; fi
fi
"${PG_BIN:-$(pg_bin)}/postgres" --version

if [ "${SKIP_CARGO_DENY:-}" = "" ] && ! cargo deny --version >/dev/null 2>&1; then
  echo "installing cargo-deny"
  cargo install --locked cargo-deny
fi

if [ -f tests/interop/requirements.txt ]; then
  if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import grpc, grpc_tools' >/dev/null 2>&1; then
    echo "creating .venv with grpcio"
    if ! python3 -m venv .venv 2>/dev/null; then
      apt_install python3-venv
      python3 -m venv .venv
    fi
    .venv/bin/pip install -q -r tests/interop/requirements.txt
  fi
fi
echo "test dependencies ready"
