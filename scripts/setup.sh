#!/usr/bin/env bash
# Idempotent set-up: system libraries, the project venv, and the local Kubernetes toolchain.
# A second run is fast: each step is skipped when its result is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMPS=.stamps
mkdir -p "$STAMPS"

need_libs=()
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1 libcurl.so.4; do
  ldconfig -p | grep -q "$lib" || need_libs+=("$lib")
done
if ((${#need_libs[@]})) || ! command -v openssl >/dev/null; then
  echo "setup: installing Debian libraries for Mooncake (${need_libs[*]:-openssl})"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 libcurl4 openssl >/dev/null
fi

# Container images (make images, tests/images): podman with runc (crun fails on this kind of host's
# hybrid cgroups; images/local/containers.conf selects runc) and debootstrap for the local base.
need_tools=()
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || need_tools+=("$tool")
done
if ((${#need_tools[@]})); then
  echo "setup: installing Debian packages for building images (${need_tools[*]})"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq podman runc debootstrap >/dev/null
fi

# The playground's browser test (tests/e2e/test_playground.py): Playwright drives Debian's Chromium,
# so no browser is downloaded.
if ! command -v chromium >/dev/null; then
  echo "setup: installing Debian's chromium for the browser test"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

# What earlier runs left in /tmp on a reused machine (a test folder before it was removed after use; pip's
# pip-unpack-* copies of wheels, see below): only ours, and only older than two hours, so no live run's.
leftovers=$(find /tmp -maxdepth 1 -mmin +120 \( -name 'triptych-contract-*' -o -name 'triptych-lora-api-*' \
  -o -name 'triptych-s3-head-*' -o -name 'pip-unpack-*' \) 2>/dev/null || true)
if [ -n "$leftovers" ]; then
  echo "setup: removing $(du -csh $leftovers 2>/dev/null | tail -1 | cut -f1) that earlier runs left in /tmp"
  rm -rf $leftovers
fi

# A full first install takes ~40 GB (the venv 6, the real node's containerd 14, the images 9, Go's caches 10);
# say so before a step fails half-way with "No space left on device".
free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt 10 ]; then
  echo "setup: warning: only ${free_gb} GB free on $(df -P . | awk 'NR == 2 {print $6}'); a first install needs ~40 GB" >&2
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
key=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$STAMPS/venv-$key" ] || ! "$VENV/bin/python" -c "import triptych, triptych_dev, mooncake, diffusers" 2>/dev/null; then
  echo "setup: installing the project into $VENV (torch is large; pip's cache keeps later runs fast)"
  # pip's temporary folder of its own, removed after: pip leaves a pip-unpack-* copy of every wheel (~3 GB
  # here) in TMPDIR, which on a reused machine filled /tmp over a few fresh installs.
  pip_tmp="$PWD/$STAMPS/pip-tmp"
  rm -rf "$pip_tmp"; mkdir -p "$pip_tmp"
  TMPDIR="$pip_tmp" "$VENV/bin/pip" install -q --upgrade pip
  TMPDIR="$pip_tmp" "$VENV/bin/pip" install -q -c constraints.txt -e '.[test]'
  rm -rf "$pip_tmp"
  rm -f "$STAMPS"/venv-*; touch "$STAMPS/venv-$key"
fi

# The worker's bind shim (an LD_PRELOAD library, C): Mooncake's listeners on --disagg-p2p-hostname only.
if ! command -v "${CC:-gcc}" >/dev/null || [ ! -f /usr/include/stdio.h ]; then
  echo "setup: installing a C compiler for the worker's bind shim"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev >/dev/null
fi
bash scripts/build-bind-shim.sh

bash tests/cluster/build.sh
bash tests/s3/build.sh  # SeaweedFS: the S3-compatible server the result-store tests run (tests/s3)

# The real node that tests/cluster/test_real_node.py runs the product on (docs/local-cluster.md "A real node"):
# Debian's containerd, runc, CNI plugins, iptables, conntrack, skopeo, and kubelet/kube-proxy/CoreDNS/pause built from
# the Go module proxy (cached like the control plane; README "What setup and tests cost").
need_pkgs=()
command -v containerd >/dev/null || need_pkgs+=(containerd)
command -v runc >/dev/null || need_pkgs+=(runc)
[ -x /usr/lib/cni/bridge ] || need_pkgs+=(containernetworking-plugins)
command -v iptables >/dev/null || need_pkgs+=(iptables)
command -v conntrack >/dev/null || need_pkgs+=(conntrack)
command -v skopeo >/dev/null || need_pkgs+=(skopeo)  # node-import.sh: only the layers containerd lacks travel
if ((${#need_pkgs[@]})); then
  echo "setup: installing Debian packages for the real node (${need_pkgs[*]})"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
bash tests/cluster/build-node.sh
echo "setup: done"
