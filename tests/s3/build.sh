#!/usr/bin/env bash
# Build SeaweedFS's `weed`, the S3-compatible server the result-store tests run (tests/s3/seaweedfs.py),
# from the Go module proxy (make setup). SeaweedFS's go.mod has a replace directive, so `go install
# weed@VERSION` refuses it: the wrapper module tests/s3/toolchain pins it (a `tool` line) and copies the replace.
#
# Cached in ${TRIPTYCH_SEAWEEDFS_CACHE:-~/.cache/triptych/seaweedfs}/<key>/bin/weed, keyed by the wrapper's
# go.mod and go.sum and the build flags; rebuilt only when missing (~5 min and ~170 MB the first time).
# `bash tests/s3/build.sh --print-bin` prints the binary's path.
set -euo pipefail
SRC=$(cd "$(dirname "$0")" && pwd)
KEY=$(cat "$SRC/toolchain/go.mod" "$SRC/toolchain/go.sum" <(echo "cgo0 trimpath s-w") | sha256sum | cut -c1-10)
CACHE=${TRIPTYCH_SEAWEEDFS_CACHE:-$HOME/.cache/triptych/seaweedfs}
BIN=$CACHE/$KEY/bin/weed

if [ "${1:-}" = "--print-bin" ]; then echo "$BIN"; exit 0; fi
log() { echo "seaweedfs: $*"; }
if [ -x "$BIN" ]; then log "up to date: $BIN"; exit 0; fi

GO=$(command -v go || echo /usr/local/go/bin/go)
[ -x "$GO" ] || { echo "seaweedfs: Go not found (need Go >= $(awk '/^go /{print $2}' "$SRC/toolchain/go.mod"))" >&2; exit 1; }
mkdir -p "$(dirname "$BIN")"
exec 9>"$CACHE/.build.lock"
flock -n 9 || { log "another build is running, waiting for it"; flock 9; }
[ -x "$BIN" ] && exit 0  # built by the build this one waited for
log "building weed (first time, ~5 min on 2 idle cores)"
start=$SECONDS
tmp="$(dirname "$BIN")/.weed.tmp.$$"
(cd "$SRC/toolchain" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-buildvcs=false -mod=readonly" \
  "$GO" build -p 2 -trimpath -ldflags "-s -w" -o "$tmp" github.com/seaweedfs/seaweedfs/weed)
mv -f "$tmp" "$BIN"
log "built $BIN in $((SECONDS - start)) s"
