#!/usr/bin/env bash
# The Kubernetes story on a Kind cluster: create it, build and load the image, apply k8s/base,
# wait for MongoDB's replica set, NATS and the replicas, add schedules through the HTTP
# endpoint, delete the leader pod (then force-delete the next one), show the new leader and
# fires continuing, scale to 5 replicas and back to 2, and print a summary.
# Needs docker, kind, kubectl and curl. Usage: scripts/kind-demo.sh; scripts/kind-down.sh
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in docker kind kubectl curl python3; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "kind-demo needs: ${missing[*]} (not found on the PATH)" >&2
  exit 2
fi

CLUSTER=hascheduler
NS=hascheduler
IMAGE=hascheduler:dev
API=http://127.0.0.1:8080
say() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
k() { kubectl --context "kind-$CLUSTER" -n "$NS" "$@"; }

if ! kind get clusters | grep -qx "$CLUSTER"; then
  say "creating the Kind cluster $CLUSTER"
  kind create cluster --config kind-config.yaml
fi
say "building $IMAGE and loading it into the cluster"
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

# The API tokens live in a Secret, never in git: random ones on the first run.
kubectl --context "kind-$CLUSTER" create namespace "$NS" --dry-run=client -o yaml \
  | kubectl --context "kind-$CLUSTER" apply -f -
if ! k get secret hascheduler-tokens >/dev/null 2>&1; then
  say "creating the Secret hascheduler-tokens from k8s/base/tokens-secret.example.yaml (random tokens)"
  token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
  sed -e "s/CHANGE-ME-write-token/$(token)/" -e "s/CHANGE-ME-read-token/$(token)/" \
    k8s/base/tokens-secret.example.yaml | k apply -f -
fi
TOKEN=$(k get secret hascheduler-tokens -o jsonpath='{.data.write}' | base64 -d)
AUTH=(-H "Authorization: Bearer $TOKEN")

say "applying k8s/base (kustomize)"
kubectl --context "kind-$CLUSTER" apply -k k8s/base
k rollout status statefulset/mongodb --timeout=300s
k wait --for=condition=complete job/mongodb-rs-init --timeout=300s
k rollout status statefulset/nats --timeout=300s
k rollout status deployment/hascheduler --timeout=300s
k rollout status deployment/hascheduler-worker --timeout=300s

leader() { curl -fsS "${AUTH[@]}" "$API/leader" | json 'd["holder"] or ""'; }
term() { curl -fsS "${AUTH[@]}" "$API/leader" | json 'd["term"]'; }
wait_leader_other_than() {
  local old=$1 now
  for _ in $(seq 1 600); do
    now=$(leader 2>/dev/null || true)
    if [ -n "$now" ] && [ "$now" != "$old" ]; then echo "$now"; return; fi
    sleep 0.1
  done
  echo "no new leader within 60 s" >&2; exit 1
}
# Runs the rest of the line every 0.5 s until it succeeds; exits after $2 seconds.
wait_for() {
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then echo "$what: not within $2 s" >&2; exit 1; fi
    sleep 0.5
  done
}
published_more_than() { [ "$(fires_published 2>/dev/null || echo 0)" -gt "$1" ]; }
fires_published() {
  curl -fsS "${AUTH[@]}" "$API/schedules/kind-every-2s/fires?limit=500" \
    | json 'sum(1 for f in d["items"] if f["state"] == "published")'
}

say "adding schedules through $API"
create() {  # 201 created, or 409: it exists from an earlier run
  local code
  code=$(curl -sS "${AUTH[@]}" -o /dev/null -w '%{http_code}' -X POST "$API/schedules" \
    -H 'Content-Type: application/json' -d "$1")
  case "$code" in 201|409) ;; *) echo "POST /schedules answered $code" >&2; exit 1 ;; esac
}
create '{"id": "kind-every-2s", "name": "every 2 s", "target": "demo.kind", "catchup": "all",
         "trigger": {"kind": "interval", "every": 2}}'
create '{"id": "kind-cron-5s", "name": "every 5 s (6-field cron)", "target": "demo.kind",
         "catchup": "all", "trigger": {"kind": "cron", "cron": "*/5 * * * * *"}}'
wait_for "the first fires" 120 published_more_than 1
first=$(leader); t1=$(term)
say "leader: $first (term $t1); fires published so far: $(fires_published)"

say "kubectl delete pod $first (graceful: the leader releases its lease)"
start=$(date +%s.%N)
k delete pod "$first" --wait=false
second=$(wait_leader_other_than "$first")
graceful=$(python3 -c "import time; print(round((time.time() - $start) * 1000))")
say "new leader: $second (term $(term)) after ${graceful} ms"

at_takeover=$(fires_published)
wait_for "fires from the new leader" 60 published_more_than "$at_takeover"
say "kubectl delete pod $second --force --grace-period=0 (no release: the lease must expire)"
start=$(date +%s.%N)
k delete pod "$second" --force --grace-period=0
third=$(wait_leader_other_than "$second")
forced=$(python3 -c "import time; print(round((time.time() - $start) * 1000))")
say "new leader: $third (term $(term)) after ${forced} ms"

before=$(fires_published)
wait_for "fires after the failovers" 60 published_more_than "$before"
after=$(fires_published)
say "fires continue: $before -> $after published for kind-every-2s"

say "kubectl scale deployment/hascheduler --replicas=5"
k scale deployment/hascheduler --replicas=5
k rollout status deployment/hascheduler --timeout=300s
curl -fsS "${AUTH[@]}" "$API/cluster" | json '"members: " + ", ".join(m["replica_id"] + (" (leader)" if m.get("leader") else "") for m in d["members"])'
say "kubectl scale deployment/hascheduler --replicas=2"
k scale deployment/hascheduler --replicas=2
k rollout status deployment/hascheduler --timeout=300s

say "kubectl scale deployment/hascheduler-worker --replicas=3"
k scale deployment/hascheduler-worker --replicas=3
k rollout status deployment/hascheduler-worker --timeout=300s
say "workers: $(k get pods -l app.kubernetes.io/name=hascheduler-worker -o name | tr '\n' ' ')"
say "runs by worker (GET /runs): $(curl -fsS "${AUTH[@]}" "$API/runs?limit=200" | json '", ".join(f"{w}: {n}" for w, n in sorted(__import__("collections").Counter(r.get("worker_id") for r in d["items"]).items()))')"
k scale deployment/hascheduler-worker --replicas=1

say "summary: graceful takeover ${graceful} ms, forced takeover ${forced} ms, leader now $(leader) (term $(term)), $(fires_published) fires published for kind-every-2s"
say "the API stays on $API, the dashboard on $API/ui (write token: kubectl -n $NS get secret hascheduler-tokens -o jsonpath='{.data.write}' | base64 -d); scripts/kind-down.sh deletes the cluster"
