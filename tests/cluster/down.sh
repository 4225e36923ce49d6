#!/usr/bin/env bash
# Stop the local control plane started by up.sh for this state dir, and wait until every process is gone.
# Processes are found by their pid files AND by scanning /proc for our binaries whose command line
# mentions this state dir (so a lost pid file leaves nothing behind; other clusters are not touched).
#   bash tests/cluster/down.sh            # stop, keep state (certs, etcd data): the next up.sh is fast
#   bash tests/cluster/down.sh --purge    # stop and delete the state dir
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"
# shellcheck disable=SC2034  # read by lib.sh
SCRIPT=down PIDS=$CLUSTER_DIR/pids OWNED_BY=$CLUSTER_DIR
purge=false
[ "${1:-}" = "--purge" ] && purge=true
# One up/down at a time per state dir (concurrent pytest sessions share the cluster).
if [ -d "$CLUSTER_DIR" ]; then
  exec 9>"$CLUSTER_DIR/.lock"
  flock -w 120 9 || { echo "down: another up.sh/down.sh holds $CLUSTER_DIR/.lock" >&2; exit 1; }
fi

# The real node first (its teardown deletes its pods through the apiserver), if this cluster has one.
if [ -d "$NODE_DIR" ]; then
  exec 9>&-  # node-down.sh takes the same lock
  bash "$CLUSTER_SRC/node-down.sh"
  exec 9>"$CLUSTER_DIR/.lock"
  flock -w 120 9 || { echo "down: another up.sh/down.sh holds $CLUSTER_DIR/.lock" >&2; exit 1; }
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
  echo "down: processes still running:$left" >&2
  exit 1
fi
rm -f "$PIDS"/*.pid 2>/dev/null || true

busy=""
for port in "$ETCD_CLIENT_PORT" "$ETCD_PEER_PORT" "$APISERVER_PORT" "$KCM_PORT" "$SCHEDULER_PORT" "$KWOK_PORT"; do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && busy+=" $port"
done
[ -n "$busy" ] && log "warning: ports still accepting connections (not ours?):$busy" >&2

if [ ! -d "$CLUSTER_DIR" ]; then
  log "nothing left running for $CLUSTER_DIR"
elif $purge; then
  rm -rf "$CLUSTER_DIR"
  log "stopped and removed $CLUSTER_DIR"
else
  log "stopped (state kept in $CLUSTER_DIR; 'bash tests/cluster/down.sh --purge' deletes it)"
fi
