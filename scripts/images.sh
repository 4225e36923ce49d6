#!/usr/bin/env bash
# `make images`: build the operator, head and worker images from images/*.Dockerfile on this machine.
#
#   scripts/images.sh [operator] [head] [worker]     (default: all three)
#
# No registry is reachable here, so the upstream bases (python:3.11-slim, nvidia/cuda) are replaced
# by a Debian base made locally with debootstrap; the Dockerfiles themselves are the ones users
# build, and only `--build-arg` values differ (printed with each build). Every image is cached by
# content: its key hashes the Dockerfile, every file it COPYs, the base image and the build
# arguments, and a build is skipped when the tagged image carries that key in its label.
#
# Environment: IMAGE_REPO (tag prefix, default localhost), IMAGE_TAG (default: the project version),
# TRIPTYCH_IMAGES_CACHE (debootstrap's cache and build logs, default ~/.cache/triptych/images).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO_ROOT=$PWD

export CONTAINERS_CONF=$REPO_ROOT/images/local/containers.conf
IMAGE_REPO=${IMAGE_REPO:-localhost}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)}
CACHE=${TRIPTYCH_IMAGES_CACHE:-$HOME/.cache/triptych/images}
LABEL=ai.triptych.content-key
BASE=localhost/triptych-base:bookworm
mkdir -p "$CACHE"

for tool in podman debootstrap runc; do
  command -v "$tool" >/dev/null || { echo "images: $tool is missing; run \`make setup\` (scripts/setup.sh installs it)" >&2; exit 1; }
done

label_of() { podman image inspect --format "{{index .Labels \"$LABEL\"}}" "$1" 2>/dev/null || true; }
id_of() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# Remove the image a build replaced under the same tag (only that one: the store is shared).
drop_replaced() {
  local old=$1 tag=$2
  if [ -n "$old" ] && [ "$old" != "$(id_of "$tag")" ]; then
    podman rmi "$old" >/dev/null 2>&1 || true
  fi
}

# The Debian mirror apt on this host already uses (first URIs: of a deb822 source, else sources.list).
debian_mirror() {
  local m
  m=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1 || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# A python:3.11-slim stand-in: Debian bookworm's python3 (3.11) and `python`, venv (whose pip
# comes from ensurepip's wheel; the system-wide python3-pip is left out, 24 MB the images never
# use), pip allowed to install (EXTERNALLY-MANAGED removed), trusting the same CAs as this host
# (pip reaches PyPI through whatever this host trusts).
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
HOST_CA=/etc/ssl/certs/ca-certificates.crt
build_base() {
  local mirror key rootfs start old
  mirror=$(debian_mirror)
  key=$( { echo "base-v1 bookworm $mirror $BASE_PACKAGES"; sha256sum "$HOST_CA"; } | sha256sum | cut -c1-32)
  if [ "$(label_of "$BASE")" = "$key" ]; then
    echo "images: $BASE is up to date"
    return
  fi
  start=$SECONDS
  old=$(id_of "$BASE")
  echo "images: making $BASE with debootstrap from $mirror"
  rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  ROOTFS_TO_CLEAN=$rootfs
  trap 'rm -rf "$ROOTFS_TO_CLEAN"' EXIT  # also when debootstrap fails and the script exits
  mkdir -p "$CACHE/debs"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" --cache-dir="$CACHE/debs" bookworm "$rootfs" "$mirror" \
    >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  cp "$HOST_CA" "$rootfs/etc/ssl/certs/ca-certificates.crt"
  cp "$HOST_CA" "$rootfs/etc/ssl/host-ca-bundle.crt"  # survives a later update-ca-certificates
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log
  tar -C "$rootfs" --numeric-owner -c . | podman import --quiet \
    --change "LABEL $LABEL=$key" \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "ENV SSL_CERT_FILE=/etc/ssl/host-ca-bundle.crt" \
    --change "ENV PIP_CERT=/etc/ssl/host-ca-bundle.crt" \
    --change "ENV REQUESTS_CA_BUNDLE=/etc/ssl/host-ca-bundle.crt" \
    --change 'CMD ["python3"]' \
    - "$BASE" >/dev/null
  drop_replaced "$old" "$BASE"
  rm -rf "$rootfs"
  echo "images: $BASE made in $((SECONDS - start)) s"
}

# The content key of an image: its Dockerfile, every file its COPY instructions take from the
# context (as .dockerignore filters them), the base image's id and the build arguments.
content_key() {
  python3 - "$@" <<'EOF'
import hashlib, json, shlex, sys
from pathlib import Path

dockerfile, extra = Path(sys.argv[1]), sys.argv[2:]
h = hashlib.sha256(dockerfile.read_bytes())
for e in extra:
    h.update(b"\0" + e.encode())
text = dockerfile.read_text().replace("\\\n", " ")
for line in text.splitlines():
    words = line.split(None, 1)
    if not words or words[0].upper() not in ("COPY", "ADD") or len(words) < 2:
        continue
    args = json.loads(words[1]) if words[1].lstrip().startswith("[") else shlex.split(words[1])
    if any(a.startswith("--from=") for a in args):
        continue
    for source in [a for a in args if not a.startswith("--")][:-1]:
        root = Path(source)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc" or any(p.endswith(".egg-info") for p in f.parts):
                continue
            h.update(b"\0" + str(f).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
print(h.hexdigest()[:32])
EOF
}

# Host pip settings the builds need to reach the same index (none are hard-coded in a Dockerfile).
pip_build_args=()
index_url=${PIP_INDEX_URL:-$(pip3 config get global.index-url 2>/dev/null || true)}
[ -z "$index_url" ] || pip_build_args+=(--build-arg "PIP_INDEX_URL=$index_url")

# Worker built here: the Debian base instead of nvidia/cuda, and Mooncake's non-CUDA wheel (the
# `cpu` extra: TCP transport) instead of the CUDA one; torch is PyPI's wheel either way.
declare -A LOCAL_ARGS=(
  [operator]="--build-arg BASE_IMAGE=$BASE"
  [head]="--build-arg BASE_IMAGE=$BASE"
  [worker]="--build-arg BASE_IMAGE=$BASE --build-arg MOONCAKE_EXTRA=cpu"
)

build_image() {
  local name=$1 dockerfile=images/$1.Dockerfile tag=$IMAGE_REPO/triptych-$1:$IMAGE_TAG key start old
  local -a args
  read -r -a args <<<"${LOCAL_ARGS[$name]}"
  args+=("${pip_build_args[@]}")
  key=$(content_key "$dockerfile" "$(podman image inspect --format '{{.Id}}' "$BASE")" "${args[@]}")
  if [ "$(label_of "$tag")" = "$key" ]; then
    echo "images: $tag is up to date"
    return
  fi
  start=$SECONDS
  old=$(id_of "$tag")
  echo "images: building $tag (${args[*]})"
  # --network host: RUN steps reach PyPI as this host does. --layers: every step is cached, so a
  # change to the code rebuilds only the steps after the Dockerfile's COPY of it (the dependencies'
  # layer, several GB for the worker, is reused); pip's cache is the Dockerfiles' cache mount.
  podman build --pull=never --layers --force-rm --network host \
    --label "$LABEL=$key" "${args[@]}" -f "$dockerfile" -t "$tag" . \
    >"$CACHE/build-$name.log" 2>&1 || {
      tail -30 "$CACHE/build-$name.log" >&2
      echo "images: building $tag failed; the whole log is $CACHE/build-$name.log" >&2
      exit 1
    }
  drop_replaced "$old" "$tag"
  # The steps --layers cached for the replaced image are left untagged; only ours (they carry the base's
  # label) are pruned, and only those no tagged image uses.
  podman image prune --force --filter "label=$LABEL" >/dev/null 2>&1 || true
  echo "images: built $tag in $((SECONDS - start)) s"
}

images=("$@")
((${#images[@]})) || images=(operator head worker)
build_base
for name in "${images[@]}"; do
  [ -f "images/$name.Dockerfile" ] || { echo "images: no images/$name.Dockerfile (operator, head, worker)" >&2; exit 2; }
  build_image "$name"
done
for name in "${images[@]}"; do
  podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE_REPO/triptych-$name:$IMAGE_TAG"
done
