#!/usr/bin/env bash
# `make e2e`: the end-to-end suite on a real Kubernetes built here from Kubernetes' own
# components (e2e/k8s, e2e/cluster), with the project's images imported into containerd.
#
#   1. dependencies (Debian packages, Helm), the Kubernetes multicall binary (cached),
#      the release binaries and their OCI image archives (cached);
#   2. e2e/cluster/up.sh: etcd, control plane, containerd, kubelet, Postgres, all inside
#      the network namespace leasehold-e2e;
#   3. the e2e test crate (the same one `make e2e-kind` runs) against that cluster;
#   4. e2e/cluster/down.sh, always (LEASEHOLD_E2E_KEEP=1 leaves the cluster up).
#
# Scenario timings (E2E-TIMING lines) are collected into $RUN/timings.txt.
# LEASEHOLD_E2E_FILTER="<substring> [<substring>...]" runs only the scenarios whose names
# contain one of them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=e2e/cluster/lib.sh
. e2e/cluster/lib.sh

[ "$(id -u)" = 0 ] || { echo "e2e.sh: needs root (network namespaces, containerd, kubelet)" >&2; exit 1; }
started=$SECONDS
scripts/ensure-e2e-deps.sh
helm=$(scripts/ensure-helm.sh)
e2e/k8s/build.sh "$K8S_BIN"
log "kubernetes components built ($((SECONDS - started))s)"
# The previous version (the upgrade scenario's starting point), in a target dir of its own.
previous_chart=$(e2e/images/build-previous.sh "$CACHE" "$IMAGES")
log "previous version built ($((SECONDS - started))s)"
cargo build --release --locked --bins
e2e/images/build.sh "$IMAGES"
cargo test -p leasehold-e2e --features e2e --locked --no-run
log "images and test binary built ($((SECONDS - started))s)"

e2e/cluster/down.sh
if [ "${LEASEHOLD_E2E_KEEP:-0}" != 1 ]; then trap 'e2e/cluster/down.sh' EXIT; fi
e2e/cluster/up.sh
log "cluster up ($((SECONDS - started))s)"

# shellcheck disable=SC1090
. "$ENV_FILE"
export LEASEHOLD_E2E_HELM=$helm LEASEHOLD_E2E_CHART=$root/charts/leasehold
export LEASEHOLD_E2E_PREVIOUS_CHART=$previous_chart LEASEHOLD_E2E_PREVIOUS_TAG=previous
# The leader-election scenario runs operator processes of its own beside the chart's.
export LEASEHOLD_E2E_OPERATOR_BIN=${CARGO_TARGET_DIR:-$root/target}/release/leasehold-operator
# LEASEHOLD_E2E_FILTER="<name> [<name>...]" runs only the scenarios whose names contain
# one of them.
read -ra filter <<<"${LEASEHOLD_E2E_FILTER:-}"
# The upgrade scenario installs the previous version's chart, so it runs first, alone, on
# the fresh cluster; every other scenario runs after it, on the chart it upgraded to.
UPGRADE=upgrade_from_previous_chart
rest=()
upgrade=$(( ${#filter[@]} == 0 ))
for f in "${filter[@]}"; do
  if [[ $UPGRADE == *"$f"* ]]; then upgrade=1; else rest+=("$f"); fi
done
run_tests() {
  in_ns cargo test -p leasehold-e2e --features e2e --locked -- "$@" --test-threads=1 --nocapture 2>&1 \
    | tee -a "$RUN/e2e.log"
  return "${PIPESTATUS[0]}"
}
: >"$RUN/e2e.log"
status=0
set +e
if [ "$upgrade" = 1 ]; then
  run_tests "$UPGRADE" --exact || status=$?
fi
if [ ${#filter[@]} = 0 ] || [ ${#rest[@]} -gt 0 ]; then
  run_tests "${rest[@]}" --skip "$UPGRADE" || status=$?
fi
set -e
grep -h '^E2E-TIMING' "$RUN/e2e.log" >"$RUN/timings.txt" || true
log "e2e finished with status $status ($((SECONDS - started))s); timings:"
cat "$RUN/timings.txt" >&2
exit "$status"
