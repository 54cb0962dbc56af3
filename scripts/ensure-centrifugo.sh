#!/usr/bin/env bash
# Make sure Centrifugo (the fan-out peer of the observe bench, issue 20) is installed;
# print the path of its binary on stdout. Idempotent and fast when already installed:
# the binary is kept under a name that carries its pinned version. When missing, it is
# built from its Go module (the Go module proxy is the only way in): about 2 minutes on
# two cores the first time.
set -euo pipefail

CENTRIFUGO_VERSION=v6.9.1
bin_dir="${CENTRIFUGO_GOBIN:-$HOME/go/bin}"
pinned="$bin_dir/centrifugo-$CENTRIFUGO_VERSION"

if [ -x "$pinned" ]; then
  echo "$pinned"
  exit 0
fi

command -v go >/dev/null 2>&1 || PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "ensure-centrifugo: go not found; cannot build centrifugo" >&2; exit 1; }
mkdir -p "$bin_dir"
echo "ensure-centrifugo: building centrifugo $CENTRIFUGO_VERSION (first time only)" >&2
# `go install` names the binary `centrifugo`: install into a private directory, then
# move it under its pinned name (a rename on the same file system: never half-written).
tmp=$(mktemp -d "$bin_dir/.centrifugo-build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# The version is stamped as Centrifugo's release builds do (else `centrifugo version` says
# 0.0.0); the usage-stats endpoint stays unset, so the binary never reports anywhere.
GOBIN="$tmp" go install -trimpath \
  -ldflags "-X github.com/centrifugal/centrifugo/v6/internal/build.Version=${CENTRIFUGO_VERSION#v}" \
  "github.com/centrifugal/centrifugo/v6@$CENTRIFUGO_VERSION" >&2
mv "$tmp/centrifugo" "$pinned"
echo "$pinned"
