#!/usr/bin/env bash
# Stops the local e2e cluster started by up.sh: every pod's containers, then each
# component by its PID (kubelet first, etcd last), unmounts what the kubelet and
# containerd mounted under $RUN, and deletes the network namespace. Idempotent.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=e2e/cluster/lib.sh
. "$here/lib.sh"

# How long a component gets to exit on SIGTERM before SIGKILL.
STOP_GRACE_SECS=10

stop_pid() {
  local name=$1 pid=$2
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq $((STOP_GRACE_SECS * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; log "killed $name (pid $pid)"; fi
}
stop() {
  local name=$1 file=$RUN/pids/$1
  [ -f "$file" ] || return 0
  stop_pid "$name" "$(cat "$file")"
  rm -f "$file"
}

stop kubelet
# Containers: kill every task containerd runs for us, then the shims, which containerd
# started with our socket address on their command line.
if [ -S "$CONTAINERD_SOCK" ]; then
  for task in $(ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
    ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks kill -s SIGKILL "$task" >/dev/null 2>&1
  done
fi
for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK" 2>/dev/null); do
  stop_pid shim "$pid"
done
# Whatever a container left behind: the kubelet puts every pod in the kubepods cgroup.
for procs in $(find /sys/fs/cgroup/pids/kubepods -name cgroup.procs 2>/dev/null); do
  while read -r pid; do kill -KILL "$pid" 2>/dev/null; done <"$procs"
done
stop containerd
stop kube-scheduler
stop kube-controller-manager
stop kube-apiserver
if [ -f "$RUN/pids/postgres" ]; then
  kill -INT "$(cat "$RUN/pids/postgres")" 2>/dev/null # fast shutdown
  stop postgres
fi
stop etcd

# Mounts under $RUN (secret tmpfs, overlay rootfs, sandbox shm), deepest first; and the
# pods' network namespaces that containerd pinned.
if [ -d "$RUN" ]; then
  findmnt -rn -o TARGET | grep "^$RUN/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
fi
ip netns del "$NETNS" 2>/dev/null
log "cluster down"
