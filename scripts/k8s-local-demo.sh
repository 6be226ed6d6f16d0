#!/usr/bin/env bash
# The Kubernetes story on a real control plane run here, for machines without Kind: the
# Kubernetes 1.20 control plane and kubelet built once from Debian's source package (cached
# in $K8S_LOCAL_CACHE), etcd from Debian's etcd-server, all started as this script's own
# processes; the kubelet runs pods on a local Docker engine (scripts/_docker_engine.sh).
# MongoDB (the development server) and nats-server run beside the cluster on the Docker
# bridge's gateway; k8s/overlays/local is applied; then the same story as
# scripts/kind-demo.sh (scripts/_k8s_story.sh): schedules over HTTP, the leader pod deleted
# (graceful, then forced), fires continuing, kubectl scale, an audit of the stream.
#
# Everything it started is stopped on exit: processes, pods' containers, iptables chains
# the kubelet made, mounts, and the state under $K8S_LOCAL_STATE. Exit 0 only when every
# step passes. The first run builds Kubernetes (about 5 min on 2 cores).
# Needs root (the kubelet), apt-get for what is missing, and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_venv.sh
source scripts/_venv.sh

CACHE="${K8S_LOCAL_CACHE:-$HOME/.cache/hascheduler-k8s-1.20}"
RUN="${K8S_LOCAL_STATE:-/tmp/hascheduler-k8s-local}"
ENGINE_STATE="$RUN/docker"
NS=hascheduler
NODE=hascheduler-local
GATEWAY=172.17.0.1  # the Docker bridge's gateway: the host as pods see it (the overlay's)
ETCD_PORT=12379
API_PORT=16443
KUBELET_PORT=10250
PAUSE_IMAGE=k8s.gcr.io/pause:3.2  # the 1.20 kubelet's default sandbox image
T0=$(date +%s)
PIDS=()
CHAINS_BEFORE=""
LOG_DIRS_BEFORE=$(ls -d /var/log/pods /var/log/containers 2>/dev/null || true)
# shellcheck source=scripts/_docker_engine.sh
source scripts/_docker_engine.sh

[ "$(id -u)" -eq 0 ] || { echo "k8s-local-demo runs the kubelet: run it as root" >&2; exit 2; }

kube_chains() {  # "table chain" for every KUBE-* iptables chain
  command -v iptables >/dev/null || return 0
  for table in filter nat mangle; do
    iptables -t "$table" -S 2>/dev/null | awk -v t="$table" '$1 == "-N" && $2 ~ /^KUBE-/ {print t, $2}'
  done
}

remove_new_chains() {  # the kubelet's chains, and the rules that jump to them
  local table chain rule
  kube_chains | grep -vxF -f <(printf '%s\n' "$CHAINS_BEFORE") | while read -r table chain; do
    iptables -t "$table" -F "$chain" 2>/dev/null
    iptables -t "$table" -S 2>/dev/null | grep -- "-j $chain\$" | while read -r rule; do
      # shellcheck disable=SC2086  # the rule's own words
      iptables -t "$table" -D ${rule#-A }
    done
    iptables -t "$table" -X "$chain" 2>/dev/null
  done
}

cleanup() {
  local status=$?
  set +e
  say "cleaning up"
  # The kubelet first, so nothing restarts the pods' containers being removed.
  if [ ${#PIDS[@]} -gt 0 ]; then kill "${PIDS[-1]}" 2>/dev/null; fi
  if d info >/dev/null 2>&1; then
    d ps -aq --filter "label=io.kubernetes.pod.namespace=$NS" \
      --filter "label=io.kubernetes.docker.type" | xargs -r "$DOCKER" rm -f >/dev/null 2>&1
  fi
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  remove_new_chains
  unmount_under "$RUN"
  if [ "$status" != 0 ] && [ -d "$RUN" ]; then
    rm -rf "$RUN.logs"
    mkdir -p "$RUN.logs"
    cp "$RUN"/*.log "$RUN.logs/" 2>/dev/null
    say "the processes' logs are kept in $RUN.logs"
  fi
  # The kubelet keeps container logs under /var/log whatever its root: ours go, and the
  # directories too when it made them.
  for dir in /var/log/pods /var/log/containers; do
    if grep -qxF "$dir" <<<"$LOG_DIRS_BEFORE"; then
      find "$dir" -maxdepth 1 -name "*${NS}_*" -exec rm -rf {} + 2>/dev/null
    else
      rm -rf "$dir"
    fi
  done
  stop_engine
  rm -rf "$RUN"
  say "$([ "$status" = 0 ] && echo PASS || echo "FAIL (exit $status)")"
  exit "$status"
}
trap cleanup EXIT

background() {  # background NAME COMMAND...: a child process, its output in $RUN/NAME.log
  local name=$1
  shift
  "$@" >"$RUN/$name.log" 2>&1 &
  PIDS+=($!)
  disown  # stopped by cleanup; bash need not report each one
}

wait_until() {  # wait_until WHAT SECONDS COMMAND...
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || fail "$what: not within $2 s"
    sleep 0.2
  done
}

build_kubernetes() {  # once: Debian's source package, built for the four binaries we run
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet) absent=0 b
  for b in "${bins[@]}"; do [ -x "$CACHE/bin/$b" ] || absent=1; done
  [ "$absent" = 1 ] || return 0
  command -v go >/dev/null || apt_install golang-go
  command -v rsync >/dev/null || apt_install rsync
  command -v dpkg-source >/dev/null || apt_install dpkg-dev
  local build="$CACHE/build" started=$SECONDS
  rm -rf "$build"
  mkdir -p "$build/lists/partial"
  say "fetching Debian's kubernetes source package (a private deb-src list)"
  echo "deb-src http://deb.debian.org/debian bookworm main" > "$build/sources.list"
  local apt=(-o "Dir::Etc::SourceList=$build/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$build/lists")
  apt-get "${apt[@]}" update -qq >/dev/null
  (cd "$build" && apt-get "${apt[@]}" source --download-only -qq kubernetes >/dev/null 2>&1)
  # apt checked the files against the archive's signed index; dpkg-source's own check of
  # the uploader's signature needs Debian's keyring, absent here, and only warns.
  dpkg-source -x "$build"/kubernetes_*.dsc "$build/src" >/dev/null 2>&1
  say "building ${bins[*]} from the source (the first run only: minutes)"
  mkdir -p "$build/src/.go/src/k8s.io"
  ln -sfn ../../.. "$build/src/.go/src/k8s.io/kubernetes"
  (cd "$build/src" && GOPATH="$build/src/.go" GOCACHE="$build/gocache" HOME="$build" \
     CGO_ENABLED=0 KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean \
     make WHAT="${bins[*]/#/cmd/}" >"$build/build.log" 2>&1) \
    || { tail -20 "$build/build.log"; fail "building Kubernetes"; }
  mkdir -p "$CACHE/bin"
  for b in "${bins[@]}"; do cp "$build/src/_output/bin/$b" "$CACHE/bin/"; done
  cp "$build/src/build/pause/linux/pause.c" "$CACHE/pause.c"
  rm -rf "$build"
  say "built in $((SECONDS - started)) s; cached in $CACHE"
}

pause_image() {  # the sandbox image, compiled from the source's pause.c (no registry)
  d image inspect "$PAUSE_IMAGE" >/dev/null 2>&1 && return
  mkdir -p "$RUN/pause"
  gcc -Os -static -DVERSION=v3.2 -o "$RUN/pause/pause" "$CACHE/pause.c"
  tar -C "$RUN/pause" -c pause | d import --change 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
}

make_pki() {  # a CA, the API server's certificate, the service-account key, token users
  local pki="$RUN/pki"
  mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=hascheduler-local-ca \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
    -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n' \
    > "$pki/san.ext"
  openssl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 2 -extfile "$pki/san.ext" -out "$pki/apiserver.crt" 2>/dev/null
  # The API server's client certificate for the kubelet (logs, exec): the kubelet admits
  # only certificates of this CA.
  openssl req -newkey rsa:2048 -nodes -subj /O=system:masters/CN=kube-apiserver-kubelet-client \
    -keyout "$pki/kubelet-client.key" -out "$pki/kubelet-client.csr" 2>/dev/null
  openssl x509 -req -in "$pki/kubelet-client.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 2 -out "$pki/kubelet-client.crt" 2>/dev/null
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  # Each component its own user, as RBAC's bootstrap roles expect; the kubelet as its node.
  : > "$pki/tokens.csv"
  add_user admin admin system:masters
  add_user kube-controller-manager system:kube-controller-manager
  add_user kube-scheduler system:kube-scheduler
  add_user kubelet "system:node:$NODE" system:nodes
}

add_user() {  # add_user KUBECONFIG_NAME USER [GROUP]: a token for USER, and its kubeconfig
  local token
  token=$(openssl rand -hex 16)
  echo "$token,$2,$2${3:+,$3}" >> "$RUN/pki/tokens.csv"
  kubeconfig "$1" "$token"
}

kubeconfig() {  # kubeconfig NAME TOKEN: $RUN/NAME.kubeconfig
  cat > "$RUN/$1.kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters:
  - name: local
    cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$RUN/pki/ca.crt"}
users:
  - name: $1
    user: {token: "$2"}
contexts:
  - name: local
    context: {cluster: local, user: $1, namespace: $NS}
current-context: local
YAML
}

start_control_plane() {
  local bin="$CACHE/bin" pki="$RUN/pki"
  background etcd etcd --name local --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster local=http://127.0.0.1:12380
  wait_until "etcd" 30 curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
  background kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --secure-port "$API_PORT" --insecure-port 0 \
    --advertise-address "$GATEWAY" --service-cluster-ip-range 10.0.0.0/24 \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
    --authorization-mode Node,RBAC --service-account-key-file "$pki/sa.pub" \
    --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --kubelet-preferred-address-types InternalIP \
    --kubelet-client-certificate "$pki/kubelet-client.crt" \
    --kubelet-client-key "$pki/kubelet-client.key"
  wait_until "the API server" 60 kubectl --kubeconfig "$RUN/admin.kubeconfig" get --raw /readyz
  say "API server ready (Kubernetes $("$bin/kube-apiserver" --version | cut -d' ' -f2))"
  background kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$RUN/kube-controller-manager.kubeconfig" --leader-elect=false \
    --port 0 --secure-port 0 --use-service-account-credentials \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt"
  background kube-scheduler "$bin/kube-scheduler" --kubeconfig "$RUN/kube-scheduler.kubeconfig" \
    --leader-elect=false --port 0 --secure-port 0
  # 1.20's built-in Docker support; no network plugin: pods on the Docker bridge. The node's
  # address is the bridge's gateway (a kubelet refuses a loopback one).
  background kubelet "$bin/kubelet" --kubeconfig "$RUN/kubelet.kubeconfig" \
    --hostname-override "$NODE" --node-ip "$GATEWAY" --address "$GATEWAY" \
    --port "$KUBELET_PORT" --client-ca-file "$pki/ca.crt" --anonymous-auth=false \
    --authorization-mode AlwaysAllow \
    --read-only-port 0 --healthz-port 0 --container-runtime docker \
    --docker-endpoint "${DOCKER_HOST:-unix:///var/run/docker.sock}" \
    --pod-infra-container-image "$PAUSE_IMAGE" --root-dir "$RUN/kubelet" \
    --cert-dir "$RUN/kubelet/pki" --volume-plugin-dir "$RUN/kubelet/plugins" \
    --seccomp-profile-root "$RUN/kubelet/seccomp" \
    --experimental-dockershim-root-directory "$RUN/dockershim" \
    --container-runtime-endpoint "unix://$RUN/dockershim.sock" \
    --cgroup-driver "$(d info -f '{{.CgroupDriver}}')" --fail-swap-on=false \
    --cgroups-per-qos=false --enforce-node-allocatable= \
    --eviction-hard 'nodefs.available<1%,imagefs.available<1%' \
    --image-gc-high-threshold 100 --image-gc-low-threshold 99 \
    --make-iptables-util-chains=false
  wait_until "the node $NODE to be Ready" 120 node_ready
  say "node $NODE ready"
}

node_ready() {
  [ "$(kc get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

start_outside_services() {  # MongoDB and NATS where the overlay says: the bridge's gateway
  ip -4 addr show 2>/dev/null | grep -q "inet $GATEWAY/" \
    || fail "no interface has $GATEWAY (the Docker bridge's gateway k8s/overlays/local names)"
  background devmongo .venv/bin/hascheduler devmongo --host "$GATEWAY" --port 27017
  background nats-server "$(.venv/bin/python -c \
      'from hascheduler_dev.devcluster.supervisor import nats_server_binary as b; print(b())')" \
    -js -sd "$RUN/nats" -a "$GATEWAY" -p 4222
  wait_until "the development MongoDB server on $GATEWAY:27017" 30 \
    bash -c "exec 3<>/dev/tcp/$GATEWAY/27017"
  wait_until "nats-server on $GATEWAY:4222" 30 bash -c "exec 3<>/dev/tcp/$GATEWAY/4222"
}

kc() { kubectl --kubeconfig "$RUN/admin.kubeconfig" "$@"; }
k() { kc -n "$NS" "$@"; }
api_url() {  # a ready replica pod's API (no kube-proxy here: Service IPs do not route)
  local ip
  ip=$(k get pods -l app.kubernetes.io/name=hascheduler -o json | python3 -c '
import json, sys
for pod in json.load(sys.stdin)["items"]:
    ready = any(c["type"] == "Ready" and c["status"] == "True"
                for c in pod["status"].get("conditions", []))
    if ready and not pod["metadata"].get("deletionTimestamp"):
        print(pod["status"]["podIP"])
        break')
  echo "http://$ip:8080"
}
# shellcheck source=scripts/_k8s_story.sh
source scripts/_k8s_story.sh

ensure_venv
for tool in curl openssl gcc ip; do
  command -v "$tool" >/dev/null || fail "needs $tool"
done
command -v etcd >/dev/null || apt_install etcd-server
build_kubernetes
rm -rf "$RUN"
mkdir -p "$RUN"
CHAINS_BEFORE=$(kube_chains)
start_engine
make_base "$CACHE/base-bookworm.tar"
build_image hascheduler:dev
pause_image
make_pki
start_control_plane
start_outside_services

story_secret
say "applying k8s/overlays/local (kustomize)"
kc apply -k k8s/overlays/local >/dev/null
story_run
