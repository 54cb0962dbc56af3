#!/usr/bin/env bash
# Builds the multicall Kubernetes binary (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kubectl) into $1, skipping the build when the binary is newer
# than this module's sources. Go's own caches (GOCACHE, GOMODCACHE) make a rebuild fast.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:?usage: build.sh OUTPUT}
version=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' go.mod)
if [[ -x "$out" && "$out" -nt go.mod && "$out" -nt go.sum && "$out" -nt main.go ]]; then
  exit 0
fi
minor=${version#v1.}; minor=${minor%%.*}
pkg=k8s.io/component-base/version
ldflags="-s -w -X ${pkg}.gitVersion=${version} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
mkdir -p "$(dirname "$out")"
echo "building Kubernetes ${version} components (cold: tens of minutes on 2 cores)" >&2
CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$out.tmp" .
mv "$out.tmp" "$out"
