#!/usr/bin/env bash
# Start a REAL node in the local cluster (`TRIPTYCH_REAL_NODE=1 make cluster-up` calls it; so does the real node's test):
#   containerd (private config/root/state/socket) + runc, kubelet, kube-proxy (iptables), CoreDNS.
# The control plane must run with TRIPTYCH_REAL_NODE=1 (up.sh then listens where pods reach it).
# Addresses stay on this machine: the node IP ($NODE_IP, TEST-NET-1) on a dummy interface or as a /32 on
# lo, pods in the node's pod CIDR (from 198.19.0.0/16) on bridge $NODE_BRIDGE, no masquerade; CoreDNS
# answers cluster.local only. Everything it creates is listed in docs/local-cluster.md and undone by
# node-down.sh. Idempotent: running components are reused.
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"

CERTS=$CLUSTER_DIR/certs
# shellcheck disable=SC2034  # read by lib.sh
SCRIPT=node-up PIDS=$NODE_DIR/pids OWNED_BY=$NODE_DIR LOGS=$NODE_DIR/logs
SOCK=$NODE_DIR/containerd/containerd.sock
KUBECTL=("$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_PATH")
CTR=(ctr --address "$SOCK" -n k8s.io)
PAUSE_IMAGE=localhost/triptych-pause:1.0
DNS_IP=$(python3 -c "import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[10])" "$SERVICE_CIDR")


for b in kubelet kube-proxy coredns pause; do
  [ -x "$NODE_BIN_DIR/$b" ] || die "$NODE_BIN_DIR/$b is missing: run 'bash tests/cluster/build-node.sh'"
done
for t in containerd containerd-shim-runc-v2 ctr runc iptables conntrack /usr/lib/cni/bridge /usr/lib/cni/host-local; do
  command -v "$t" >/dev/null || die "$t is missing: run 'make setup' (Debian: containerd runc containernetworking-plugins iptables conntrack)"
done
[ "$(id -u)" = 0 ] || die "a real node needs root (iptables, mounts, cgroups)"
if [ ! -f "$KUBECONFIG_PATH" ] || ! "${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1; then
  die "the control plane of $CLUSTER_DIR is not running: TRIPTYCH_REAL_NODE=1 bash tests/cluster/up.sh"
fi
api_pid=$(cat "$CLUSTER_DIR/pids/kube-apiserver.pid")
tr '\0' '\n' <"/proc/$api_pid/cmdline" | grep -- '--kubelet-client-certificate' >/dev/null ||
  die "the running kube-apiserver was started without TRIPTYCH_REAL_NODE=1: restart the cluster with it (make cluster-down; TRIPTYCH_REAL_NODE=1 make cluster-up)"

mkdir -p "$PIDS" "$LOGS" "$NODE_DIR/certs"
# One real node per machine: iptables, the bridge and the kubepods cgroups are global.
exec 8>/run/triptych-real-node.lock
flock -n 8 || die "another real node holds /run/triptych-real-node.lock (owner: $(cat /run/triptych-real-node.owner 2>/dev/null))"
owner=$(cat /run/triptych-real-node.owner 2>/dev/null || true)
[ -z "$owner" ] || [ "$owner" = "$CLUSTER_DIR" ] ||
  die "the real node of $owner is still set up on this machine: stop it first (TRIPTYCH_CLUSTER_DIR=$owner bash tests/cluster/node-down.sh)"
echo "$CLUSTER_DIR" >/run/triptych-real-node.owner
t_start=$SECONDS

# ---------------------------------------------------------------- host state this node adds (undone by node-down.sh)
# Paths the node's software writes outside $NODE_DIR: remember which existed before, so that
# node-down.sh removes only what this node created.
if [ ! -f "$NODE_DIR/preexisting" ]; then
  for p in /var/lib/kubelet /var/log/containers /var/log/pods /usr/libexec/kubernetes /run/containerd /var/lib/cni /etc/cni /run/netns; do
    [ -e "$p" ] && echo "$p"
  done >"$NODE_DIR/preexisting"
  ls /run/netns 2>/dev/null >"$NODE_DIR/preexisting-netns" || true
  sysctl -n net.bridge.bridge-nf-call-iptables net.ipv4.ip_forward >"$NODE_DIR/sysctls" 2>/dev/null || true
fi
# Bridged pod-to-Service traffic must pass iptables (kube-proxy's DNAT); pods route through the host.
sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.ipv4.ip_forward=1

if ! ip -o addr show | grep -w "inet $NODE_IP/32" >/dev/null; then
  if ip link add triptych-node type dummy 2>/dev/null; then
    ip addr add "$NODE_IP/32" dev triptych-node && ip link set triptych-node up
    echo dummy >"$NODE_DIR/node-ip-device"
  else # no dummy driver in this kernel: the node IP as a /32 on lo (reachable only from this machine)
    ip addr add "$NODE_IP/32" dev lo
    echo lo >"$NODE_DIR/node-ip-device"
  fi
  log "node IP $NODE_IP on $(cat "$NODE_DIR/node-ip-device")"
fi

# ---------------------------------------------------------------- certificates and kubeconfigs
new_cert "$NODE_DIR/certs" kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" ca clientAuth
new_cert "$NODE_DIR/certs" kube-proxy "/CN=system:kube-proxy" ca clientAuth
new_cert "$NODE_DIR/certs" coredns "/CN=triptych:coredns" ca clientAuth
write_kubeconfig "$NODE_DIR/kubelet.kubeconfig" "$NODE_DIR/certs" kubelet
write_kubeconfig "$NODE_DIR/kube-proxy.kubeconfig" "$NODE_DIR/certs" kube-proxy
write_kubeconfig "$NODE_DIR/coredns.kubeconfig" "$NODE_DIR/certs" coredns

# ---------------------------------------------------------------- containerd
mkdir -p "$NODE_DIR/containerd" "$NODE_CONTAINERD_ROOT" "$NODE_DIR/cni/net.d" "$NODE_DIR/cni/ipam"
cat >"$NODE_DIR/containerd/config.toml" <<EOF
version = 2
root = "$NODE_CONTAINERD_ROOT"
state = "$NODE_DIR/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # runc cannot set oom_score_adj below the containerd's own here (no CAP_SYS_RESOURCE): without this the
  # first sandbox fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$NODE_DIR/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$NODE_DIR/cni/net.d"
EOF
start containerd "$(command -v containerd)" --config "$NODE_DIR/containerd/config.toml"
wait_for 30 "containerd on $SOCK" "${CTR[@]}" version

# The sandbox image: the static pause binary, as a one-layer OCI archive made here.
if ! "${CTR[@]}" images ls -q | grep -x "$PAUSE_IMAGE" >/dev/null; then
  python3 "$CLUSTER_SRC/oci_archive.py" "$PAUSE_IMAGE" "$NODE_DIR/pause.tar" "$NODE_BIN_DIR/pause" /pause
  "${CTR[@]}" images import "$NODE_DIR/pause.tar" >/dev/null
  log "imported $PAUSE_IMAGE"
fi

# ---------------------------------------------------------------- kubelet
mkdir -p "$NODE_DIR/kubelet" "$NODE_DIR/pod-logs" "$NODE_DIR/volume-plugins"
: >"$NODE_DIR/resolv.conf"  # pods with dnsPolicy Default get no host resolver (nothing leaves the machine)
cat >"$NODE_DIR/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $CERTS/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failSwapOn: false
failCgroupV1: false
containerRuntimeEndpoint: unix://$SOCK
podLogsDir: $NODE_DIR/pod-logs
volumePluginDir: $NODE_DIR/volume-plugins
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
resolvConf: $NODE_DIR/resolv.conf
evictionHard: {memory.available: "1%", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerWithTaints:
- {key: triptych.dev/real-node, value: "true", effect: NoSchedule}
EOF
start kubelet "$NODE_BIN_DIR/kubelet" \
  --config="$NODE_DIR/kubelet-config.yaml" \
  --kubeconfig="$NODE_DIR/kubelet.kubeconfig" \
  --root-dir="$NODE_DIR/kubelet" \
  --cert-dir="$NODE_DIR/kubelet/pki" \
  --hostname-override="$NODE_NAME" \
  --node-ip="$NODE_IP" \
  --node-labels="triptych.dev/real-node=true"
wait_for 60 "node $NODE_NAME to register" "${KUBECTL[@]}" get node "$NODE_NAME"
# A kubelet may not set node-role labels on itself (NodeRestriction); the admin does.
"${KUBECTL[@]}" label node "$NODE_NAME" node-role.kubernetes.io/real= --overwrite >/dev/null

# The pod network: bridge + host-local IPAM in the pod CIDR the controller-manager gave the node.
wait_for 30 "a pod CIDR for $NODE_NAME" test -n "$("${KUBECTL[@]}" get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}')"
pod_cidr=$("${KUBECTL[@]}" get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}')
cat >"$NODE_DIR/cni/net.d/10-triptych.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "triptych",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$NODE_BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$NODE_DIR/cni/ipam",
        "ranges": [[{"subnet": "$pod_cidr"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF
node_ready() {
  [ "$("${KUBECTL[@]}" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
wait_for 90 "node $NODE_NAME Ready" node_ready

# ---------------------------------------------------------------- kube-proxy (iptables)
cat >"$NODE_DIR/kube-proxy-config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $NODE_DIR/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
clusterCIDR: $POD_CIDR
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
nodePortAddresses: [$NODE_IP/32]
conntrack: {maxPerCore: 0}
EOF
start kube-proxy "$NODE_BIN_DIR/kube-proxy" --config="$NODE_DIR/kube-proxy-config.yaml"

# ---------------------------------------------------------------- CoreDNS (a host process behind the kube-dns Service)
"${KUBECTL[@]}" apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "triptych:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "triptych:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "triptych:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "triptych:coredns"}
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns}
spec:
  clusterIP: $DNS_IP
  ports:
  - {name: dns, protocol: UDP, port: 53, targetPort: $COREDNS_PORT}
  - {name: dns-tcp, protocol: TCP, port: 53, targetPort: $COREDNS_PORT}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-host
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: triptych-node-up}
addressType: IPv4
endpoints:
- addresses: [$NODE_IP]
  conditions: {ready: true}
  nodeName: $NODE_NAME
ports:
- {name: dns, protocol: UDP, port: $COREDNS_PORT}
- {name: dns-tcp, protocol: TCP, port: $COREDNS_PORT}
EOF
cat >"$NODE_DIR/Corefile" <<EOF
cluster.local:$COREDNS_PORT in-addr.arpa:$COREDNS_PORT ip6.arpa:$COREDNS_PORT {
    bind $NODE_IP
    errors
    health 127.0.0.1:$COREDNS_HEALTH_PORT
    ready 127.0.0.1:$COREDNS_READY_PORT
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $NODE_DIR/coredns.kubeconfig triptych-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
start coredns "$NODE_BIN_DIR/coredns" -conf "$NODE_DIR/Corefile"
http_ok() { python3 -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1"; }
wait_for 30 "CoreDNS ready" http_ok "http://127.0.0.1:$COREDNS_READY_PORT/ready"
wait_for 30 "kube-proxy healthz" http_ok "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz"
no_not_ready_taint() {
  ! "${KUBECTL[@]}" get node "$NODE_NAME" -o jsonpath='{.spec.taints[*].key}' | grep node.kubernetes.io/not-ready >/dev/null
}
wait_for 60 "the not-ready taint of $NODE_NAME to clear" no_not_ready_taint

log "node $NODE_NAME ($NODE_IP, pods $pod_cidr) ready in $((SECONDS - t_start)) s"
cat <<EOF
node-up: pods run there when they tolerate the taint triptych.dev/real-node=true:NoSchedule (and may select
  the label triptych.dev/real-node=true); images come from containerd's store:
  bash tests/cluster/node-import.sh localhost/triptych-head:0.1.0
node-up: stop it with: bash tests/cluster/node-down.sh (or make cluster-down)   (logs: $LOGS)
EOF
