# shellcheck shell=bash
# The Kubernetes story, one place for scripts/kind-demo.sh (a Kind cluster) and
# scripts/k8s-local-demo.sh (a control plane built on this machine). The caller defines:
#   say MESSAGE       print a step
#   kc ARGS...        kubectl for the cluster; k ARGS... the same in namespace $NS
#   api_url           print the API's base URL (a Service in Kind, a ready pod's IP locally)
# then applies its manifests between story_secret and story_run.

json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
millis_since() { python3 -c "import time; print(round((time.time() - $1) * 1000))"; }

# The API tokens live in a Secret, never in git: random ones on the first run.
story_secret() {
  kc create namespace "$NS" --dry-run=client -o yaml | kc apply -f - >/dev/null
  if ! k get secret hascheduler-tokens >/dev/null 2>&1; then
    say "creating the Secret hascheduler-tokens from k8s/base/tokens-secret.example.yaml (random tokens)"
    token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
    sed -e "s/CHANGE-ME-write-token/$(token)/" -e "s/CHANGE-ME-read-token/$(token)/" \
      k8s/base/tokens-secret.example.yaml | k apply -f - >/dev/null
  fi
  TOKEN=$(k get secret hascheduler-tokens -o jsonpath='{.data.write}' | base64 -d)
  AUTH=(-H "Authorization: Bearer $TOKEN")
}

api() { curl -fsS --max-time 5 "${AUTH[@]}" "$(api_url)$1"; }
leader() { api /leader | json 'd["holder"] or ""'; }
term() { api /leader | json 'd["term"]'; }
fires_published() {
  api "/schedules/k8s-every-2s/fires?limit=500" \
    | json 'sum(1 for f in d["items"] if f["state"] == "published")'
}
published_more_than() { [ "$(fires_published 2>/dev/null || echo 0)" -gt "$1" ]; }

# Runs the rest of the line every 0.5 s until it succeeds; fails after $2 seconds.
wait_for() {
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then say "FAIL: $what: not within $2 s"; exit 1; fi
    sleep 0.5
  done
}

wait_leader_other_than() {
  local old=$1 now
  for _ in $(seq 1 600); do
    now=$(leader 2>/dev/null || true)
    if [ -n "$now" ] && [ "$now" != "$old" ]; then echo "$now"; return; fi
    sleep 0.1
  done
  say "FAIL: no leader other than '$old' within 60 s"; exit 1
}

create() {  # 201 created, or 409: it exists from an earlier run
  local code
  code=$(curl -sS "${AUTH[@]}" -o /dev/null -w '%{http_code}' -X POST \
    "$(api_url)/schedules" -H 'Content-Type: application/json' -d "$1")
  case "$code" in 201|409) ;; *) say "FAIL: POST /schedules answered $code"; exit 1 ;; esac
}

rollout() { k rollout status "$1" --timeout=300s >/dev/null; }

# Schedules over HTTP, the leader pod deleted (graceful, then forced), fires continuing,
# the replicas and workers scaled, and the stream audited: exit 1 on anything lost or
# duplicated.
story_run() {
  rollout deployment/hascheduler
  rollout deployment/hascheduler-worker
  say "adding schedules through the API ($(api_url))"
  # catchup "all": the fires due while the lease changes hands go out after, every one.
  create '{"id": "k8s-every-2s", "name": "every 2 s", "target": "demo.k8s", "catchup": "all",
           "trigger": {"kind": "interval", "every": 2}}'
  create '{"id": "k8s-cron-5s", "name": "every 5 s (6-field cron)", "target": "demo.k8s",
           "catchup": "all", "trigger": {"kind": "cron", "cron": "*/5 * * * * *"}}'
  # The audit's window opens once both exist (their first fires are due after).
  local since until first second third start graceful forced before after
  since=$(date -u -d '+2 seconds' +%Y-%m-%dT%H:%M:%S.000Z)
  wait_for "the first fires" 120 published_more_than 1
  first=$(leader)
  say "leader: $first (term $(term)); fires published so far: $(fires_published)"

  say "kubectl delete pod $first (graceful: the leader releases its lease)"
  start=$(date +%s.%N)
  k delete pod "$first" --wait=false >/dev/null
  second=$(wait_leader_other_than "$first")
  graceful=$(millis_since "$start")
  say "new leader: $second (term $(term)) after ${graceful} ms"

  before=$(fires_published)
  wait_for "fires from the new leader" 60 published_more_than "$before"
  # The pod object goes at once and its replacement starts without waiting; the kubelet
  # still stops the container with SIGTERM (a short minimum grace).
  say "kubectl delete pod $second --force --grace-period=0"
  start=$(date +%s.%N)
  k delete pod "$second" --force --grace-period=0 >/dev/null 2>&1
  third=$(wait_leader_other_than "$second")
  forced=$(millis_since "$start")
  say "new leader: $third (term $(term)) after ${forced} ms"

  before=$(fires_published)
  wait_for "fires after the failovers" 60 published_more_than "$before"
  after=$(fires_published)
  say "fires continue: $before -> $after published for k8s-every-2s"

  say "kubectl scale deployment/hascheduler --replicas=5"
  k scale deployment/hascheduler --replicas=5 >/dev/null
  rollout deployment/hascheduler
  say "$(api /cluster | json '"members: " + ", ".join(m["replica_id"] + (" (leader)" if m.get("leader") else "") for m in d["members"])')"
  say "kubectl scale deployment/hascheduler --replicas=2"
  k scale deployment/hascheduler --replicas=2 >/dev/null
  rollout deployment/hascheduler

  say "kubectl scale deployment/hascheduler-worker --replicas=3"
  k scale deployment/hascheduler-worker --replicas=3 >/dev/null
  rollout deployment/hascheduler-worker
  say "workers: $(k get pods -l app.kubernetes.io/name=hascheduler-worker -o name | tr '\n' ' ')"
  before=$(fires_published)
  wait_for "fires after scaling" 60 published_more_than "$((before + 1))"
  say "runs by worker (GET /runs): $(api "/runs?limit=200" | json '", ".join(f"{w}: {n}" for w, n in sorted(__import__("collections").Counter(r.get("worker_id") for r in d["items"]).items()))')"
  k scale deployment/hascheduler-worker --replicas=1 >/dev/null

  until=$(date -u -d '-2 seconds' +%Y-%m-%dT%H:%M:%S.000Z)
  say "auditing the stream from $since to $until (hascheduler audit, in a replica pod)"
  k exec deployment/hascheduler -c hascheduler -- \
    hascheduler audit --since "$since" --until "$until" --min-expected 5 \
    || { say "FAIL: the audit"; exit 1; }
  say "summary: graceful takeover ${graceful} ms, forced takeover ${forced} ms, leader now $(leader) (term $(term)), $(fires_published) fires published for k8s-every-2s"
}
