#!/usr/bin/env bash
# Build the real node's binaries from the Go module proxy (opt-in, see docs/local-cluster.md "A real node"):
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

ALL_BINS=(pause kubelet kube-proxy coredns)
missing=()
for b in "${ALL_BINS[@]}"; do [ -x "$NODE_BIN_DIR/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then
  log "up to date in $NODE_BIN_DIR"
  exit 0
fi

find_go "Go >= 1.25 for CoreDNS $COREDNS_VERSION"
mkdir -p "$NODE_BIN_DIR"
build_lock "$K8S_CACHE/.build-node.lock"
build_one() { go_build "$1" "$NODE_BIN_DIR/$2" "$3" "${4:-}"; }  # <module dir> <output> <package> [ldflags]
version_ldflags=$(k8s_version_ldflags)

start_all=$SECONDS
for b in "${ALL_BINS[@]}"; do
  [ -x "$NODE_BIN_DIR/$b" ] && continue
  t0=$SECONDS
  case $b in
    pause) build_one pause pause . ;;
    coredns)
      log "building CoreDNS $COREDNS_VERSION (first time, ~6 min)"
      build_one coredns coredns . "-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" ;;
    *)
      log "building $b $K8S_VERSION (first time: kubelet ~9 min, kube-proxy ~1 min after it)"
      build_one node "$b" "k8s.io/kubernetes/cmd/$b" "$version_ldflags" ;;
  esac
  log "built $b in $((SECONDS - t0)) s"
done
log "all binaries in $NODE_BIN_DIR (built in $((SECONDS - start_all)) s)"
