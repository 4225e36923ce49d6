#!/usr/bin/env bash
# Build the real node's binaries from the Go module proxy (make setup; docs/local-cluster.md "A real node"):
# kubelet and kube-proxy (k8s.io/kubernetes, the apiserver's version), CoreDNS (a trimmed plugin set) and
# a static pause binary for the pod sandbox image.
#
# Cached like build.sh's toolchain, in ${TRIPTYCH_K8S_CACHE:-~/.cache/triptych/k8s}/node-<key>/bin, keyed
# by the wrapper modules in tests/cluster/toolchain/{node,coredns,pause}; a binary is rebuilt only when missing.
set -euo pipefail
source "$(dirname "$0")/env.sh"

if [ "${1:-}" = "--print-bin-dir" ]; then echo "$NODE_BIN_DIR"; exit 0; fi

TOOLCHAIN=$CLUSTER_SRC/toolchain
ALL_BINS=(pause kubelet kube-proxy coredns)
missing=()
for b in "${ALL_BINS[@]}"; do [ -x "$NODE_BIN_DIR/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "node toolchain: up to date in $NODE_BIN_DIR"
  exit 0
fi

GO=$(command -v go || echo /usr/local/go/bin/go)
[ -x "$GO" ] || { echo "build-node.sh: Go not found (need Go >= 1.25 for CoreDNS $COREDNS_VERSION)" >&2; exit 1; }
mkdir -p "$NODE_BIN_DIR"
exec 9>"$K8S_CACHE/.build-node.lock"
if ! flock -n 9; then
  echo "node toolchain: another build is running, waiting for it (lock $K8S_CACHE/.build-node.lock)"
  flock 9
fi

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-buildvcs=false -mod=readonly"
build_one() { # <module dir> <output> <package> [ldflags]
  local dir=$1 out=$2 pkg=$3 ldflags=${4:-}
  local tmp="$NODE_BIN_DIR/.$out.tmp.$$"
  (cd "$TOOLCHAIN/$dir" && "$GO" build -p 2 -trimpath -ldflags "-s -w $ldflags" -o "$tmp" "$pkg")
  mv -f "$tmp" "$NODE_BIN_DIR/$out"
}

minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
version_ldflags=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  version_ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

start_all=$SECONDS
for b in "${ALL_BINS[@]}"; do
  [ -x "$NODE_BIN_DIR/$b" ] && continue
  t0=$SECONDS
  case $b in
    pause) build_one pause pause . ;;
    coredns)
      echo "node toolchain: building CoreDNS $COREDNS_VERSION (first time, ~6 min)"
      build_one coredns coredns . "-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" ;;
    *)
      echo "node toolchain: building $b $K8S_VERSION (first time: kubelet ~9 min, kube-proxy ~1 min after it)"
      build_one node "$b" "k8s.io/kubernetes/cmd/$b" "$version_ldflags" ;;
  esac
  echo "node toolchain: built $b in $((SECONDS - t0)) s"
done
echo "node toolchain: all binaries in $NODE_BIN_DIR (built in $((SECONDS - start_all)) s)"
