#!/usr/bin/env bash
# Make sure promtool (Prometheus' rule checker and rule unit-test runner) of the pinned
# version is installed; print its path on stdout. Idempotent and fast when installed:
# the binary is kept as $GOBIN/promtool-$PROMTOOL_VERSION. When missing, it is built from
# source with `go install` (the Go module proxy is the only way in); a few minutes.
set -euo pipefail

PROMTOOL_VERSION=${PROMTOOL_VERSION:-v0.316.0}
export GOBIN="$HOME/go/bin"
pinned="$GOBIN/promtool-$PROMTOOL_VERSION"

if [ -x "$pinned" ] && "$pinned" --version >/dev/null 2>&1; then
  echo "$pinned"
  exit 0
fi

command -v go >/dev/null 2>&1 || PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "ensure-promtool: go not found; cannot build promtool" >&2; exit 1; }
mkdir -p "$GOBIN"

echo "ensure-promtool: building promtool $PROMTOOL_VERSION with go install (a few minutes)" >&2
# Build into a private GOBIN so a promtool of another version on PATH is never overwritten.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
GOBIN="$build" GOFLAGS=-mod=mod go install -trimpath \
  -ldflags "-s -w -X github.com/prometheus/common/version.Version=${PROMTOOL_VERSION#v}" \
  "github.com/prometheus/prometheus/cmd/promtool@$PROMTOOL_VERSION" >&2
mv "$build/promtool" "$pinned"
"$pinned" --version >/dev/null || { echo "ensure-promtool: $pinned does not run" >&2; exit 1; }
echo "$pinned"
