#!/usr/bin/env bash
# Make sure Jaeger all-in-one (a real OpenTelemetry collector and trace store, for the
# tracing test) is installed; print the path of its binary on stdout. Idempotent and
# fast when already installed: the binary is kept under a name that carries its pinned
# version. When missing, it is built from its Go module's source (the Go module proxy
# is the only way in); that takes several minutes the first time.
set -euo pipefail

JAEGER_VERSION=v1.76.0
export GOBIN="${JAEGER_GOBIN:-$HOME/go/bin}"
pinned="$GOBIN/jaeger-all-in-one-$JAEGER_VERSION"

if [ -x "$pinned" ]; then
  echo "$pinned"
  exit 0
fi

command -v go >/dev/null 2>&1 || PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "ensure-jaeger: go not found; cannot build jaeger" >&2; exit 1; }
mkdir -p "$GOBIN"
echo "ensure-jaeger: building jaeger all-in-one $JAEGER_VERSION (first time only)" >&2
# `go install module@version` refuses Jaeger: its go.mod has replace directives, which
# hold only for the main module. So: fetch the module's source from the proxy and build
# it as the main module, with its own go.sum (-mod=readonly: nothing is re-resolved).
src=$(go mod download -json "github.com/jaegertracing/jaeger@$JAEGER_VERSION" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$src" ] || { echo "ensure-jaeger: could not fetch jaeger $JAEGER_VERSION" >&2; exit 1; }
tmp="$pinned.tmp.$$"
trap 'rm -f "$tmp"' EXIT
(cd "$src" && GOFLAGS=-mod=readonly go build -trimpath -o "$tmp" ./cmd/all-in-one) >&2
mv "$tmp" "$pinned"
echo "$pinned"
