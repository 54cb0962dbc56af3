#!/usr/bin/env bash
# Make sure Helm v3 is installed; print the path of the helm binary on stdout.
# Idempotent and fast when already installed. When missing, it is built from source
# with `go install` (the Go module proxy is the only way in); that takes a few minutes.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.19.0}
export GOBIN="$HOME/go/bin"

# Succeeds when $1 is an executable Helm of major version 3.
is_helm3() {
  [ -x "$1" ] || return 1
  case "$("$1" version --short 2>/dev/null)" in
    v3.*) return 0 ;;
    *) return 1 ;;
  esac
}

find_helm() {
  local candidate
  for candidate in "$(command -v helm 2>/dev/null || true)" "$GOBIN/helm" /usr/local/bin/helm; do
    [ -n "$candidate" ] && is_helm3 "$candidate" && { echo "$candidate"; return 0; }
  done
  return 1
}

if helm=$(find_helm); then
  echo "$helm"
  exit 0
fi

command -v go >/dev/null 2>&1 || PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "ensure-helm: go not found; cannot build helm" >&2; exit 1; }
mkdir -p "$GOBIN"

# go install alone leaves helm's version and its default Kubernetes version (used by
# `helm template` and `helm lint`) at placeholders ("v3.19", v1.20.0); set them the way
# helm's own Makefile does, the Kubernetes one from the client-go that helm requires.
build_helm() {
  local version=$1 gomod client_go minor
  gomod=$(GOFLAGS=-mod=mod go mod download -json "helm.sh/helm/v3@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
  [ -n "$gomod" ] && [ -f "$gomod" ] || return 1
  client_go=$(awk '$1 == "k8s.io/client-go" { print $2; exit }' "$gomod")
  minor=$(echo "$client_go" | cut -d. -f2)
  local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
  if [ -n "$minor" ]; then
    local pkg
    for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
      ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
    done
  fi
  echo "ensure-helm: building helm $version with go install (a few minutes)" >&2
  GOFLAGS=-mod=mod go install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$version" >&2
}

if ! build_helm "$HELM_VERSION"; then
  # That exact version is not available: fall back to the newest v3 release.
  latest=$(go list -m -versions helm.sh/helm/v3 | tr ' ' '\n' | grep -E '^v3\.[0-9]+\.[0-9]+$' | sort -V | tail -1)
  [ -n "$latest" ] || { echo "ensure-helm: no helm v3 release found on the module proxy" >&2; exit 1; }
  echo "ensure-helm: helm $HELM_VERSION failed; trying $latest instead" >&2
  build_helm "$latest"
fi

is_helm3 "$GOBIN/helm" || { echo "ensure-helm: $GOBIN/helm is not a working helm v3" >&2; exit 1; }
echo "$GOBIN/helm"
