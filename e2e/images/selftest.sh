#!/usr/bin/env bash
# Proves the e2e image archives load and run without Docker: builds them (build.sh),
# starts a PRIVATE containerd (root, state and socket in a temp dir; no other containerd
# is touched), imports every archive into namespace k8s.io, lists them, runs
# `leasehold-demo-agent --help` and `leasehold-sidecar --help` in containers, starts the
# Python reference agent (python-agent, host network, its own entrypoint) and checks that
# its handler answers a malformed turn, and checks that the pause container exits 0 on
# SIGTERM. Everything it starts is stopped by PID on
# exit (trap), its mounts are unmounted and the temp dir removed.
# usage: e2e/images/selftest.sh [OUTDIR]   (default: target/e2e-images)
# Needs root, containerd, ctr, runc, plus what build.sh needs.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-${CARGO_TARGET_DIR:-$repo/target}/e2e-images}
tag=${LEASEHOLD_E2E_IMAGE_TAG:-e2e}

for tool in containerd ctr runc containerd-shim-runc-v2; do
  command -v "$tool" >/dev/null || { echo "selftest: $tool not found on PATH" >&2; exit 1; }
done
[[ $(id -u) == 0 ]] || { echo "selftest: must run as root (containerd)" >&2; exit 1; }

"$here/build.sh" "$out"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/leasehold-ctrd.XXXXXX")
sock=$tmp/containerd.sock
ns=k8s.io
id=lh-selftest-$$
ctrd_pid=
ctr_=(ctr --address "$sock" -n "$ns")
ctr_() { "${ctr_[@]}" "$@"; }

cleanup() {
  local rc=$? c m
  set +e
  if [[ -n $ctrd_pid ]]; then
    # Stop any task left behind by a failed step, so its shim exits too.
    for c in $(ctr_ tasks ls -q 2>/dev/null); do
      ctr_ tasks kill -s SIGKILL "$c" >/dev/null 2>&1
      timeout 10 "${ctr_[@]}" tasks delete -f "$c" >/dev/null 2>&1
    done
    for c in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers rm "$c" >/dev/null 2>&1; done
    kill "$ctrd_pid" 2>/dev/null
    wait "$ctrd_pid" 2>/dev/null
  fi
  # Deepest first: snapshot mounts under our temp dir.
  awk -v p="$tmp/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r |
    while read -r m; do umount -l "$m"; done
  rm -rf "$tmp"
  if [[ $rc == 0 ]]; then echo "selftest: PASS"; else
    echo "selftest: FAIL (exit $rc); containerd log was:" >&2
    [[ -f $out/.selftest-containerd.log ]] && tail -n 30 "$out/.selftest-containerd.log" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cat >"$tmp/config.toml" <<TOML
version = 2
root = "$tmp/root"
state = "$tmp/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  address = "$tmp/debug.sock"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$tmp/opt"
TOML

containerd --config "$tmp/config.toml" >"$out/.selftest-containerd.log" 2>&1 &
ctrd_pid=$!
for _ in $(seq 100); do
  ctr --address "$sock" version >/dev/null 2>&1 && break
  kill -0 "$ctrd_pid" 2>/dev/null || { echo "selftest: containerd exited at start" >&2; exit 1; }
  sleep 0.2
done
ctr --address "$sock" version >/dev/null || { echo "selftest: containerd did not answer on $sock" >&2; exit 1; }
echo "selftest: private containerd pid $ctrd_pid on $sock"

for img in sidecar operator demo-agent pause python-agent; do
  ctr_ images import "$out/$img.tar"
done
ctr_ images ls
for img in sidecar operator demo-agent pause python-agent; do
  ctr_ images ls -q | grep -qx "docker.io/leasehold/$img:$tag" ||
    { echo "selftest: docker.io/leasehold/$img:$tag not registered by import" >&2; exit 1; }
done

echo "--- demo-agent --help (in a container)"
timeout 60 "${ctr_[@]}" run --rm "docker.io/leasehold/demo-agent:$tag" "$id-a" /usr/local/bin/leasehold-demo-agent --help
echo "--- sidecar --help (in a container, user from the image config)"
timeout 60 "${ctr_[@]}" run --rm "docker.io/leasehold/sidecar:$tag" "$id-s" sh -c true 2>/dev/null &&
  { echo "selftest: the sidecar image unexpectedly has a shell" >&2; exit 1; }
help=$(timeout 60 "${ctr_[@]}" run --rm "docker.io/leasehold/sidecar:$tag" "$id-s" /usr/local/bin/leasehold-sidecar --help)
sed -n 1,3p <<<"$help"

echo "--- python-agent: the reference agent answers (in a container, host network)"
# The image's entrypoint (the interpreter and demo_agent.py); DEMO_AGENT_LISTEN sets
# where it listens. Without a sidecar, a turn whose body is not JSON is refused by the
# agent's own handler (400 malformed_json), which proves the stack under it runs.
py_port=$((20000 + $$ % 20000))
ctr_ run -d --net-host --env "DEMO_AGENT_LISTEN=127.0.0.1:$py_port" "docker.io/leasehold/python-agent:$tag" "$id-py" >/dev/null
answer=
for _ in $(seq 100); do
  answer=$(curl -s -X POST -H 'Leasehold-Epoch: 1' --data 'not json' "http://127.0.0.1:$py_port/sessions/s/turns") && break
  sleep 0.2
done
echo "$answer"
[[ $answer == *'"error":"malformed_json"'* ]] || { echo "selftest: the Python agent did not answer as expected: $answer" >&2; exit 1; }
ctr_ tasks kill -s SIGKILL "$id-py"
for _ in $(seq 50); do
  [[ $(ctr_ tasks ls | awk -v c="$id-py" '$1 == c { print $3 }') == STOPPED ]] && break
  sleep 0.2
done
ctr_ tasks delete "$id-py" >/dev/null
ctr_ containers rm "$id-py"

echo "--- pause: SIGTERM exits 0"
ctr_ run -d "docker.io/leasehold/pause:$tag" "$id-p" >/dev/null
sleep 0.5
ctr_ tasks kill -s SIGTERM "$id-p"
status=
for _ in $(seq 50); do
  status=$(ctr_ tasks ls | awk -v c="$id-p" '$1 == c { print $3 }')
  [[ $status == STOPPED ]] && break
  sleep 0.2
done
[[ $status == STOPPED ]] || { echo "selftest: pause did not stop on SIGTERM (status $status)" >&2; exit 1; }
code=$(ctr_ tasks delete "$id-p" | awk '/exit status/ { print $NF }')
ctr_ containers rm "$id-p"
[[ ${code:-0} == 0 ]] || { echo "selftest: pause exited $code on SIGTERM" >&2; exit 1; }
echo "pause exited ${code:-0}"
