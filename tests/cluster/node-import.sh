#!/usr/bin/env bash
# Copy images from podman's local store (make images) into the real node's containerd (namespace k8s.io),
# so pods use them with imagePullPolicy IfNotPresent or Never. Skips an image containerd already has
# with the same image ID.
#   bash tests/cluster/node-import.sh localhost/triptych-head:0.1.0 [more images...]
#
# Only the layers containerd lacks travel: skopeo writes the image as an OCI layout whose blob dir
# already holds (as symlinks) every blob containerd has, so it skips those and writes only the
# others (after a code change, the worker's code layers: a few MB of its 6.5 GB); the layout's
# index, manifest, config and new blobs then stream into `ctr images import` as a partial OCI
# archive (containerd finds the other layers in its own store), which unpacks only the new layers.
# Each import prints what it sent: "sent N of M blobs (X MB)".
set -euo pipefail
source "$(dirname "$0")/env.sh"
SOCK=$NODE_DIR/containerd/containerd.sock
CTR=(ctr --address "$SOCK" -n k8s.io)
[ -S "$SOCK" ] || { echo "node-import.sh: no real node runs for $CLUSTER_DIR (bash tests/cluster/node-up.sh)" >&2; exit 1; }
# containerd's content store on disk: the root the running containerd was started with (node-up.sh's config).
BLOBS=$(sed -n 's/^root = "\(.*\)"$/\1/p' "$NODE_DIR/containerd/config.toml")/io.containerd.content.v1.content/blobs/sha256
command -v skopeo >/dev/null || { echo "node-import.sh: skopeo is missing; run \`make setup\`" >&2; exit 1; }

# The config digest of the image containerd has under this name (empty when it has none).
node_config() {
  local target
  target=$("${CTR[@]}" images ls | awk -v n="$1" '$1 == n {print $3}')
  [ -n "$target" ] || return 0
  "${CTR[@]}" content get "$target" 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["config"]["digest"])' 2>/dev/null || true
}

# The CRI plugin also names each image it has seen by its ID (sha256:<config digest>). Drop every such
# name that no tagged image's config is, or a replaced version's layers stay in this store (kept
# between runs) for good; containerd's GC then removes their content and snapshots.
drop_untagged_ids() {
  local keep name
  keep=$("${CTR[@]}" images ls -q | grep -v '^sha256:' | while read -r name; do node_config "$name"; done)
  for name in $("${CTR[@]}" images ls -q | grep '^sha256:' || true); do
    grep -qx "$name" <<<"$keep" || "${CTR[@]}" images rm "$name" >/dev/null 2>&1 || true
  done
}

imported=0
for image in "$@"; do
  id=$(podman image inspect --format '{{.Id}}' "$image") ||
    { echo "node-import.sh: $image is not in podman's store (make images)" >&2; exit 1; }
  # containerd's image config digest is podman's image ID.
  if [ "$(node_config "$image")" = "sha256:$id" ]; then echo "node-import: $image up to date"; continue; fi
  t0=$SECONDS
  layout=$(mktemp -d -p "$NODE_DIR" image.XXXXXX)
  trap 'rm -rf "$layout" "$layout.sent" "$layout.err"' EXIT
  mkdir -p "$layout/blobs/sha256"
  for digest in $("${CTR[@]}" content ls -q); do
    [ -f "$BLOBS/${digest#sha256:}" ] && ln -s "$BLOBS/${digest#sha256:}" "$layout/blobs/sha256/${digest#sha256:}"
  done
  skopeo copy --quiet --dest-oci-accept-uncompressed-layers "containers-storage:$image" "oci:$layout:$image" >/dev/null
  t1=$SECONDS
  (cd "$layout" && find blobs -type f) >"$layout.sent"
  sent=$(wc -l <"$layout.sent")
  bytes=$( (cd "$layout" && xargs -r du -cb <"$layout.sent" | awk 'END {printf "%d", $1}'))
  # containerd's GC can remove a snapshot while an unpack is about to build on it (seen once: "parent
  # snapshot ... does not exist" on the worker, the run after another had replaced its images); a
  # second import finds it missing and unpacks that layer again from the content store.
  if ! tar -C "$layout" -c oci-layout index.json -T "$layout.sent" |
    "${CTR[@]}" images import - >/dev/null 2>"$layout.err"; then
    echo "node-import: importing $image failed ($(tail -n 1 "$layout.err")); importing it once more" >&2
    sleep 2
    tar -C "$layout" -c oci-layout index.json -T "$layout.sent" | "${CTR[@]}" images import - >/dev/null
  fi
  rm -rf "$layout" "$layout.sent" "$layout.err"
  trap - EXIT
  echo "node-import: imported $image in $((SECONDS - t0)) s (sent $sent blobs, $bytes bytes; skopeo $((t1 - t0)) s, import and unpack $((SECONDS - t1)) s)"
  imported=1
done
[ "$imported" = 0 ] || drop_untagged_ids
