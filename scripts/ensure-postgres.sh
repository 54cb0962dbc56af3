#!/usr/bin/env bash
# Install the PostgreSQL server binaries (Debian package) if they are missing.
# Idempotent and fast when already installed. Prints the bin directory.
set -euo pipefail

find_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && [ -x "$d/postgres" ] && { echo "$d"; return 0; }
  done
  return 1
}

if ! bindir=$(find_bindir); then
  echo "ensure-postgres: installing the postgresql package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
  bindir=$(find_bindir)
fi
id postgres >/dev/null 2>&1 || useradd --system --home /var/lib/postgresql --shell /bin/bash postgres
echo "$bindir"
