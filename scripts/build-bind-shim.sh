#!/usr/bin/env bash
# Build the worker's bind shim (worker/triptych_worker/transfer/bind_shim.c): an LD_PRELOAD library
# that confines Mooncake's listeners to --disagg-p2p-hostname (triptych_worker.transfer.listeners).
#   scripts/build-bind-shim.sh [OUT]   (default: next to the source, where the worker looks for it)
# Cached by content: the library carries the hash of its source and flags, and a build whose hash
# matches is skipped. Needs a C compiler (gcc) and the C library's headers.
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=worker/triptych_worker/transfer/bind_shim.c
OUT=${1:-worker/triptych_worker/transfer/libtriptych_bind.so}
CC=${CC:-gcc}
CFLAGS=(-O2 -Wall -Wextra -Werror -shared -fPIC)

key=$( { cat "$SRC"; echo "${CFLAGS[*]}"; } | sha256sum | cut -c1-32)
if [ -f "$OUT" ] && grep -qa "triptych-bind-shim-$key" "$OUT"; then
  exit 0
fi
mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp "$OUT.XXXXXX")
trap 'rm -f "$tmp"' EXIT
"$CC" "${CFLAGS[@]}" -DTRIPTYCH_BIND_SHIM_ID="\"triptych-bind-shim-$key\"" -o "$tmp" "$SRC" -ldl
chmod 0755 "$tmp"
mv -f "$tmp" "$OUT"
echo "bind shim: built $OUT"
