#!/usr/bin/env bash
# Starts a one-node Kubernetes cluster from Kubernetes' own components, the way
# hack/local-up-cluster.sh does: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and a kubelet over containerd + runc + CNI, each its own process, all in
# the network namespace NETNS (lib.sh). Also a Postgres the pods reach on the node IP.
# Imports the OCI image archives from $CACHE/images into containerd (no registry).
#
# Writes $ENV_FILE: the variables the e2e tests read. down.sh stops everything by PID.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=e2e/cluster/lib.sh
. "$here/lib.sh"

# How long each component may take to answer its health check after it starts.
STARTUP_TIMEOUT_SECS=120

[ -x "$K8S_BIN" ] || { echo "up.sh: $K8S_BIN missing (run e2e/k8s/build.sh first)" >&2; exit 1; }
if [ -e "$RUN/pids" ] && [ -n "$(ls -A "$RUN/pids" 2>/dev/null)" ]; then
  echo "up.sh: a cluster is already running in $RUN (run e2e/cluster/down.sh)" >&2
  exit 1
fi
if findmnt -rn -o TARGET | grep -q "^$RUN/"; then
  echo "up.sh: mounts remain under $RUN (run e2e/cluster/down.sh)" >&2
  exit 1
fi
rm -rf "$RUN"
mkdir -p "$RUN"/{pids,logs,etcd,kubelet,pod-logs,cni/net.d,cni/ipam,containerd}

# start NAME CMD... — run CMD in the namespace, in its own session, logging to logs/NAME.
# The subshell execs nsenter, which execs setsid, which execs CMD: one PID throughout
# (setsid forks only for a process-group leader, and without job control it is not).
start() {
  local name=$1; shift
  (exec nsenter --net="$NETNS_PATH" setsid "$@") >"$RUN/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/pids/$name"
  log "started $name (pid $!)"
}

# wait_for NAME CMD... — until CMD succeeds; fails early if NAME's process died.
wait_for() {
  local name=$1; shift
  local deadline=$((SECONDS + STARTUP_TIMEOUT_SECS))
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$RUN/pids/$name")" 2>/dev/null; then
      echo "up.sh: $name exited; last lines of its log:" >&2
      tail -30 "$RUN/logs/$name.log" >&2
      exit 1
    fi
    if ((SECONDS > deadline)); then
      echo "up.sh: $name not ready after ${STARTUP_TIMEOUT_SECS}s; last lines of its log:" >&2
      tail -30 "$RUN/logs/$name.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  log "$name ready"
}

# --- network namespace and pod bridge ---------------------------------------------------
if [ ! -e "$NETNS_PATH" ]; then ip netns add "$NETNS"; fi
ip -n "$NETNS" link set lo up
if ! ip -n "$NETNS" link show "$BRIDGE" >/dev/null 2>&1; then
  ip -n "$NETNS" link add "$BRIDGE" type bridge
  ip -n "$NETNS" addr add "$NODE_IP/24" dev "$BRIDGE"
fi
ip -n "$NETNS" link set "$BRIDGE" up
# Service IPs are never routed (no kube-proxy): pods reach the API server on the node IP.

"$here/pki.sh" "$RUN/pki"
pki=$RUN/pki

# --- etcd ----------------------------------------------------------------------------------
start etcd "$K8S_BIN" etcd --name leasehold-e2e --data-dir "$RUN/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster leasehold-e2e=http://127.0.0.1:2380 --unsafe-no-fsync \
  --quota-backend-bytes 4294967296
wait_for etcd in_ns curl -sf http://127.0.0.1:2379/health

# --- control plane -------------------------------------------------------------------------
start kube-apiserver "$K8S_BIN" kube-apiserver \
  --etcd-servers http://127.0.0.1:2379 \
  --bind-address 0.0.0.0 --advertise-address "$NODE_IP" --secure-port "$APISERVER_PORT" \
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
  --client-ca-file "$pki/ca.crt" \
  --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
  --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --service-cluster-ip-range "$SERVICE_CIDR" \
  --kubelet-preferred-address-types InternalIP \
  --authorization-mode Node,RBAC --allow-privileged=true \
  --enable-admission-plugins NodeRestriction
admin_curl() { in_ns curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" "$@"; }
wait_for kube-apiserver admin_curl "https://$NODE_IP:$APISERVER_PORT/readyz"

start kube-controller-manager "$K8S_BIN" kube-controller-manager \
  --kubeconfig "$pki/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$pki/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$pki/controller-manager.kubeconfig" \
  --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
  --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
  --use-service-account-credentials --leader-elect=false --bind-address 127.0.0.1 --secure-port 10257
start kube-scheduler "$K8S_BIN" kube-scheduler \
  --kubeconfig "$pki/scheduler.kubeconfig" \
  --authentication-kubeconfig "$pki/scheduler.kubeconfig" \
  --authorization-kubeconfig "$pki/scheduler.kubeconfig" \
  --leader-elect=false --bind-address 127.0.0.1 --secure-port 10259
wait_for kube-controller-manager in_ns curl -skf https://127.0.0.1:10257/healthz
wait_for kube-scheduler in_ns curl -skf https://127.0.0.1:10259/healthz
# The service-account controller is working once namespaces get their `default` account.
wait_for kube-controller-manager kubectl_ get serviceaccount default -n default

# --- containerd + CNI --------------------------------------------------------------------
cat >"$RUN/cni/net.d/10-leasehold-e2e.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "leasehold-e2e",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$RUN/cni/ipam",
        "ranges": [[{"subnet": "$POD_SUBNET", "rangeStart": "10.88.0.10", "gateway": "$NODE_IP"}]]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
cat >"$RUN/containerd/config.toml" <<EOF
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.internal.v1.opt"]
  path = "$RUN/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/leasehold/pause:e2e"
  # Pods' network namespaces live under our state dir, not /run/netns.
  netns_mounts_under_state_dir = true
  # This machine forbids lowering oom_score_adj (no CAP_SYS_RESOURCE over it): keep
  # containers at or above containerd's own score, as in rootless setups.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$RUN/cni/net.d"
EOF
start containerd containerd --config "$RUN/containerd/config.toml"
wait_for containerd ctr --address "$CONTAINERD_SOCK" version
[ -f "$IMAGES/pause.tar" ] || { echo "up.sh: no image archives in $IMAGES (run e2e/images/build.sh)" >&2; exit 1; }
for archive in "$IMAGES"/*.tar; do
  ctr --address "$CONTAINERD_SOCK" -n k8s.io images import "$archive" >/dev/null
done
log "images imported: $(ctr --address "$CONTAINERD_SOCK" -n k8s.io images ls -q | tr '\n' ' ')"

# --- Postgres on the node IP ---------------------------------------------------------------
pgbin=$("$here/../../scripts/ensure-postgres.sh")
mkdir -p "$RUN/postgres"
chown postgres: "$RUN/postgres"
runuser -u postgres -- "$pgbin/initdb" -D "$RUN/postgres/data" -U postgres --auth=trust -E UTF8 \
  --no-sync >"$RUN/logs/initdb.log" 2>&1
cat >"$RUN/postgres/data/pg_hba.conf" <<EOF
local all all trust
host all all 127.0.0.1/32 trust
host all all $POD_SUBNET scram-sha-256
EOF
in_ns runuser -u postgres -- "$pgbin/pg_ctl" -D "$RUN/postgres/data" -l "$RUN/postgres/postgres.log" -w -t 60 \
  start -o "-c listen_addresses=127.0.0.1,$NODE_IP -p $PG_PORT -k $RUN/postgres -c fsync=off \
  -c synchronous_commit=off -c full_page_writes=off -c max_connections=400" >/dev/null
head -1 "$RUN/postgres/data/postmaster.pid" >"$RUN/pids/postgres"
in_ns "$pgbin/psql" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -c \
  "CREATE ROLE $PG_USER LOGIN SUPERUSER PASSWORD '$PG_PASSWORD'"
log "postgres ready on $NODE_IP:$PG_PORT"

# --- kubelet ---------------------------------------------------------------------------------
cat >"$RUN/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 (hybrid layout); allowed with this switch until 1.38.
failCgroupV1: false
# containerd 1.6 has no RuntimeConfig CRI call: the kubelet uses its own setting.
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
failSwapOn: false
address: $NODE_IP
port: 10250
readOnlyPort: 0
podLogsDir: $RUN/pod-logs
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
# The disk of a shared build machine is often fuller than the default 10% eviction
# threshold: evict only when it is really full.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Pod status changes reach the API server promptly (the tests time hand-offs).
nodeStatusUpdateFrequency: 4s
serializeImagePulls: false
EOF
start kubelet "$K8S_BIN" kubelet --config "$RUN/kubelet/config.yaml" \
  --kubeconfig "$pki/kubelet.kubeconfig" --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" \
  --root-dir "$RUN/kubelet"
node_ready() {
  [ "$(kubectl_ get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
wait_for kubelet node_ready

cat >"$RUN/operator-values.yaml" <<EOF
# The local cluster runs no kube-proxy: the operator reaches the API server on the node IP.
extraEnv:
  - name: KUBERNETES_SERVICE_HOST
    value: "$NODE_IP"
  - name: KUBERNETES_SERVICE_PORT
    value: "$APISERVER_PORT"
EOF
mkdir -p "$(dirname "$ENV_FILE")"
cat >"$ENV_FILE" <<EOF
# Written by e2e/cluster/up.sh; commands using it run inside: nsenter --net=$NETNS_PATH
export KUBECONFIG=$pki/admin.kubeconfig
export LEASEHOLD_E2E_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable
export LEASEHOLD_E2E_POD_DATABASE_URL=postgres://$PG_USER:$PG_PASSWORD@$NODE_IP:$PG_PORT
export LEASEHOLD_E2E_IMAGE_TAG=e2e
export LEASEHOLD_E2E_HELM_VALUES=$RUN/operator-values.yaml
EOF
log "cluster up: $(kubectl_ version 2>/dev/null | tail -1); env in $ENV_FILE"
