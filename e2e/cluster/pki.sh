#!/usr/bin/env bash
# Certificates and kubeconfigs of the local e2e cluster, with openssl: one CA, the API
# server's serving certificate, the service-account key pair, and one client certificate
# per component with the identity Kubernetes' RBAC and Node authorizer expect.
#
#   pki.sh DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=e2e/cluster/lib.sh
. "$here/lib.sh"
dir=${1:?usage: pki.sh DIR}
mkdir -p "$dir"
cd "$dir"

# Certificates of a throwaway cluster: valid long enough for any run.
DAYS=30

openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days "$DAYS" \
  -subj "/CN=leasehold-e2e-ca" 2>/dev/null

# sign NAME SUBJECT [SAN] — a key and a certificate signed by the CA.
sign() {
  local name=$1 subject=$2 san=${3:-}
  openssl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subject" 2>/dev/null
  local ext=$name.ext
  if [ -n "$san" ]; then
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' "$san" >"$ext"
  else
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >"$ext"
  fi
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$name.crt" \
    -days "$DAYS" -extfile "$ext" 2>/dev/null
  rm -f "$name.csr" "$ext"
}

sign apiserver "/CN=kube-apiserver" \
  "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$NODE_IP,IP:$SERVICE_IP"
sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
sign admin "/O=system:masters/CN=leasehold-e2e-admin"
sign controller-manager "/CN=system:kube-controller-manager"
sign scheduler "/CN=system:kube-scheduler"
sign kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"

openssl genrsa -out sa.key 2048 2>/dev/null
openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null

# kubeconfig NAME — a kubeconfig for the client certificate NAME.
kubeconfig() {
  local name=$1
  cat >"$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: leasehold-e2e
    cluster:
      server: https://$NODE_IP:$APISERVER_PORT
      certificate-authority-data: $(base64 -w0 ca.crt)
users:
  - name: $name
    user:
      client-certificate-data: $(base64 -w0 "$name.crt")
      client-key-data: $(base64 -w0 "$name.key")
contexts:
  - name: leasehold-e2e
    context: {cluster: leasehold-e2e, user: $name}
current-context: leasehold-e2e
EOF
}
for name in admin controller-manager scheduler kubelet; do kubeconfig "$name"; done
