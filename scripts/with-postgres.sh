#!/usr/bin/env bash
# Run a command with DATABASE_URL pointing at a fresh throwaway Postgres on 127.0.0.1.
# The server is stopped by PID and its directory removed when the command ends.
#   scripts/with-postgres.sh cargo test --workspace
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d /tmp/leasehold-pg.XXXXXX)
cleanup() { "$here/pg.sh" stop "$dir" || true; rm -rf "$dir"; }
trap cleanup EXIT INT TERM
DATABASE_URL=$("$here/pg.sh" start "$dir")
export DATABASE_URL
echo "with-postgres: $DATABASE_URL" >&2
"$@"
