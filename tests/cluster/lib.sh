# shellcheck shell=bash
# Functions the cluster scripts share (sourced after env.sh, not executed): building binaries from the
# wrapper modules (build.sh, build-node.sh), starting components (up.sh, node-up.sh) and finding and
# stopping them (down.sh, node-down.sh).
#
# A script sets, before it calls them:
#   SCRIPT    its name, for messages ("up", "node-down", ...)
#   PIDS      the dir of its components' pid files (<name>.pid)
#   OWNED_BY  a dir that every one of its processes names in its command line (the cluster's state dir,
#             or the real node's dir): a process of the same binary that does not is someone else's
#   LOGS      the dir of its components' logs (start, check_components)

log() { echo "$SCRIPT: $*"; }
die() { echo "$SCRIPT: $*" >&2; exit 1; }

# ---------------------------------------------------------------- building (Go module proxy, no release downloads)
# find_go <what needs it>: sets GO, or dies naming the version needed.
find_go() {
  GO=$(command -v go || echo /usr/local/go/bin/go)
  [ -x "$GO" ] || die "Go not found (need $1)"
}

# build_lock <lock file>: one build at a time per cache (pytest workers or two shells may build at once).
build_lock() {
  exec 9>"$1"
  if ! flock -n 9; then
    log "another build is running, waiting for it (lock $1)"
    flock 9
  fi
}

# go_build <module dir under toolchain/> <output file> <package> [ldflags] [build tags]: a static, reproducible binary,
# moved into place only once it is complete.
go_build() {
  local dir=$1 out=$2 pkg=$3 ldflags=${4:-} tags=${5:-}
  local tmp
  tmp="$(dirname "$out")/.$(basename "$out").tmp.$$"
  (cd "$CLUSTER_SRC/toolchain/$dir" &&
    CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-buildvcs=false -mod=readonly" \
      "$GO" build -p 2 -trimpath -tags "$tags" -ldflags "-s -w $ldflags" -o "$tmp" "$pkg")
  mv -f "$tmp" "$out"
}

# build_missing <bin dir> <lock file> <Go needed> <names...>: build each binary missing from <bin dir>
# with the calling script's `build_binary <name> <output file>`, one build at a time per cache.
build_missing() {
  local bin_dir=$1 lock=$2 need=$3 b t0 start missing=()
  shift 3
  for b in "$@"; do [ -x "$bin_dir/$b" ] || missing+=("$b"); done
  if [ ${#missing[@]} -eq 0 ]; then
    log "up to date in $bin_dir"
    return 0
  fi
  find_go "$need"
  mkdir -p "$bin_dir"
  build_lock "$lock"
  start=$SECONDS
  for b in "${missing[@]}"; do
    [ -x "$bin_dir/$b" ] && continue  # built by another build while this one waited for the lock
    t0=$SECONDS
    build_binary "$b" "$bin_dir/$b"
    log "built $b in $((SECONDS - t0)) s"
  done
  log "all binaries in $bin_dir (built in $((SECONDS - start)) s)"
}

# The version k8s.io/kubernetes binaries report (kubectl version, the apiserver's /version), as its Makefile sets it.
k8s_version_ldflags() {
  local minor=${K8S_VERSION#v1.} p flags=""
  minor=${minor%%.*}
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    flags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$flags"
}

# ---------------------------------------------------------------- our processes
# owned <pid> <binary name>: true if <pid> runs <binary name> and names OWNED_BY in its command line.
owned() {
  local pid=$1 name=$2
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  [ "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" = "$name" ] || return 1
  tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -F -- "$OWNED_BY/" >/dev/null
}

# component_pid <name>: the pid of our running <name>, from its pid file.
component_pid() {
  local pid
  pid=$(cat "$PIDS/$1.pid" 2>/dev/null) || return 1
  owned "$pid" "$1" || return 1
  echo "$pid"
}

# find_pids <name>: every pid of our <name>: its pid file's and any process of that binary that names
# OWNED_BY (so a lost pid file leaves nothing behind, and other clusters' processes are not touched).
find_pids() {
  local name=$1 d exe pid
  {
    cat "$PIDS/$name.pid" 2>/dev/null || true
    for d in /proc/[0-9]*; do
      exe=$(readlink "$d/exe" 2>/dev/null) || continue
      if [ "$(basename "$exe")" = "$name" ]; then echo "${d#/proc/}"; fi
    done
  } | sort -un | while read -r pid; do
    if owned "$pid" "$name"; then echo "$pid"; fi
  done
  return 0
}

# alive <pid...>: true if any still runs (a zombie waiting for its parent to reap it counts as gone).
alive() {
  local p state
  for p in "$@"; do
    state=$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' "/proc/$p/stat" 2>/dev/null) || continue
    [ -n "$state" ] && [ "$state" != Z ] && return 0
  done
  return 1
}

# stop_group <timeout s> <names...>: SIGTERM every process of ours with these names, wait, then SIGKILL.
stop_group() {
  local timeout=$1 name p deadline
  shift
  local pids=()
  for name in "$@"; do
    for p in $(find_pids "$name"); do pids+=("$p"); log "stopping $name (pid $p)"; done
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  deadline=$((SECONDS + timeout))
  while alive "${pids[@]}" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  if alive "${pids[@]}"; then
    log "escalating to SIGKILL for ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while alive "${pids[@]}" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  fi
}

# ---------------------------------------------------------------- starting components
RUNNING=()

# start <name> <binary> <args...>: start it in the background unless ours already runs. New session, no
# inherited terminal, pipes or locks (fds 8, 9): it outlives this script and its caller.
start() {
  local name=$1 bin=$2 pid
  shift 2
  if pid=$(component_pid "$name"); then
    log "$name already running (pid $pid)"
    RUNNING+=("$name")
    return 0
  fi
  echo "=== $(date -u +%FT%TZ) starting $name" >>"$LOGS/$name.log"
  setsid "$bin" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 8>&- 9>&- &
  pid=$!
  echo "$pid" >"$PIDS/$name.pid"
  # Until setsid has exec'd the binary, /proc/<pid>/exe is bash's or setsid's, and check_components
  # would take the starting component for one that exited (seen under load: a test session's up.sh died
  # "etcd exited" while etcd was starting). Wait for the exec, or for the process to end.
  local deadline=$((SECONDS + 10))
  while ! owned "$pid" "$name" && alive "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.05; done
  RUNNING+=("$name")
  log "started $name (pid $pid, log $LOGS/$name.log)"
}

# check_components: die, with the log's tail, when a component this run started or found has exited
# (e.g. on a bad flag), instead of waiting for it until a timeout.
check_components() {
  local name
  for name in "${RUNNING[@]}"; do
    component_pid "$name" >/dev/null && continue
    echo "$SCRIPT: $name exited; last lines of $LOGS/$name.log:" >&2
    tail -n 20 "$LOGS/$name.log" >&2
    exit 1
  done
}

# wait_for <timeout s> <what> <command...>: poll every 0.5 s until the command succeeds.
wait_for() {
  local timeout=$1 what=$2
  shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    check_components
    [ $SECONDS -lt $deadline ] || die "timed out after ${timeout}s waiting for $what (logs: $LOGS)"
    sleep 0.5
  done
}

# ---------------------------------------------------------------- certificates and kubeconfigs (openssl, once)
new_key() { openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$1" 2>/dev/null; }

# new_cert <dir> <name> <subject> <ca> <extendedKeyUsage> [subjectAltName]: <dir>/<name>.crt and .key,
# signed by the cluster's $CERTS/<ca>.crt; an existing one is kept.
new_cert() {
  local dir=$1 name=$2 subj=$3 ca=$4 eku=$5 san=${6:-}
  [ -f "$dir/$name.crt" ] && return 0
  new_key "$dir/$name.key"
  chmod 600 "$dir/$name.key"
  openssl req -new -key "$dir/$name.key" -out "$dir/$name.csr" -subj "$subj"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    if [ -n "$san" ]; then echo "subjectAltName=$san"; fi
  } >"$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$CERTS/$ca.crt" -CAkey "$CERTS/$ca.key" -CAcreateserial \
    -out "$dir/$name.crt" -days 3650 -extfile "$dir/$name.ext" 2>/dev/null
  rm -f "$dir/$name.csr" "$dir/$name.ext"
}

# write_kubeconfig <file> <cert dir> <cert name>: the apiserver on 127.0.0.1 as that client certificate's
# user, certificates embedded (rewritten every time: the apiserver port may have been overridden).
write_kubeconfig() {
  local file=$1 dir=$2 name=$3
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: triptych-local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 "$CERTS/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $(base64 -w0 "$dir/$name.crt")
    client-key-data: $(base64 -w0 "$dir/$name.key")
contexts:
- name: triptych-local
  context:
    cluster: triptych-local
    user: $name
current-context: triptych-local
EOF
  chmod 600 "$file"
}
