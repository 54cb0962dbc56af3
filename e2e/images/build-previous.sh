#!/usr/bin/env bash
# The version the upgrade scenario (`upgrade_from_previous_chart`) upgrades from, built
# from this repository's own history at PREVIOUS_COMMIT:
#   OUTDIR/previous/charts/leasehold    its chart, with its CRD (charts/leasehold/crds)
#   IMAGES/{sidecar,operator,demo-agent}-previous.tar
#                                       docker.io/leasehold/<name>:previous
# Usage: e2e/images/build-previous.sh OUTDIR IMAGES   (prints the chart's path)
#
# Its binaries are built in a target directory of their own (OUTDIR/previous-target):
# cargo names a workspace crate's artifacts by its path *within* the workspace, so two
# checkouts sharing one target directory overwrite each other's crates and each takes
# the other's for fresh (tried: this version's operator then compiled against the
# previous leasehold-crds). The dev profile without debug info builds in about half
# the time of a release build and serves the scenario's light load. Cached: sources,
# binaries and archives are rebuilt only when PREVIOUS_COMMIT changes.
set -euo pipefail

# The last commit before the native sidecar and its CRD changes (status.selector, the
# scale subresource's labelSelectorPath, list-map conditions, topologySpread,
# disruptionBudget): the turn journal's release, whose e2e suite passed at this commit.
PREVIOUS_COMMIT=c144a029e6459e83ad3785a6c27651a77e990f28

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:?usage: e2e/images/build-previous.sh OUTDIR IMAGES}
images=${2:?usage: e2e/images/build-previous.sh OUTDIR IMAGES}
src=$out/previous
bin=$out/previous-bin
target=$out/previous-target

git -C "$repo" cat-file -e "$PREVIOUS_COMMIT^{commit}" 2>/dev/null || {
  echo "e2e/images/build-previous.sh: commit $PREVIOUS_COMMIT is not in this clone (a shallow clone?): the upgrade scenario builds the previous version from the repository's history; fetch it (git fetch --unshallow)" >&2
  exit 1
}

if [[ $(cat "$src/.commit" 2>/dev/null) != "$PREVIOUS_COMMIT" ]]; then
  rm -rf "$src" "$bin"
  mkdir -p "$src"
  git -C "$repo" archive "$PREVIOUS_COMMIT" | tar -x -C "$src"
  echo "$PREVIOUS_COMMIT" >"$src/.commit"
fi

if [[ $(cat "$bin/.commit" 2>/dev/null) != "$PREVIOUS_COMMIT" ]]; then
  (cd "$src" && CARGO_TARGET_DIR=$target CARGO_PROFILE_DEV_DEBUG=0 cargo build --locked \
    -p leasehold-sidecar -p leasehold-operator -p leasehold-demo-agent >&2)
  mkdir -p "$bin"
  for b in leasehold-sidecar leasehold-operator leasehold-demo-agent; do
    cp "$target/debug/$b" "$bin/$b"
  done
  echo "$PREVIOUS_COMMIT" >"$bin/.commit"
fi

LEASEHOLD_E2E_BIN_DIR=$bin LEASEHOLD_E2E_IMAGE_TAG=previous LEASEHOLD_E2E_IMAGES="sidecar operator demo-agent" \
  "$here/build.sh" "$images" >&2
echo "$src/charts/leasehold"
