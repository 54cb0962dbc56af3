# Shared settings of the local e2e cluster (sourced by up.sh and down.sh).
#
# Everything runs inside one network namespace the scripts create (NETNS): etcd, the
# control plane, containerd, the kubelet, Postgres and the test binary. Pods get their
# own namespaces from CNI on the bridge BRIDGE. Nothing listens on the host's network.

NETNS=leasehold-e2e
NETNS_PATH=/run/netns/$NETNS
BRIDGE=lh0
# The node's address on the pod bridge: API server, kubelet and Postgres listen here.
NODE_IP=10.88.0.1
POD_SUBNET=10.88.0.0/24
SERVICE_CIDR=10.96.0.0/24
# First address of the service range: the `kubernetes` Service.
SERVICE_IP=10.96.0.1
NODE_NAME=leasehold-e2e-node
APISERVER_PORT=6443
PG_PORT=5432
PG_USER=leasehold
PG_PASSWORD=leasehold-e2e

# Built binaries and images survive between runs; cluster state does not.
CACHE=${LEASEHOLD_E2E_CACHE:-$HOME/.cache/leasehold-e2e}
RUN=${LEASEHOLD_E2E_RUN:-/var/tmp/leasehold-e2e}
K8S_BIN=$CACHE/bin/leasehold-k8s
IMAGES=$CACHE/images
CONTAINERD_SOCK=$RUN/containerd/containerd.sock
ENV_FILE=$CACHE/env

# Run a command inside the cluster's network namespace (and only that namespace: the
# kubelet and containerd must share the host's mount namespace).
in_ns() { nsenter --net="$NETNS_PATH" "$@"; }

kubectl_() { in_ns "$K8S_BIN" kubectl --kubeconfig "$RUN/pki/admin.kubeconfig" "$@"; }

log() { printf '[e2e %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
