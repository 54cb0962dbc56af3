#!/usr/bin/env bash
# The e2e suite on kind, for hosts with a Docker engine (scripts/e2e.sh is the path
# without Docker). Steps:
#   1. kind cluster `leasehold-e2e` from e2e/kind/cluster.yaml (reused if it exists);
#      its kubeconfig goes to target/e2e-kind/kubeconfig, ~/.kube/config is untouched
#   2. docker build docker/{sidecar,operator,demo-agent}.Dockerfile as
#      docker.io/leasehold/<name>:e2e, and sdk/python (the Python reference agent) as
#      docker.io/leasehold/python-agent:e2e, and `kind load docker-image` each
#   3. Postgres 15 as container leasehold-e2e-pg on the `kind` network, published on
#      127.0.0.1:55432 for the tests, reached by pods as leasehold-e2e-pg:5432
#   4. cargo test -p leasehold-e2e --features e2e --locked -- --test-threads=1 (all but the
#      upgrade scenario, which needs the previous version's images: `make e2e` runs it)
# On exit the cluster and the Postgres container are removed unless LEASEHOLD_E2E_KEEP=1.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cluster=leasehold-e2e
pg=leasehold-e2e-pg
pg_port=${LEASEHOLD_E2E_PG_PORT:-55432}
pg_password=${LEASEHOLD_E2E_PG_PASSWORD:-leasehold-e2e}
tag=e2e
work=${CARGO_TARGET_DIR:-$root/target}/e2e-kind
kubeconfig=$work/kubeconfig

for tool in docker kind helm kubectl cargo; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: $tool not found on PATH (needs docker, kind, helm, kubectl, cargo)" >&2; exit 1; }
done
docker info >/dev/null 2>&1 || { echo "e2e-kind: the Docker engine does not answer (docker info failed)" >&2; exit 1; }

teardown() {
  local rc=$?
  if [[ ${LEASEHOLD_E2E_KEEP:-0} == 1 ]]; then
    echo "e2e-kind: kept cluster $cluster (KUBECONFIG=$kubeconfig) and container $pg" >&2
  else
    docker rm -f "$pg" >/dev/null 2>&1 || true
    kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

mkdir -p "$work"
if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  echo "e2e-kind: reusing kind cluster $cluster"
  kind export kubeconfig --name "$cluster" --kubeconfig "$kubeconfig"
else
  kind create cluster --config e2e/kind/cluster.yaml --kubeconfig "$kubeconfig" --wait 120s
fi

for img in sidecar operator demo-agent; do
  docker build -f "docker/$img.Dockerfile" -t "docker.io/leasehold/$img:$tag" .
  kind load docker-image --name "$cluster" "docker.io/leasehold/$img:$tag"
done
docker build -t "docker.io/leasehold/python-agent:$tag" sdk/python
kind load docker-image --name "$cluster" "docker.io/leasehold/python-agent:$tag"

docker rm -f "$pg" >/dev/null 2>&1 || true
docker run -d --name "$pg" --network kind -e POSTGRES_PASSWORD="$pg_password" \
  -p "127.0.0.1:$pg_port:5432" postgres:15 >/dev/null
# The image's init server listens on the unix socket only; TCP answers once it is really up.
for _ in $(seq 120); do
  docker exec "$pg" pg_isready -q -h 127.0.0.1 -U postgres && break
  sleep 1
done
docker exec "$pg" pg_isready -q -h 127.0.0.1 -U postgres ||
  { echo "e2e-kind: Postgres ($pg) did not become ready" >&2; docker logs --tail 20 "$pg" >&2; exit 1; }

export KUBECONFIG=$kubeconfig
export LEASEHOLD_E2E_DATABASE_URL=postgres://postgres:$pg_password@127.0.0.1:$pg_port/postgres
export LEASEHOLD_E2E_POD_DATABASE_URL=postgres://postgres:$pg_password@$pg:5432
export LEASEHOLD_E2E_IMAGE_TAG=$tag
export LEASEHOLD_E2E_CHART=charts/leasehold
# The leader-election scenario runs operator processes of its own, on this host.
cargo build --release --locked -p leasehold-operator
export LEASEHOLD_E2E_OPERATOR_BIN=${CARGO_TARGET_DIR:-$root/target}/release/leasehold-operator
# The upgrade scenario needs the previous version's images and a cluster without
# leasehold; `make e2e` (scripts/e2e.sh) builds them and runs it first.
cargo test -p leasehold-e2e --features e2e --locked -- --test-threads=1 --skip upgrade_from_previous_chart
