#!/usr/bin/env bash
# Build the local Kubernetes toolchain from the Go module proxy (no container engine, no release downloads):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and helm; and promtool, which
# the alerting rules' tests run (its own cache key: PROMTOOL_BIN_DIR).
#
# Binaries are cached outside the clone in ${TRIPTYCH_K8S_CACHE:-~/.cache/triptych/k8s}/<version-key>/bin
# and a binary is rebuilt only when it is missing, so a second run takes well under a second.
# The wrapper modules in tests/cluster/toolchain/ pin every dependency (go.mod + go.sum).
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"
SCRIPT="k8s toolchain"

if [ "${1:-}" = "--print-bin-dir" ]; then echo "$BIN_DIR"; exit 0; fi
if [ "${1:-}" = "--print-promtool" ]; then echo "$PROMTOOL_BIN_DIR/promtool"; exit 0; fi

# build_binary <name> <output file>: how each one is built (build_missing in lib.sh calls it for the missing ones).
build_binary() {
  local b=$1 out=$2 cg cg_minor helm_ldflags p
  case $b in
    etcd)
      log "building etcd $ETCD_VERSION (first time, ~1 min on 2 idle cores)"
      go_build etcd "$out" go.etcd.io/etcd/server/v3 ;;
    kwok)
      log "building kwok $KWOK_VERSION (first time, ~1.5 min)"
      go_build kwok "$out" sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" ;;
    helm)
      log "building helm $HELM_VERSION (first time, ~1 min)"
      # As helm's Makefile: the default Kubernetes version (helm template, lint) follows its client-go.
      cg=$(awk '$1 == "k8s.io/client-go" {print $2}' "$CLUSTER_SRC/toolchain/helm/go.mod")  # v0.<minor>.<patch>
      cg_minor=${cg#v0.}; cg_minor=${cg_minor%%.*}
      helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
      for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        helm_ldflags+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$cg_minor"
      done
      go_build helm "$out" helm.sh/helm/v3/cmd/helm "$helm_ldflags" ;;
    promtool)
      # remove_all_sd: without Prometheus's service discovery (the cloud SDKs: most of the compile),
      # which the rule checks and rule tests never use (~2 min cold instead of ~5, or ~16 beside a CI run).
      log "building promtool $PROMETHEUS_VERSION (first time, ~2 min on 2 idle cores)"
      go_build promtool "$out" github.com/prometheus/prometheus/cmd/promtool "" remove_all_sd ;;
    kube-apiserver)
      log "building kube-apiserver $K8S_VERSION (first time, ~3.5 min)"
      go_build k8s "$out" "k8s.io/kubernetes/cmd/$b" "$(k8s_version_ldflags)" ;;
    *)
      log "building $b $K8S_VERSION (first time, under a minute after kube-apiserver)"
      go_build k8s "$out" "k8s.io/kubernetes/cmd/$b" "$(k8s_version_ldflags)" ;;
  esac
}

build_missing "$BIN_DIR" "$K8S_CACHE/.build.lock" "Go >= 1.26 for kwok $KWOK_VERSION" \
  etcd kwok helm kube-apiserver kube-controller-manager kube-scheduler kubectl
build_missing "$PROMTOOL_BIN_DIR" "$K8S_CACHE/.build.lock" "Go >= 1.26 for promtool $PROMETHEUS_VERSION" promtool
