#!/usr/bin/env bash
# The TypeScript SDK's whole check: install (npm ci, skipped while node_modules matches
# package-lock.json), build with tsc (strict), lint (eslint + typescript-eslint), then the
# tests with node's test runner against real leasehold-sidecar processes and a throwaway
# Postgres (scripts/with-postgres.sh, unless DATABASE_URL is already set).
#
#   sdk/typescript/run-tests.sh                       # binaries from <repo>/target/debug
#   LEASEHOLD_BIN_DIR=/path/to/bins sdk/typescript/run-tests.sh
#   sdk/typescript/run-tests.sh dist/test/stream.test.js   # some test files only
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$here"

major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if [ "$major" -lt 20 ]; then
  echo "run-tests: Node >= 20 is required (found $(node --version 2>/dev/null || echo none))" >&2
  exit 1
fi

# npm ci wipes node_modules; do it only when the lock file changed since the last one.
stamp=node_modules/.leasehold-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  npm ci --no-audit --no-fund
  echo "$want" >"$stamp"
fi

rm -rf dist
npx tsc -p tsconfig.json
npx eslint .
python3 "$repo/docs/check-snippets.py" sdk/typescript  # the docs' snippets are still the examples

export LEASEHOLD_BIN_DIR=${LEASEHOLD_BIN_DIR:-$repo/target/debug}
for bin in leasehold-sidecar; do
  if [ ! -x "$LEASEHOLD_BIN_DIR/$bin" ]; then
    echo "run-tests: $LEASEHOLD_BIN_DIR/$bin is missing (cargo build --workspace --bins, or set LEASEHOLD_BIN_DIR)" >&2
    exit 1
  fi
done

if [ "$#" -gt 0 ]; then files=("$@"); else files=(dist/test/*.test.js); fi
# One test file at a time (each starts its own sidecars; the fault tests time TTLs).
run=(node --test --test-concurrency=1 --test-timeout=180000 "${files[@]}")
if [ -n "${DATABASE_URL:-}" ]; then
  "${run[@]}"
else
  "$repo/scripts/with-postgres.sh" "${run[@]}"
fi
