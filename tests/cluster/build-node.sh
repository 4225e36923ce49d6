#!/usr/bin/env bash
# Build the real node's binaries from the Go module proxy (make setup; docs/local-cluster.md "A real node"):
# kubelet and kube-proxy (k8s.io/kubernetes, the apiserver's version), CoreDNS (a trimmed plugin set) and
# a static pause binary for the pod sandbox image.
#
# Cached like build.sh's toolchain, in ${TRIPTYCH_K8S_CACHE:-~/.cache/triptych/k8s}/node-<key>/bin, keyed
# by the wrapper modules in tests/cluster/toolchain/{node,coredns,pause}; a binary is rebuilt only when missing.
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"
SCRIPT="node toolchain"

if [ "${1:-}" = "--print-bin-dir" ]; then echo "$NODE_BIN_DIR"; exit 0; fi

# build_binary <name> <output file>: how each one is built (build_missing in lib.sh calls it for the missing ones).
build_binary() {
  local b=$1 out=$2
  case $b in
    pause) go_build pause "$out" . ;;
    coredns)
      log "building CoreDNS $COREDNS_VERSION (first time, ~1 min on 2 idle cores)"
      go_build coredns "$out" . "-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" ;;
    *)
      log "building $b $K8S_VERSION (first time, under a minute after the control plane)"
      go_build node "$out" "k8s.io/kubernetes/cmd/$b" "$(k8s_version_ldflags)" ;;
  esac
}

build_missing "$NODE_BIN_DIR" "$K8S_CACHE/.build-node.lock" "Go >= 1.25 for CoreDNS $COREDNS_VERSION" \
  pause kubelet kube-proxy coredns
