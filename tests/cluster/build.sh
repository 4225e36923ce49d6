#!/usr/bin/env bash
# Build the local Kubernetes toolchain from the Go module proxy (no container engine, no release downloads):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and helm.
#
# Binaries are cached outside the clone in ${TRIPTYCH_K8S_CACHE:-~/.cache/triptych/k8s}/<version-key>/bin
# and a binary is rebuilt only when it is missing, so a second run takes well under a second.
# The wrapper modules in tests/cluster/toolchain/ pin every dependency (go.mod + go.sum).
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"
SCRIPT="k8s toolchain"

if [ "${1:-}" = "--print-bin-dir" ]; then echo "$BIN_DIR"; exit 0; fi

TOOLCHAIN=$CLUSTER_SRC/toolchain
K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
ALL_BINS=(etcd kwok helm "${K8S_BINS[@]}")

missing=()
for b in "${ALL_BINS[@]}"; do [ -x "$BIN_DIR/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then
  log "up to date in $BIN_DIR"
  exit 0
fi

find_go "Go >= 1.26 for kwok $KWOK_VERSION"
mkdir -p "$BIN_DIR"
build_lock "$K8S_CACHE/.build.lock"
build_one() { go_build "$1" "$BIN_DIR/$2" "$3" "${4:-}"; }  # <module dir> <output> <package> [ldflags]
version_ldflags=$(k8s_version_ldflags)

start_all=$SECONDS
for b in "${ALL_BINS[@]}"; do
  [ -x "$BIN_DIR/$b" ] && continue
  t0=$SECONDS
  case $b in
    etcd)
      log "building etcd $ETCD_VERSION (first time, ~2 min)"
      build_one etcd etcd go.etcd.io/etcd/server/v3 ;;
    kwok)
      log "building kwok $KWOK_VERSION (first time, ~2 min)"
      build_one kwok kwok sigs.k8s.io/kwok/cmd/kwok \
        "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" ;;
    helm)
      log "building helm $HELM_VERSION (first time, ~2 min)"
      # As helm's Makefile: the default Kubernetes version (helm template, lint) follows its client-go.
      cg=$(awk '$1 == "k8s.io/client-go" {print $2}' "$TOOLCHAIN/helm/go.mod")  # v0.<minor>.<patch>
      cg_minor=${cg#v0.}; cg_minor=${cg_minor%%.*}
      helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
      for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        helm_ldflags+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$cg_minor"
      done
      build_one helm helm helm.sh/helm/v3/cmd/helm "$helm_ldflags" ;;
    kube-apiserver)
      log "building kube-apiserver $K8S_VERSION (first time, ~10 min)"
      build_one k8s "$b" "k8s.io/kubernetes/cmd/$b" "$version_ldflags" ;;
    *)
      log "building $b $K8S_VERSION (first time, ~3 min)"
      build_one k8s "$b" "k8s.io/kubernetes/cmd/$b" "$version_ldflags" ;;
  esac
  log "built $b in $((SECONDS - t0)) s"
done
log "all binaries in $BIN_DIR (built in $((SECONDS - start_all)) s)"
