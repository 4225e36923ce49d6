#!/usr/bin/env bash
# Stop the real node started by node-up.sh for this state dir and undo everything it did to the host:
# its pods (deleted through the apiserver while the kubelet still runs), the Node object and the kube-dns
# Service; the processes (CoreDNS, kube-proxy, kubelet, containerd and its shims); kube-proxy's and the
# kubelet's iptables chains (KUBE-*, v4 and v6); mounts under the node dir and the pods' network
# namespaces; the kubepods cgroups; the pod bridge; the node IP; the sysctls it changed; paths outside
# the node dir that did not exist before node-up.sh. Exits non-zero, naming it, if anything is left.
#   bash tests/cluster/node-down.sh            # keeps $NODE_DIR (certs, logs)
#   bash tests/cluster/node-down.sh --purge    # ... and removes it
#   bash tests/cluster/node-down.sh --reclaim  # a node whose state dir is gone (a killed run): undo what it
#                                              # left on the host, its node IP included, then remove the dir
set -euo pipefail
source "$(dirname "$0")/env.sh"
source "$CLUSTER_SRC/lib.sh"
# shellcheck disable=SC2034  # read by lib.sh
SCRIPT=node-down PIDS=$NODE_DIR/pids OWNED_BY=$NODE_DIR
SOCK=$NODE_DIR/containerd/containerd.sock
KUBECTL=("$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_PATH" --request-timeout=10s)
CTR=(ctr --address "$SOCK" -n k8s.io)
purge=false reclaim=false
for arg in "$@"; do
  case $arg in
    --purge) purge=true ;;
    --reclaim) purge=true reclaim=true ;;
    *) echo "node-down: unknown argument '$arg' (use --purge or --reclaim)" >&2; exit 2 ;;
  esac
done
if [ ! -d "$NODE_DIR" ]; then
  $reclaim || { log "no real node in $CLUSTER_DIR"; exit 0; }
  mkdir -p "$NODE_DIR/logs"
  # No record of where the node IP went: wherever node-up.sh puts it.
  if ip link show triptych-node >/dev/null 2>&1; then echo dummy >"$NODE_DIR/node-ip-device"
  elif ip -o addr show dev lo | grep -w "inet $NODE_IP/32" >/dev/null; then echo lo >"$NODE_DIR/node-ip-device"; fi
fi
exec 8>/run/triptych-real-node.lock
flock -w 60 8 || { echo "node-down: node-up.sh/node-down.sh of another shell holds /run/triptych-real-node.lock" >&2; exit 1; }
t_start=$SECONDS

# 1. Pods first, while the kubelet runs: it stops their containers, tears down their network (CNI DEL)
#    and unmounts their volumes. Bounded: whatever is left is killed below.
if [ -n "$(find_pids kubelet)" ] && "${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1; then
  pods=$("${KUBECTL[@]}" get pods -A --field-selector "spec.nodeName=$NODE_NAME" \
    -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{"\n"}{end}' 2>/dev/null || true)
  if [ -n "$pods" ]; then
    log "deleting $(echo "$pods" | wc -l) pod(s) on $NODE_NAME"
    while IFS=/ read -r ns name; do
      "${KUBECTL[@]}" -n "$ns" delete pod "$name" --grace-period=5 --wait=false >/dev/null 2>&1 || true
    done <<<"$pods"
    deadline=$((SECONDS + 45))
    while [ $SECONDS -lt $deadline ] && [ -n "$("${KUBECTL[@]}" get pods -A --field-selector "spec.nodeName=$NODE_NAME" -o name 2>/dev/null)" ]; do
      sleep 1
    done
    log "pods gone after $((SECONDS - t_start)) s"
  fi
fi

# 2. Processes: clients of the apiserver first, then containerd and its shims.
stop_group 20 coredns kube-proxy kubelet
if [ -S "$SOCK" ] && [ -n "$(find_pids containerd)" ]; then
  for id in $("${CTR[@]}" tasks ls -q 2>/dev/null); do "${CTR[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true; done
  for id in $("${CTR[@]}" containers ls -q 2>/dev/null); do "${CTR[@]}" containers delete "$id" >/dev/null 2>&1 || true; done
fi
stop_group 20 containerd
log "processes stopped after $((SECONDS - t_start)) s"
stop_group 10 containerd-shim-runc-v2
# Containers the shims leave behind (should none be left, this finds nothing): their runc state is ours.
if [ -d "$NODE_DIR/containerd/runc" ]; then
  for state in "$NODE_DIR"/containerd/runc/*/*/state.json; do
    [ -f "$state" ] || continue
    runc --root "$(dirname "$(dirname "$state")")" delete -f "$(basename "$(dirname "$state")")" >/dev/null 2>&1 || true
  done
fi

# 3. The API objects of this node (the cluster itself may keep running).
if "${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1; then
  "${KUBECTL[@]}" delete node "$NODE_NAME" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  "${KUBECTL[@]}" -n kube-system delete service kube-dns --ignore-not-found >/dev/null 2>&1 || true
  "${KUBECTL[@]}" -n kube-system delete endpointslice kube-dns-host --ignore-not-found >/dev/null 2>&1 || true
fi

# 4. iptables: kube-proxy's own cleanup, then every KUBE-* chain left (the kubelet's KUBE-FIREWALL,
#    KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT ...) and the rules that jump to them, IPv4 and IPv6.
if [ -x "$NODE_BIN_DIR/kube-proxy" ]; then
  "$NODE_BIN_DIR/kube-proxy" --cleanup --v=0 >>"$NODE_DIR/logs/kube-proxy.log" 2>&1 || true
fi
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null || continue
  for table in filter nat mangle raw; do
    rules=$("$ipt" -t "$table" -S 2>/dev/null) || continue
    { echo "$rules" | grep -E -- '^-A .* -j KUBE-' || true; } | sed 's/^-A /-D /' | while read -r rule; do
      eval "$ipt -t $table $rule" 2>/dev/null || true
    done
    for chain in $(echo "$rules" | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do "$ipt" -t "$table" -F "$chain" 2>/dev/null || true; done
    for chain in $(echo "$rules" | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do "$ipt" -t "$table" -X "$chain" 2>/dev/null || true; done
  done
done
# Connections to Service IPs would otherwise keep their NAT entries.
conntrack -D -d "$SERVICE_CIDR" >/dev/null 2>&1 || true

# 5. Mounts under the node dir (the kubelet bind-mounts its root dir; volumes, rootfs, shm), deepest
#    first, and the pods' network namespaces (our containerd's ns files are under /run/netns/cni-*).
umount_under() {
  local prefix=$1 m
  for m in $(awk -v p="$prefix" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}
umount_under "$NODE_DIR/"
umount_under "$NODE_DIR"
umount_under "$NODE_CONTAINERD_ROOT/"
for f in /run/netns/cni-*; do
  [ -e "$f" ] || continue
  grep -qx "$(basename "$f")" "$NODE_DIR/preexisting-netns" 2>/dev/null || ip netns delete "$(basename "$f")" 2>/dev/null || true
done

# 6. cgroups the kubelet made (cgroupfs driver: /kubepods/... in every v1 hierarchy; deepest first).
for hier in /sys/fs/cgroup/*/; do
  [ -d "$hier/kubepods" ] || continue
  find "$hier/kubepods" -depth -type d -exec rmdir {} \; 2>/dev/null || true
done

# 7. The pod bridge, the node IP, the sysctls.
ip link delete "$NODE_BRIDGE" 2>/dev/null || true
case $(cat "$NODE_DIR/node-ip-device" 2>/dev/null) in
  dummy) ip link delete triptych-node 2>/dev/null || true ;;
  lo) ip addr delete "$NODE_IP/32" dev lo 2>/dev/null || true ;;
esac
rm -f "$NODE_DIR/node-ip-device"
if [ -f "$NODE_DIR/sysctls" ]; then
  { read -r brnf; read -r fwd; } <"$NODE_DIR/sysctls" || true
  [ -n "${brnf:-}" ] && sysctl -qw net.bridge.bridge-nf-call-iptables="$brnf" 2>/dev/null || true
  [ -n "${fwd:-}" ] && sysctl -qw net.ipv4.ip_forward="$fwd" 2>/dev/null || true
fi

# 8. Paths outside the node dir that node-up.sh found absent.
for p in /var/lib/kubelet /var/log/containers /var/log/pods /usr/libexec/kubernetes /run/containerd /var/lib/cni /etc/cni; do
  grep -qx "$p" "$NODE_DIR/preexisting" 2>/dev/null || rm -rf "$p"
done
# The pods' network namespaces' directory, once empty (a namespace left by something else keeps it).
# `ip netns` makes /run/netns a bind mount of itself: unmount that before removing the directory.
grep -qx /run/netns "$NODE_DIR/preexisting" 2>/dev/null || { umount /run/netns 2>/dev/null; rmdir /run/netns 2>/dev/null; } || true
# Our CNI results cache entries (libcni keeps them in /var/lib/cni even with a private conf dir).
rm -f /var/lib/cni/results/triptych-* 2>/dev/null || true
rm -rf "$NODE_DIR/containerd/state" "$NODE_DIR/cni/ipam" "$PIDS"
rm -f /run/triptych-real-node.owner

# 9. Check: nothing of this node may be left.
left=()
for name in coredns kube-proxy kubelet containerd containerd-shim-runc-v2; do
  p=$(find_pids "$name"); [ -n "$p" ] && left+=("process $name: $p")
done
awk -v p="$NODE_DIR" 'index($2, p) == 1' /proc/self/mounts | grep . >/dev/null && left+=("mounts under $NODE_DIR")
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null || continue
  for table in filter nat mangle raw; do
    c=$("$ipt" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}' | tr '\n' ' ')
    [ -n "$c" ] && left+=("$ipt $table chains: $c")
  done
done
for hier in /sys/fs/cgroup/*/; do [ -d "$hier/kubepods" ] && left+=("cgroup ${hier}kubepods"); done
ip link show "$NODE_BRIDGE" >/dev/null 2>&1 && left+=("bridge $NODE_BRIDGE")
ip -o addr show | grep -w "inet $NODE_IP/32" >/dev/null && left+=("address $NODE_IP")
if [ ${#left[@]} -gt 0 ]; then
  printf 'node-down: left behind: %s\n' "${left[@]}" >&2
  exit 1
fi
if $purge; then rm -rf "$NODE_DIR"; fi
log "node $NODE_NAME stopped and cleaned up in $((SECONDS - t_start)) s"
