#!/usr/bin/env bash
# Writes the e2e container images as OCI image archives into OUTDIR, without Docker:
#   sidecar.tar     docker.io/leasehold/sidecar:e2e      (target/release/leasehold-sidecar)
#   operator.tar    docker.io/leasehold/operator:e2e     (target/release/leasehold-operator)
#   demo-agent.tar  docker.io/leasehold/demo-agent:e2e   (target/release/leasehold-demo-agent)
#   pause.tar       docker.io/leasehold/pause:e2e        (pause.c, gcc -static -Os)
# Load one with `ctr -n k8s.io images import OUTDIR/sidecar.tar`.
# The release binaries must already exist (`cargo build --release --locked --bins`).
# Each rootfs is the binary at /usr/local/bin plus every library ldd lists (same paths,
# loader included), /etc/passwd + /etc/group (root, nonroot 65532), the CA bundle, /tmp.
# An archive is rewritten only when a hash of its inputs (stored as NAME.tar.inputs)
# changes, so a second run is fast.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:?usage: e2e/images/build.sh OUTDIR}
bindir=${CARGO_TARGET_DIR:-$repo/target}/release
tag=${LEASEHOLD_E2E_IMAGE_TAG:-e2e}
PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CA=/etc/ssl/certs/ca-certificates.crt

for tool in python3 ldd gcc sha256sum; do
  command -v "$tool" >/dev/null || { echo "e2e/images/build.sh: $tool not found on PATH" >&2; exit 1; }
done
for b in leasehold-sidecar leasehold-operator leasehold-demo-agent; do
  [[ -x $bindir/$b ]] || {
    echo "e2e/images/build.sh: missing $bindir/$b; run 'cargo build --release --locked --bins' first" >&2
    exit 1
  }
done

mkdir -p "$out"
out=$(cd "$out" && pwd)
stage=$(mktemp -d "$out/.stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

# inputs_hash WORDS... -- FILES...: one hash over the words and the files' paths + contents.
inputs_hash() {
  local words=() files=()
  while [[ $# -gt 0 && $1 != -- ]]; do words+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  files=("$@")
  { printf '%s\n' "${words[@]}"; sha256sum "$here/build.sh" "$here/oci_archive.py" "${files[@]}"; } |
    sha256sum | cut -d' ' -f1
}

# up_to_date ARCHIVE HASH
up_to_date() { [[ -f $1 && -f $1.inputs && $(<"$1.inputs") == "$2" ]]; }

# The absolute paths of the shared objects a binary loads (the loader included).
shared_libs() {
  local line
  ldd "$1" | while read -r line; do
    case $line in
      *"=> not found"*) echo "e2e/images/build.sh: $1 needs ${line%% *}, not found" >&2; return 1 ;;
      *"=> /"*) line=${line#*=> }; echo "${line%% (*}" ;;
      /*) echo "${line%% (*}" ;;
    esac
  done
}

base_rootfs() {
  local root=$1
  mkdir -p "$root/etc" "$root/tmp" "$root/usr/local/bin" "$root/home/nonroot"
  chmod 1777 "$root/tmp"
  printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
    'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$root/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$root/etc/group"
  printf '%s\n' 'hosts: files dns' >"$root/etc/nsswitch.conf"
  chmod 0644 "$root/etc/passwd" "$root/etc/group" "$root/etc/nsswitch.conf"
  if [[ -f $CA ]]; then install -D -m 0644 "$CA" "$root$CA"; fi
}

# binary_image SHORTNAME BINARY
binary_image() {
  local short=$1 bin=$bindir/$2 name=docker.io/leasehold/$1:$tag archive=$out/$1.tar
  local libs hash root lib ca=()
  libs=$(shared_libs "$bin") || exit 1
  [[ -f $CA ]] && ca=("$CA")
  # shellcheck disable=SC2086 # libs: one absolute path per line, no spaces
  hash=$(inputs_hash "$name" "$2" $libs -- "$bin" $libs "${ca[@]}")
  if up_to_date "$archive" "$hash"; then
    echo "$archive: up to date"
    return
  fi
  root=$stage/$short
  base_rootfs "$root"
  install -m 0755 "$bin" "$root/usr/local/bin/$2"
  for lib in $libs; do
    install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
  done
  python3 "$here/oci_archive.py" --rootfs "$root" --name "$name" \
    --entrypoint "/usr/local/bin/$2" --user 65532:65532 \
    --env "$PATH_ENV" --env "SSL_CERT_FILE=$CA" --out "$archive"
  echo "$hash" >"$archive.inputs"
}

pause_image() {
  local name=docker.io/leasehold/pause:$tag archive=$out/pause.tar hash root
  hash=$(inputs_hash "$name" "$(gcc --version | head -n1)" -- "$here/pause.c")
  if up_to_date "$archive" "$hash"; then
    echo "$archive: up to date"
    return
  fi
  root=$stage/pause
  mkdir -p "$root"
  gcc -static -Os -s -Wall -Werror -o "$root/pause" "$here/pause.c"
  python3 "$here/oci_archive.py" --rootfs "$root" --name "$name" \
    --entrypoint /pause --user 65535:65535 --out "$archive"
  echo "$hash" >"$archive.inputs"
}

binary_image sidecar leasehold-sidecar
binary_image operator leasehold-operator
binary_image demo-agent leasehold-demo-agent
pause_image
