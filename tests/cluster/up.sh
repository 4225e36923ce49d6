#!/usr/bin/env bash
# Start a local Kubernetes control plane on 127.0.0.1 with fake (kwok) GPU/RDMA nodes.
#   etcd -> kube-apiserver -> kube-controller-manager, kube-scheduler, kwok
# Idempotent: components that are already running (pid file + cmdline check) are reused.
# State (certs, etcd data, logs, pids, kubeconfig) lives in ${TRIPTYCH_CLUSTER_DIR:-~/.cache/triptych/cluster}.
# Ports and node shape are overridable, see env.sh and docs/local-cluster.md.
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"

for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok kubectl; do
  if [ ! -x "$BIN_DIR/$b" ]; then
    echo "up.sh: $BIN_DIR/$b is missing: the toolchain is not built; run 'make setup' (or bash tests/cluster/build.sh)" >&2
    exit 1
  fi
done

CERTS=$CLUSTER_DIR/certs
# shellcheck disable=SC2034  # read by lib.sh
SCRIPT=up PIDS=$CLUSTER_DIR/pids OWNED_BY=$CLUSTER_DIR LOGS=$CLUSTER_DIR/logs
mkdir -p "$CERTS" "$PIDS" "$LOGS"
chmod 700 "$CLUSTER_DIR"
# One up/down at a time per state dir (concurrent pytest sessions share the cluster).
exec 9>"$CLUSTER_DIR/.lock"
flock -w 180 9 || { echo "up: another up.sh/down.sh holds $CLUSTER_DIR/.lock" >&2; exit 1; }
KUBECTL=("$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_PATH")

# ---------------------------------------------------------------- helpers
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# start_on <port that must be free> <name> <args...>: start $BIN_DIR/<name> unless it already runs.
start_on() {
  local port=$1 name=$2
  shift 2
  if ! component_pid "$name" >/dev/null && port_open "$port"; then
    die "port 127.0.0.1:$port needed by $name is already in use by another process;" \
      "stop it or choose other ports (TRIPTYCH_*_PORT, see docs/local-cluster.md)"
  fi
  start "$name" "$BIN_DIR/$name" "$@"
}

# ---------------------------------------------------------------- certificates (openssl, once)
new_ca() { # <name> <CN>
  [ -f "$CERTS/$1.crt" ] && return 0
  new_key "$CERTS/$1.key"
  openssl req -x509 -new -key "$CERTS/$1.key" -out "$CERTS/$1.crt" -days 3650 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
}

t_start=$SECONDS
if [ ! -f "$CERTS/.done" ]; then
  log "creating certificates in $CERTS"
  # The first IP of the service range is the in-cluster address of the apiserver (kubernetes.default).
  svc_ip=$(python3 -c "import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[1])" "$SERVICE_CIDR")
  new_ca ca triptych-local-ca
  new_ca front-proxy-ca triptych-local-front-proxy-ca
  new_cert "$CERTS" apiserver "/CN=kube-apiserver" ca serverAuth \
    "IP:127.0.0.1,IP:$svc_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  new_cert "$CERTS" admin "/O=system:masters/CN=triptych-admin" ca clientAuth
  new_cert "$CERTS" kube-controller-manager "/CN=system:kube-controller-manager" ca clientAuth
  new_cert "$CERTS" kube-scheduler "/CN=system:kube-scheduler" ca clientAuth
  new_cert "$CERTS" kwok "/O=system:masters/CN=kwok-controller" ca clientAuth
  new_cert "$CERTS" front-proxy-client "/CN=front-proxy-client" front-proxy-ca clientAuth
  [ -f "$CERTS/sa.key" ] || { new_key "$CERTS/sa.key"; openssl pkey -in "$CERTS/sa.key" -pubout -out "$CERTS/sa.pub"; }
  touch "$CERTS/.done"
fi
chmod 600 "$CERTS"/*.key
# Rewritten every time: the apiserver port may have been overridden.
write_kubeconfig "$KUBECONFIG_PATH" "$CERTS" admin
write_kubeconfig "$CLUSTER_DIR/kube-controller-manager.kubeconfig" "$CERTS" kube-controller-manager
write_kubeconfig "$CLUSTER_DIR/kube-scheduler.kubeconfig" "$CERTS" kube-scheduler
write_kubeconfig "$CLUSTER_DIR/kwok.kubeconfig" "$CERTS" kwok

# ---------------------------------------------------------------- etcd
# TRIPTYCH_CLUSTER_FRESH=1 (a test session that starts the cluster): a stopped cluster starts from an
# empty etcd, without what earlier sessions left (a running one is shared, and kept).
fresh=${TRIPTYCH_CLUSTER_FRESH:-0}
for name in "${COMPONENTS[@]}"; do component_pid "$name" >/dev/null && fresh=0; done
if [ "$fresh" = 1 ]; then rm -rf "$CLUSTER_DIR/etcd"; fi
mkdir -p -m 700 "$CLUSTER_DIR/etcd"
start_on "$ETCD_CLIENT_PORT" etcd \
  --name=triptych-local \
  --data-dir="$CLUSTER_DIR/etcd" \
  --listen-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --advertise-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster="triptych-local=http://127.0.0.1:$ETCD_PEER_PORT" \
  --unsafe-no-fsync=true \
  --quota-backend-bytes=4294967296 \
  --log-level=warn
wait_for 30 "etcd on 127.0.0.1:$ETCD_CLIENT_PORT" port_open "$ETCD_CLIENT_PORT"

# ---------------------------------------------------------------- kube-apiserver
if [ "$REAL_NODE" = 1 ]; then
  # Pods of the real node reach the apiserver through the `kubernetes` Service, whose endpoint is the
  # advertise address (the node IP): listen there too, and reach the kubelet by its InternalIP with a
  # client certificate (logs, exec).
  new_cert "$CERTS" apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" ca clientAuth
  apiserver_address_args=(
    --bind-address=0.0.0.0
    --advertise-address="$NODE_IP"
    --kubelet-preferred-address-types=InternalIP
    --kubelet-client-certificate="$CERTS/apiserver-kubelet-client.crt"
    --kubelet-client-key="$CERTS/apiserver-kubelet-client.key"
  )
else
  # No kubelets exist (kwok fakes the nodes), so the advertise address only feeds the `kubernetes`
  # Service's endpoints; 127.0.0.1 is rejected there, so the apiserver does not reconcile them.
  apiserver_address_args=(--bind-address=127.0.0.1 --advertise-address=127.0.0.1 --endpoint-reconciler-type=none)
fi
start_on "$APISERVER_PORT" kube-apiserver \
  --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  "${apiserver_address_args[@]}" \
  --secure-port="$APISERVER_PORT" \
  --cert-dir="$CERTS/apiserver-selfsigned" \
  --tls-cert-file="$CERTS/apiserver.crt" \
  --tls-private-key-file="$CERTS/apiserver.key" \
  --client-ca-file="$CERTS/ca.crt" \
  --authorization-mode=Node,RBAC \
  --allow-privileged=true \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$CERTS/sa.pub" \
  --service-account-signing-key-file="$CERTS/sa.key" \
  --requestheader-client-ca-file="$CERTS/front-proxy-ca.crt" \
  --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User \
  --requestheader-group-headers=X-Remote-Group \
  --requestheader-uid-headers=X-Remote-Uid \
  --requestheader-extra-headers-prefix=X-Remote-Extra- \
  --proxy-client-cert-file="$CERTS/front-proxy-client.crt" \
  --proxy-client-key-file="$CERTS/front-proxy-client.key" \
  --enable-aggregator-routing=true \
  --profiling=false
wait_for 60 "kube-apiserver /readyz on 127.0.0.1:$APISERVER_PORT" "${KUBECTL[@]}" get --raw /readyz

# ---------------------------------------------------------------- controllers
start_on "$KCM_PORT" kube-controller-manager \
  --kubeconfig="$CLUSTER_DIR/kube-controller-manager.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/kube-controller-manager.kubeconfig" \
  --authorization-kubeconfig="$CLUSTER_DIR/kube-controller-manager.kubeconfig" \
  --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics \
  --bind-address=127.0.0.1 \
  --secure-port="$KCM_PORT" \
  --cert-dir="$CERTS/kcm-selfsigned" \
  --leader-elect=false \
  --controllers='*,bootstrapsigner,tokencleaner' \
  --use-service-account-credentials=true \
  --service-account-private-key-file="$CERTS/sa.key" \
  --root-ca-file="$CERTS/ca.crt" \
  --cluster-signing-cert-file="$CERTS/ca.crt" \
  --cluster-signing-key-file="$CERTS/ca.key" \
  --allocate-node-cidrs=true \
  --flex-volume-plugin-dir="$CLUSTER_DIR/flexvolume" \
  --cluster-cidr="$POD_CIDR" \
  --node-cidr-mask-size=24 \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --horizontal-pod-autoscaler-sync-period=5s \
  --kube-api-qps="$KCM_API_QPS" \
  --kube-api-burst="$KCM_API_BURST" \
  --concurrent-deployment-syncs="$KCM_CONCURRENT_SYNCS" \
  --concurrent-replicaset-syncs="$KCM_CONCURRENT_SYNCS" \
  --profiling=false

start_on "$SCHEDULER_PORT" kube-scheduler \
  --kubeconfig="$CLUSTER_DIR/kube-scheduler.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/kube-scheduler.kubeconfig" \
  --authorization-kubeconfig="$CLUSTER_DIR/kube-scheduler.kubeconfig" \
  --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics \
  --bind-address=127.0.0.1 \
  --secure-port="$SCHEDULER_PORT" \
  --cert-dir="$CERTS/scheduler-selfsigned" \
  --leader-elect=false \
  --profiling=false

# kwok fakes kubelets: only nodes annotated kwok.x-k8s.io/node=fake; stages from tests/cluster/stages.
stage_args=()
for f in "$CLUSTER_SRC"/stages/*.yaml; do stage_args+=(--config="$f"); done
start_on "$KWOK_PORT" kwok \
  --kubeconfig="$CLUSTER_DIR/kwok.kubeconfig" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr="$POD_CIDR" \
  --node-lease-duration-seconds=40 \
  --server-address="127.0.0.1:$KWOK_PORT" \
  "${stage_args[@]}"

# Their serving certs are self-signed (in memory), hence no CA check; /healthz is always allowed.
healthz() {
  "$BIN_DIR/kubectl" --kubeconfig=/dev/null --server="https://127.0.0.1:$1" --insecure-skip-tls-verify=true \
    --client-certificate="$CERTS/admin.crt" --client-key="$CERTS/admin.key" get --raw /healthz </dev/null
}
wait_for 30 "kube-controller-manager healthz" healthz "$KCM_PORT"
wait_for 30 "kube-scheduler healthz" healthz "$SCHEDULER_PORT"

# ---------------------------------------------------------------- fake nodes
# Fake node IPs (kwok does not route them; they show up as node InternalIP and pod hostIP).
node_status_yaml() { # <name> <cpu> <memory> <gpus> <ip>
  local name=$1 cpu=$2 mem=$3 gpus=$4 ip=$5 gpu_res=""
  if [ "$gpus" -gt 0 ]; then
    gpu_res="    nvidia.com/gpu: \"$gpus\"
    $RDMA_RESOURCE: \"1\""
  fi
  cat <<EOF
status:
  addresses:
  - type: InternalIP
    address: $ip
  - type: Hostname
    address: $name
  capacity: &res
    cpu: "$cpu"
    memory: $mem
    pods: "110"
    ephemeral-storage: 1Ti
$gpu_res
  allocatable: *res
EOF
}

node_yaml() { # <name> <role> <cpu> <memory> <gpus> <ip>
  local name=$1 role=$2 gpus=$5 gpu_labels=""
  if [ "$gpus" -gt 0 ]; then
    gpu_labels="    nvidia.com/gpu.product: NVIDIA-H200
    nvidia.com/gpu.count: \"$gpus\"
    nvidia.com/gpu.present: \"true\""
  fi
  cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    node-role.kubernetes.io/$role: ""
$gpu_labels
EOF
  node_status_yaml "$name" "$3" "$4" "$gpus" "$6"
}

mkdir -p "$CLUSTER_DIR/nodes"
node_names=()
add_node() { # <name> <role> <cpu> <memory> <gpus> <ip>
  node_yaml "$@" >"$CLUSTER_DIR/nodes/$1.yaml"
  node_status_yaml "$1" "$3" "$4" "$5" "$6" >"$CLUSTER_DIR/nodes/$1.status.yaml"
  node_names+=("$1")
}
for ((i = 0; i < GPU_NODES; i++)); do add_node "gpu-node-$i" gpu 64 512Gi 8 "192.0.2.$((240 + i))"; done
add_node cpu-node-0 cpu 16 64Gi 0 192.0.2.249
for n in "${node_names[@]}"; do
  if ! "${KUBECTL[@]}" get node "$n" >/dev/null 2>&1; then
    # A Node keeps the status it is created with (as when a kubelet registers); kwok keeps the capacity.
    "${KUBECTL[@]}" create -f "$CLUSTER_DIR/nodes/$n.yaml" >/dev/null
    log "registered node $n"
  else
    # Reused cluster: make sure capacity and addresses are what this script says (e.g. another RDMA name).
    "${KUBECTL[@]}" patch node "$n" --subresource=status --type=merge \
      --patch-file="$CLUSTER_DIR/nodes/$n.status.yaml" >/dev/null
  fi
done

wait_for 60 "nodes Ready" "${KUBECTL[@]}" wait --for=condition=Ready node "${node_names[@]}" --timeout=2s
# The node lifecycle controller removes the not-ready taint shortly after Ready; pods need it gone.
no_taints() { [ -z "$("${KUBECTL[@]}" get node "${node_names[@]}" -o jsonpath='{.items[*].spec.taints}')" ]; }
wait_for 60 "node taints to clear" no_taints
# The serviceaccount controller creates `default` in every namespace; TokenRequest needs it.
wait_for 60 "the default ServiceAccount" "${KUBECTL[@]}" -n default get serviceaccount default

log "cluster ready in $((SECONDS - t_start)) s: ${node_names[*]}"
if [ "$REAL_NODE" = 1 ]; then
  exec 9>&-  # node-up.sh takes the same lock
  bash "$CLUSTER_SRC/node-up.sh"
fi
cat <<EOF
up: use it with
  export KUBECONFIG=$KUBECONFIG_PATH
  export PATH=$BIN_DIR:\$PATH   # kubectl/helm $K8S_VERSION/$HELM_VERSION built by tests/cluster/build.sh
  kubectl get nodes
up: stop it with: make cluster-down   (logs: $LOGS)
EOF
