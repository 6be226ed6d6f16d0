# shellcheck shell=bash
# A Docker engine for the demos, sourced by container-demo.sh and k8s-local-demo.sh: the
# running one, or dockerd as this script's own child (installed from Debian's docker.io if
# need be) with its state under $ENGINE_STATE, stopped, unmounted and removed by
# stop_engine. Also the base image made with debootstrap (no registry to pull from) and
# the project's image built on it.
#
# The caller sets ENGINE_STATE and T0 (date +%s) and calls stop_engine on exit.

STARTED_DOCKERD=""
BASE_IMAGE=hascheduler-base:bookworm

say() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
fail() { say "FAIL: $*"; exit 1; }

# A Docker CLI that builds without buildx when the engine's own CLI is not first on PATH.
DOCKER=docker
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
d() { "$DOCKER" "$@"; }

apt_install() {
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  command -v apt-get >/dev/null || fail "needs $*; no apt-get here to install them"
  say "installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "$@" >/dev/null
}

start_engine() {
  if d info >/dev/null 2>&1; then
    say "using the Docker engine that is running"
    return
  fi
  command -v dockerd >/dev/null || apt_install docker.io
  [ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
  mkdir -p "$ENGINE_STATE"
  # runc refuses a negative oom_score_adj without CAP_SYS_RESOURCE (missing here): this
  # runtime clamps it to 0 and is otherwise runc.
  cat > "$ENGINE_STATE/runc-clamp" <<'PY'
#!/usr/bin/python3
import json, os, sys
args = sys.argv[1:]
if "--bundle" in args:
    path = os.path.join(args[args.index("--bundle") + 1], "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("process", {}).get("oomScoreAdj", 0) < 0:
        config["process"]["oomScoreAdj"] = 0
        with open(path, "w") as f:
            json.dump(config, f)
os.execv("/usr/sbin/runc", ["runc", *args])
PY
  chmod +x "$ENGINE_STATE/runc-clamp"
  export DOCKER_HOST="unix://$ENGINE_STATE/docker.sock"
  say "starting dockerd (state in $ENGINE_STATE)"
  # The bridge's address is pinned: k8s/overlays/local names it as the pods' way out.
  dockerd --data-root "$ENGINE_STATE/data" --exec-root "$ENGINE_STATE/exec" \
    --pidfile "$ENGINE_STATE/dockerd.pid" -H "$DOCKER_HOST" --storage-driver=overlay2 \
    --iptables=false --ip-masq=false --bip 172.17.0.1/16 \
    --add-runtime "clamp=$ENGINE_STATE/runc-clamp" --default-runtime clamp \
    >"$ENGINE_STATE/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 1 100); do d info >/dev/null 2>&1 && return; sleep 0.2; done
  tail -20 "$ENGINE_STATE/dockerd.log"
  fail "dockerd did not answer"
}

stop_engine() {  # only the engine this script started, and everything under its state
  [ -n "$STARTED_DOCKERD" ] || return 0
  kill "$STARTED_DOCKERD" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$STARTED_DOCKERD" 2>/dev/null
  # dockerd leaves its network namespace mounted under its exec root.
  unmount_under "$ENGINE_STATE"
  rm -rf "$ENGINE_STATE"
}

unmount_under() {  # every mount below $1, deepest first
  findmnt -rn -o TARGET | grep "^$1/" | sort -r | while read -r mount; do
    umount -l "$mount"
  done
}

make_base() {  # BASE_IMAGE, from $1 (a `docker save` of it) when that file exists
  if d image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  if [ -n "${1:-}" ] && [ -f "$1" ]; then
    d load -q -i "$1" >/dev/null
    return
  fi
  command -v debootstrap >/dev/null || apt_install debootstrap
  say "making $BASE_IMAGE with debootstrap (no registry to pull from)"
  local root="$ENGINE_STATE/rootfs"
  mkdir -p "$ENGINE_STATE"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
    "$root" http://deb.debian.org/debian >"$ENGINE_STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$ENGINE_STATE/debootstrap.log"; fail "debootstrap"; }
  # This machine's trust store (a proxy may sign what pip fetches), for the build's pip.
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
  tar -C "$root" -c . | d import - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
  if [ -n "${1:-}" ]; then
    mkdir -p "$(dirname "$1")"
    d save -o "$1" "$BASE_IMAGE"
  fi
}

build_image() {  # build_image TAG [TARGET]: the project's Dockerfile on BASE_IMAGE
  say "building $1${2:+ (target $2)} on $BASE_IMAGE"
  d build -q --network host --build-arg "BASE=$BASE_IMAGE" ${2:+--target "$2"} -t "$1" . \
    >/dev/null
}
