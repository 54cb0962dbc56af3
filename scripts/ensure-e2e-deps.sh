#!/usr/bin/env bash
# What the local e2e cluster needs beyond `make deps`: containerd, runc and the CNI
# plugins from Debian, plus the tools the scripts call. Idempotent; fast when done.
set -euo pipefail

# command -> Debian package
declare -A needs=(
  [containerd]=containerd
  [runc]=runc
  [/usr/lib/cni/bridge]=containernetworking-plugins
  [openssl]=openssl
  [ip]=iproute2
  [nsenter]=util-linux
  [curl]=curl
  [iptables]=iptables
  [gcc]=gcc
)
missing=()
for cmd in "${!needs[@]}"; do
  if [[ $cmd == /* ]]; then [ -e "$cmd" ] || missing+=("${needs[$cmd]}")
  else command -v "$cmd" >/dev/null 2>&1 || missing+=("${needs[$cmd]}"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "ensure-e2e-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi
# Debian's package may start a containerd of its own; ours runs beside it on its own
# socket and state directories, so there is nothing to stop.
