#!/usr/bin/env bash
# Installs what idem's tests need on a fresh machine, and nothing when it is already there:
# - redis-server (Debian package) for the Redis store tests;
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
