#!/usr/bin/env bash
# Copy images from podman's local store (make images) into the real node's containerd (namespace k8s.io),
# so pods use them with imagePullPolicy IfNotPresent or Never. Skips an image containerd already has
# with the same image ID.
#   bash tests/cluster/node-import.sh localhost/triptych-head:0.1.0 [more images...]
set -euo pipefail
source "$(dirname "$0")/env.sh"
SOCK=$NODE_DIR/containerd/containerd.sock
CTR=(ctr --address "$SOCK" -n k8s.io)
[ -S "$SOCK" ] || { echo "node-import.sh: no real node runs for $CLUSTER_DIR (bash tests/cluster/node-up.sh)" >&2; exit 1; }
for image in "$@"; do
  cfg=""
  id=$(podman image inspect --format '{{.Id}}' "$image") ||
    { echo "node-import.sh: $image is not in podman's store (make images)" >&2; exit 1; }
  # containerd's image config digest is podman's image ID.
  if "${CTR[@]}" images ls | awk -v n="$image" '$1 == n' | grep -q .; then
    have=$("${CTR[@]}" images ls | awk -v n="$image" '$1 == n {print $3}')
    cfg=$("${CTR[@]}" content get "$have" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["config"]["digest"])' 2>/dev/null || true)
    if [ "$cfg" = "sha256:$id" ]; then echo "node-import: $image up to date"; continue; fi
  fi
  t0=$SECONDS
  tmp=$(mktemp -p "$NODE_DIR" image.XXXXXX.tar)
  podman save --quiet --format docker-archive -o "$tmp" "$image" >/dev/null
  "${CTR[@]}" images import "$tmp" >/dev/null
  rm -f "$tmp"
  # The CRI plugin also names each image it has seen by its ID (sha256:<config digest>): drop the
  # replaced version's name, or its layers stay in this store (kept between runs) for good.
  if [ -n "$cfg" ] && [ "$cfg" != "sha256:$id" ]; then "${CTR[@]}" images rm "$cfg" >/dev/null 2>&1 || true; fi
  echo "node-import: imported $image in $((SECONDS - t0)) s"
done
