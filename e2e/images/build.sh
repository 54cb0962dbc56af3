#!/usr/bin/env bash
# Writes the e2e container images as OCI image archives into OUTDIR, without Docker:
#   sidecar.tar     docker.io/leasehold/sidecar:e2e      (target/release/leasehold-sidecar)
#   operator.tar    docker.io/leasehold/operator:e2e     (target/release/leasehold-operator)
#   demo-agent.tar  docker.io/leasehold/demo-agent:e2e   (target/release/leasehold-demo-agent)
#   pause.tar       docker.io/leasehold/pause:e2e        (pause.c, gcc -static -Os)
#   python-agent.tar docker.io/leasehold/python-agent:e2e (the host's Python 3.11, the SDK,
#                   sdk/python/examples/demo_agent.py; see python_agent_image)
# Load one with `ctr -n k8s.io images import OUTDIR/sidecar.tar`.
# The release binaries must already exist (`cargo build --release --locked --bins`), in
# $CARGO_TARGET_DIR/release or LEASEHOLD_E2E_BIN_DIR. LEASEHOLD_E2E_IMAGE_TAG other than
# `e2e` names the archives NAME-TAG.tar; LEASEHOLD_E2E_IMAGES picks which images to write
# (default: all five). e2e/images/build-previous.sh writes the previous version's so.
# Each rootfs is the binary at /usr/local/bin plus every library ldd lists (same paths,
# loader included), /etc/passwd + /etc/group (root, nonroot 65532), the CA bundle, /tmp.
# An archive is rewritten only when a hash of its inputs (stored as NAME.tar.inputs)
# changes, so a second run is fast.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:?usage: e2e/images/build.sh OUTDIR}
bindir=${LEASEHOLD_E2E_BIN_DIR:-${CARGO_TARGET_DIR:-$repo/target}/release}
tag=${LEASEHOLD_E2E_IMAGE_TAG:-e2e}
read -ra images <<<"${LEASEHOLD_E2E_IMAGES:-sidecar operator demo-agent pause python-agent}"
PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CA=/etc/ssl/certs/ca-certificates.crt

for tool in python3 ldd gcc sha256sum tar; do
  command -v "$tool" >/dev/null || { echo "e2e/images/build.sh: $tool not found on PATH" >&2; exit 1; }
done
# wanted NAME: whether LEASEHOLD_E2E_IMAGES asks for the image NAME.
wanted() { [[ " ${images[*]} " == *" $1 "* ]]; }

# archive_of NAME: the archive of the image NAME at this tag.
archive_of() { if [[ $tag == e2e ]]; then echo "$out/$1.tar"; else echo "$out/$1-$tag.tar"; fi; }

for short in sidecar operator demo-agent; do
  b=leasehold-$short
  wanted "$short" || continue
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
  local short=$1 bin=$bindir/$2 name=docker.io/leasehold/$1:$tag archive
  wanted "$short" || return 0
  archive=$(archive_of "$short")
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
  local name=docker.io/leasehold/pause:$tag archive hash root
  wanted pause || return 0
  archive=$(archive_of pause)
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

# The interpreter of the python-agent image: LEASEHOLD_E2E_PYTHON, else the system's
# /usr/bin/python3.11 (Debian's), else python3.11 on PATH; its real path on stdout.
python_interpreter() {
  local py=${LEASEHOLD_E2E_PYTHON:-}
  if [[ -z $py ]]; then
    if [[ -x /usr/bin/python3.11 ]]; then py=/usr/bin/python3.11; else py=$(command -v python3.11 || true); fi
  fi
  [[ -n $py ]] || { echo "e2e/images/build.sh: no python3.11 (set LEASEHOLD_E2E_PYTHON)" >&2; return 1; }
  "$py" -c 'import os, sys
if sys.version_info < (3, 11): sys.exit(f"{sys.executable} is Python {sys.version.split()[0]}; the SDK needs >= 3.11")
print(os.path.realpath(sys.executable))' || { echo "e2e/images/build.sh: $py is not a usable Python >= 3.11" >&2; return 1; }
}

# Extension modules of the stdlib the agent never loads (and whose libraries would come
# along): test modules, curses, readline, dbm, NIS, sqlite, Tk, audio, crypt.
DYNLOAD_SKIP='^(_test|_xx|xxlimited|_ctypes_test|_curses|readline|_dbm|_gdbm|nis|ossaudiodev|_sqlite3|_tkinter|audioop|_crypt|spwd)'
# Parts of the stdlib left out of the image: test suites, IDLE, Tk, the turtle, lib2to3,
# distutils, ensurepip, venv, pydoc's data, curses and sqlite3 (their modules are left
# out above), the static library and Makefile under config-*, installed packages, the
# Debian sitecustomize hook, and the byte code (compiled again below).
STDLIB_SKIP=(__pycache__ test tests idle_test idlelib tkinter turtledemo turtle.py lib2to3 distutils
  ensurepip venv pydoc_data curses sqlite3 'config-*' site-packages dist-packages sitecustomize.py
  EXTERNALLY-MANAGED lib-dynload)

# python_agent_image: the Python reference agent. The rootfs holds the host's Python
# interpreter at its own path (so it finds its stdlib as on the host) with every library
# ldd lists for it and for the extension modules kept, the stdlib without STDLIB_SKIP,
# the SDK and its runtime dependencies installed by pip into /app/site-packages at the
# versions of python-agent-constraints.txt (from PyPI, on a rebuild only), and
# /app/examples/demo_agent.py, the entrypoint; /usr/local/bin/python3 links to the
# interpreter. Everything is byte-compiled into unchecked-hash .pyc files: the layer's
# mtimes are 0 and the container cannot write a cache, so timestamp-checked .pyc would
# be compiled again at every start.
python_agent_image() {
  local name=docker.io/leasehold/python-agent:$tag archive
  wanted python-agent || return 0
  archive=$(archive_of python-agent)
  local constraints=$here/python-agent-constraints.txt sdk=$repo/sdk/python
  local py info exe stdlib dynload mods libs lib mod hash root site listing pip_version dist
  local skip=() sdk_files ca=() pins
  py=$(python_interpreter) || exit 1
  info=$("$py" -c 'import sys, sysconfig
print(sys.executable); print(sysconfig.get_paths()["stdlib"]); print(sysconfig.get_config_var("DESTSHARED"))')
  { read -r exe; read -r stdlib; read -r dynload; } <<<"$info"
  [[ -d $stdlib && -d $dynload ]] || { echo "e2e/images/build.sh: $py: no stdlib at $stdlib or $dynload" >&2; exit 1; }
  mods=$(find "$dynload" -maxdepth 1 -name '*.so' -printf '%f\n' | grep -Ev "$DYNLOAD_SKIP" | sort | sed "s|^|$dynload/|")
  # shellcheck disable=SC2086 # one absolute path per line, no spaces
  libs=$(for bin in "$exe" $mods; do shared_libs "$bin" || exit 1; done | sort -u) || exit 1
  for lib in "${STDLIB_SKIP[@]}"; do skip+=("--exclude=$lib"); done
  listing=$(tar -C "$stdlib" "${skip[@]}" -cvvf /dev/null . | sha256sum | cut -d' ' -f1)
  pip_version=$("$py" -m pip --version 2>/dev/null) ||
    { echo "e2e/images/build.sh: $py has no pip (Debian: apt-get install python3-pip)" >&2; exit 1; }
  sdk_files=$(cd "$sdk" && find src -type f \( -name '*.py' -o -name py.typed \) | sort)
  [[ -f $CA ]] && ca=("$CA")
  # shellcheck disable=SC2086 # mods, libs, sdk_files: one path per line, no spaces
  hash=$(inputs_hash "$name" "$exe" "$("$py" -VV)" "$pip_version" "$listing" $mods $libs $sdk_files -- \
    "$exe" $mods $libs "${ca[@]}" "$constraints" "$sdk/pyproject.toml" "$sdk/README.md" \
    "$sdk/examples/demo_agent.py" $(sed "s|^|$sdk/|" <<<"$sdk_files"))
  if up_to_date "$archive" "$hash"; then
    echo "$archive: up to date"
    return
  fi
  root=$stage/python-agent
  site=$root/app/site-packages
  base_rootfs "$root"
  install -D -m 0755 "$exe" "$root$exe"
  # `python3` on PATH whatever the interpreter's path: for exec probes and `kubectl exec`.
  [[ -e $root/usr/local/bin/python3 ]] || ln -s "$exe" "$root/usr/local/bin/python3"
  for lib in $libs; do
    install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
  done
  for mod in $mods; do
    install -D -m 0755 "$mod" "$root$mod"
  done
  mkdir -p "$root$stdlib"
  tar -C "$stdlib" "${skip[@]}" --dereference -cf - . | tar -C "$root$stdlib" -xf -
  # The SDK from a copy: an in-tree build would leave build/ and *.egg-info in sdk/python.
  mkdir -p "$stage/sdk"
  cp "$sdk/pyproject.toml" "$sdk/README.md" "$stage/sdk/"
  (cd "$sdk" && tar -cf - $sdk_files) | tar -C "$stage/sdk" -xf -
  PIP_ROOT_USER_ACTION=ignore "$py" -m pip install --quiet --disable-pip-version-check --no-compile \
    --no-warn-script-location --target "$site" --constraint "$constraints" "$stage/sdk[agent]"
  rm -rf "$site/bin"
  # Every distribution installed is pinned (a new dependency of a new SDK must be added):
  # NAME-VERSION.dist-info against NAME==VERSION, names compared as pip normalizes them.
  pins=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$constraints" |
    awk -F'==' '{ n = tolower($1); gsub(/[-_.]+/, "_", n); print n "==" $2 }')
  for dist in "$site"/*.dist-info; do
    dist=${dist##*/}
    dist=${dist%.dist-info}
    [[ ${dist%%-*} == leasehold ]] && continue
    grep -qxF "$(tr '[:upper:]' '[:lower:]' <<<"${dist%%-*}")==${dist#*-}" <<<"$pins" ||
      { echo "e2e/images/build.sh: pip installed $dist, not pinned in $constraints" >&2; exit 1; }
  done
  install -D -m 0644 "$sdk/examples/demo_agent.py" "$root/app/examples/demo_agent.py"
  "$py" -m compileall -q --invalidation-mode unchecked-hash -s "$root" -p / "$root$stdlib" "$root/app" >/dev/null
  python3 "$here/oci_archive.py" --rootfs "$root" --name "$name" \
    --entrypoint "$exe" /app/examples/demo_agent.py --user 65532:65532 \
    --env "$PATH_ENV" --env "SSL_CERT_FILE=$CA" --env PYTHONPATH=/app/site-packages \
    --env PYTHONUNBUFFERED=1 --env PYTHONDONTWRITEBYTECODE=1 --out "$archive"
  echo "$hash" >"$archive.inputs"
}

binary_image sidecar leasehold-sidecar
binary_image operator leasehold-operator
binary_image demo-agent leasehold-demo-agent
pause_image
python_agent_image
