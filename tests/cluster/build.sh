#!/usr/bin/env bash
# Build the local Kubernetes toolchain from the Go module proxy (no container engine, no release downloads):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and helm.
#
# Binaries are cached outside the clone in ${TRIPTYCH_K8S_CACHE:-~/.cache/triptych/k8s}/<version-key>/bin
# and a binary is rebuilt only when it is missing, so a second run takes well under a second.
# The wrapper modules in tests/cluster/toolchain/ pin every dependency (go.mod + go.sum).
set -euo pipefail
source "$(dirname "$0")/env.sh"

if [ "${1:-}" = "--print-bin-dir" ]; then echo "$BIN_DIR"; exit 0; fi

TOOLCHAIN=$CLUSTER_SRC/toolchain
K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
ALL_BINS=(etcd kwok helm "${K8S_BINS[@]}")

missing=()
for b in "${ALL_BINS[@]}"; do [ -x "$BIN_DIR/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "k8s toolchain: up to date in $BIN_DIR"
  exit 0
fi

GO=$(command -v go || echo /usr/local/go/bin/go)
[ -x "$GO" ] || { echo "build.sh: Go not found (need Go >= 1.26 for kwok $KWOK_VERSION)" >&2; exit 1; }

mkdir -p "$BIN_DIR"
# One build at a time per cache (pytest workers or two shells may call us concurrently).
exec 9>"$K8S_CACHE/.build.lock"
if ! flock -n 9; then
  echo "k8s toolchain: another build is running, waiting for it (lock $K8S_CACHE/.build.lock)"
  flock 9
fi

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-buildvcs=false -mod=readonly"
BUILD=("$GO" build -p 2 -trimpath)

# go build <module dir> <output> <package> [ldflags]
build_one() {
  local dir=$1 out=$2 pkg=$3 ldflags=${4:-}
  local tmp="$BIN_DIR/.$out.tmp.$$"
  (cd "$TOOLCHAIN/$dir" && "${BUILD[@]}" -ldflags "-s -w $ldflags" -o "$tmp" "$pkg")
  mv -f "$tmp" "$BIN_DIR/$out"
}

minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
version_ldflags=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  version_ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

start_all=$SECONDS
for b in "${ALL_BINS[@]}"; do
  [ -x "$BIN_DIR/$b" ] && continue
  t0=$SECONDS
  case $b in
    etcd)
      echo "k8s toolchain: building etcd $ETCD_VERSION (first time, ~2 min)"
      build_one etcd etcd go.etcd.io/etcd/server/v3 ;;
    kwok)
      echo "k8s toolchain: building kwok $KWOK_VERSION (first time, ~2 min)"
      build_one kwok kwok sigs.k8s.io/kwok/cmd/kwok \
        "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" ;;
    helm)
      echo "k8s toolchain: building helm $HELM_VERSION (first time, ~2 min)"
      # As helm's Makefile: the default Kubernetes version (helm template, lint) follows its client-go.
      cg=$(awk '$1 == "k8s.io/client-go" {print $2}' "$TOOLCHAIN/helm/go.mod")  # v0.<minor>.<patch>
      cg_minor=${cg#v0.}; cg_minor=${cg_minor%%.*}
      helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
      for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        helm_ldflags+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$cg_minor"
      done
      build_one helm helm helm.sh/helm/v3/cmd/helm "$helm_ldflags" ;;
    kube-apiserver)
      echo "k8s toolchain: building kube-apiserver $K8S_VERSION (first time, ~10 min)"
      build_one k8s "$b" "k8s.io/kubernetes/cmd/$b" "$version_ldflags" ;;
    *)
      echo "k8s toolchain: building $b $K8S_VERSION (first time, ~3 min)"
      build_one k8s "$b" "k8s.io/kubernetes/cmd/$b" "$version_ldflags" ;;
  esac
  echo "k8s toolchain: built $b in $((SECONDS - t0)) s"
done
echo "k8s toolchain: all binaries in $BIN_DIR (built in $((SECONDS - start_all)) s)"
