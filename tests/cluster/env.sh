# Shared settings for build.sh, up.sh and down.sh (sourced, not executed).
# Every value can be overridden from the environment.
# `bash tests/cluster/env.sh` prints the resolved settings as KEY=VALUE lines (used by fixtures.py).

CLUSTER_SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# --- pinned versions (the wrapper modules under toolchain/ pin every dependency) ---
K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.14
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.21.4

# The cache key changes whenever a version, a wrapper go.mod/go.sum or the build flags change.
# (Only the control plane's modules: the real node's (node, coredns, pause) have their own key below.)
_toolchain_hash=$(cat "$CLUSTER_SRC"/toolchain/{etcd,helm,k8s,kwok}/go.mod "$CLUSTER_SRC"/toolchain/{etcd,helm,k8s,kwok}/go.sum \
  <(echo "cgo0 trimpath ldflags-v2") | sha256sum | cut -c1-10)
K8S_CACHE=${TRIPTYCH_K8S_CACHE:-$HOME/.cache/triptych/k8s}
VERSION_KEY=k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_${_toolchain_hash}
BIN_DIR=$K8S_CACHE/$VERSION_KEY/bin

# --- the real node's binaries (tests/cluster/build-node.sh): kubelet, kube-proxy, CoreDNS, pause ---
COREDNS_VERSION=v1.14.7
_node_hash=$(cat "$CLUSTER_SRC"/toolchain/node/go.{mod,sum} "$CLUSTER_SRC"/toolchain/coredns/{go.mod,go.sum,main.go} \
  "$CLUSTER_SRC"/toolchain/pause/{go.mod,main.go} <(echo "cgo0 trimpath ldflags-v2") | sha256sum | cut -c1-10)
NODE_BIN_DIR=$K8S_CACHE/node-${K8S_VERSION}_coredns-${COREDNS_VERSION}_${_node_hash}/bin

# --- promtool (tests/operator/test_alerts.py: the chart's alerting rules run by Prometheus's own rule engine) ---
PROMETHEUS_VERSION=v0.316.0  # the Go module's version of Prometheus 3.x's promtool
_promtool_hash=$(cat "$CLUSTER_SRC"/toolchain/promtool/go.{mod,sum} <(echo "cgo0 trimpath ldflags-v2 remove_all_sd") | sha256sum | cut -c1-10)
PROMTOOL_BIN_DIR=$K8S_CACHE/promtool-${PROMETHEUS_VERSION}_${_promtool_hash}/bin

# --- running cluster (loopback only) ---
CLUSTER_DIR=${TRIPTYCH_CLUSTER_DIR:-$HOME/.cache/triptych/cluster}
ETCD_CLIENT_PORT=${TRIPTYCH_ETCD_PORT:-12379}
ETCD_PEER_PORT=${TRIPTYCH_ETCD_PEER_PORT:-12380}
APISERVER_PORT=${TRIPTYCH_APISERVER_PORT:-16443}
KCM_PORT=${TRIPTYCH_KCM_PORT:-16257}
SCHEDULER_PORT=${TRIPTYCH_SCHEDULER_PORT:-16259}
KWOK_PORT=${TRIPTYCH_KWOK_PORT:-16280}
SERVICE_CIDR=${TRIPTYCH_SERVICE_CIDR:-198.18.0.0/16}
POD_CIDR=${TRIPTYCH_POD_CIDR:-198.19.0.0/16}
RDMA_RESOURCE=${TRIPTYCH_RDMA_RESOURCE:-rdma/ib}
GPU_NODES=${TRIPTYCH_GPU_NODES:-2}
# The controller-manager's client rate (each controller has its own: --use-service-account-credentials)
# and how many Deployments / ReplicaSets it syncs at once. Kubernetes' defaults (20/s with bursts of 30;
# 5 and 5) leave 800 new Deployments (bench/operator_bench.py) waiting minutes for their ReplicaSets.
KCM_API_QPS=${TRIPTYCH_KCM_API_QPS:-200}
KCM_API_BURST=${TRIPTYCH_KCM_API_BURST:-400}
KCM_CONCURRENT_SYNCS=${TRIPTYCH_KCM_CONCURRENT_SYNCS:-20}
KUBECONFIG_PATH=$CLUSTER_DIR/kubeconfig

# --- the real node (TRIPTYCH_REAL_NODE=1: make cluster-up and the real node's test; node-up.sh, node-down.sh) ---
# One per machine (iptables, the bridge and the cgroups are global). Its IP sits on a dummy interface,
# or as a /32 on lo where the dummy driver is missing; pods get the node's pod CIDR on bridge NODE_BRIDGE.
REAL_NODE=${TRIPTYCH_REAL_NODE:-0}
NODE_NAME=${TRIPTYCH_NODE_NAME:-real-node-0}
NODE_IP=${TRIPTYCH_NODE_IP:-192.0.2.250}
NODE_BRIDGE=${TRIPTYCH_NODE_BRIDGE:-triptych0}
NODE_DIR=$CLUSTER_DIR/node
# containerd's root (its image store and snapshots); somewhere lasting, such as the real node test's
# ~/.cache/triptych/node-containerd, keeps imported images from one throw-away cluster to the next.
NODE_CONTAINERD_ROOT=${TRIPTYCH_NODE_CONTAINERD_ROOT:-$NODE_DIR/containerd/root}
KUBELET_PORT=${TRIPTYCH_KUBELET_PORT:-10250}
KUBELET_HEALTHZ_PORT=${TRIPTYCH_KUBELET_HEALTHZ_PORT:-10248}
KUBE_PROXY_HEALTHZ_PORT=${TRIPTYCH_KUBE_PROXY_HEALTHZ_PORT:-10256}
KUBE_PROXY_METRICS_PORT=${TRIPTYCH_KUBE_PROXY_METRICS_PORT:-10249}
COREDNS_PORT=${TRIPTYCH_COREDNS_PORT:-1053}
COREDNS_HEALTH_PORT=${TRIPTYCH_COREDNS_HEALTH_PORT:-18080}
COREDNS_READY_PORT=${TRIPTYCH_COREDNS_READY_PORT:-18181}

COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  for v in K8S_VERSION ETCD_VERSION KWOK_VERSION HELM_VERSION VERSION_KEY K8S_CACHE BIN_DIR CLUSTER_DIR \
    KUBECONFIG_PATH ETCD_CLIENT_PORT ETCD_PEER_PORT APISERVER_PORT KCM_PORT SCHEDULER_PORT KWOK_PORT \
    RDMA_RESOURCE NODE_BIN_DIR REAL_NODE NODE_NAME NODE_IP NODE_BRIDGE NODE_DIR NODE_CONTAINERD_ROOT; do
    echo "$v=${!v}"
  done
fi
