#!/usr/bin/env bash
# Stop the local control plane started by up.sh for this state dir, and wait until every process is gone.
# Processes are found by their pid files AND by scanning /proc for our binaries whose command line
# mentions this state dir (so a lost pid file leaves nothing behind; other clusters are not touched).
#   bash tests/cluster/down.sh            # stop, keep state (certs, etcd data): the next up.sh is fast
#   bash tests/cluster/down.sh --purge    # stop and delete the state dir
set -euo pipefail
source "$(dirname "$0")/env.sh"

PIDS=$CLUSTER_DIR/pids
purge=false
[ "${1:-}" = "--purge" ] && purge=true
# One up/down at a time per state dir (concurrent pytest sessions share the cluster).
if [ -d "$CLUSTER_DIR" ]; then
  exec 9>"$CLUSTER_DIR/.lock"
  flock -w 120 9 || { echo "down.sh: another up.sh/down.sh holds $CLUSTER_DIR/.lock" >&2; exit 1; }
fi

# pids of <name> that belong to this state dir
find_pids() {
  local name=$1 pid exe
  {
    cat "$PIDS/$name.pid" 2>/dev/null || true
    for d in /proc/[0-9]*; do
      exe=$(readlink "$d/exe" 2>/dev/null) || continue
      [ "$(basename "$exe")" = "$name" ] && echo "${d#/proc/}"
    done
  } | sort -un | while read -r pid; do
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || continue
    [ "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" = "$name" ] || continue
    tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$CLUSTER_DIR/" && echo "$pid"
  done
  return 0
}

# true if any pid still runs (a zombie waiting for its parent to reap it counts as gone)
alive() {
  local p state
  for p in "$@"; do
    state=$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' "/proc/$p/stat" 2>/dev/null) || continue
    [ -n "$state" ] && [ "$state" != Z ] && return 0
  done
  return 1
}

# stop_group <timeout> <names...>: SIGTERM, wait, then SIGKILL what is left
stop_group() {
  local timeout=$1; shift
  local pids=() name
  for name in "$@"; do
    for p in $(find_pids "$name"); do pids+=("$p"); echo "down: stopping $name (pid $p)"; done
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  local deadline=$((SECONDS + timeout))
  while alive "${pids[@]}" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  if alive "${pids[@]}"; then
    echo "down: escalating to SIGKILL for ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while alive "${pids[@]}" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  fi
}

# The real node first (its teardown deletes its pods through the apiserver), if this cluster has one.
if [ -d "$NODE_DIR" ]; then
  exec 9>&-  # node-down.sh takes the same lock
  bash "$CLUSTER_SRC/node-down.sh"
  exec 9>"$CLUSTER_DIR/.lock"
  flock -w 120 9 || { echo "down.sh: another up.sh/down.sh holds $CLUSTER_DIR/.lock" >&2; exit 1; }
fi

# Clients first, then the apiserver, then its storage.
stop_group 15 kwok kube-scheduler kube-controller-manager
stop_group 20 kube-apiserver
stop_group 15 etcd

left=""
for name in "${COMPONENTS[@]}"; do
  p=$(find_pids "$name")
  [ -n "$p" ] && left+=" $name:$p"
done
if [ -n "$left" ]; then
  echo "down.sh: processes still running:$left" >&2
  exit 1
fi
rm -f "$PIDS"/*.pid 2>/dev/null || true

busy=""
for port in "$ETCD_CLIENT_PORT" "$ETCD_PEER_PORT" "$APISERVER_PORT" "$KCM_PORT" "$SCHEDULER_PORT" "$KWOK_PORT"; do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && busy+=" $port"
done
[ -n "$busy" ] && echo "down: warning: ports still accepting connections (not ours?):$busy" >&2

if [ ! -d "$CLUSTER_DIR" ]; then
  echo "down: nothing left running for $CLUSTER_DIR"
elif $purge; then
  rm -rf "$CLUSTER_DIR"
  echo "down: stopped and removed $CLUSTER_DIR"
else
  echo "down: stopped (state kept in $CLUSTER_DIR; 'bash tests/cluster/down.sh --purge' deletes it)"
fi
