#!/usr/bin/env bash
# Make sure Dapr's daprd and placement service, pinned at v1.14.0, are installed as
# $GOBIN/daprd-v1.14.0 and $GOBIN/placement-v1.14.0 (GOBIN defaults to ~/go/bin) for the
# side-by-side bench (localcluster/benches/peers_dapr.rs). Idempotent and fast when
# already installed: the binaries carry the pinned version in their names. When missing,
# they are built from the Go module proxy through the wrapper module checked in at
# bench/peers/dapr (go.mod requires github.com/dapr/dapr v1.14.0 and copies the replace
# blocks of dapr's own go.mod; go.sum is committed, -mod=readonly: nothing is
# re-resolved). First build about 3-5 minutes on 2 cores. Prints both paths on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

DAPR_VERSION=v1.14.0
export GOBIN="${DAPR_GOBIN:-$HOME/go/bin}"
daprd="$GOBIN/daprd-$DAPR_VERSION"
placement="$GOBIN/placement-$DAPR_VERSION"

if [ -x "$daprd" ] && [ -x "$placement" ]; then
  echo "$daprd"
  echo "$placement"
  exit 0
fi

command -v go >/dev/null 2>&1 || PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "ensure-dapr: go not found; cannot build dapr" >&2; exit 1; }
module="$here/../bench/peers/dapr"
grep -q "github.com/dapr/dapr $DAPR_VERSION" "$module/go.mod" \
  || { echo "ensure-dapr: $module/go.mod does not pin dapr $DAPR_VERSION" >&2; exit 1; }
mkdir -p "$GOBIN"
echo "ensure-dapr: building daprd and placement $DAPR_VERSION (first time only)" >&2
tmp_daprd="$daprd.tmp.$$"
tmp_placement="$placement.tmp.$$"
trap 'rm -f "$tmp_daprd" "$tmp_placement"' EXIT
export GOFLAGS=-mod=readonly GOTOOLCHAIN=local
# daprd panics at start without a components build tag; stablecomponents registers the
# PostgreSQL state store the bench uses as its actor state store.
(cd "$module" && go build -trimpath -tags stablecomponents -o "$tmp_daprd" github.com/dapr/dapr/cmd/daprd) >&2
(cd "$module" && go build -trimpath -o "$tmp_placement" github.com/dapr/dapr/cmd/placement) >&2
mv "$tmp_daprd" "$daprd"
mv "$tmp_placement" "$placement"
echo "$daprd"
echo "$placement"
