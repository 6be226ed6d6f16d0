#!/usr/bin/env bash
# The local story, with timestamps: start the cluster (`hascheduler dev`: development MongoDB
# server, nats-server with JetStream, three replicas, a worker) with random API tokens, add
# three schedules with curl, show writes without the write token refused and /metrics,
# watch fires reach the worker, SIGKILL the leader and print the takeover time, scale to
# five replicas and down to one, then count every fire in the broker stream: exits non-zero
# if one was missed or duplicated (or any other check fails).
#
# Usage: scripts/local-demo.sh            (about a minute: also waits for the one-off)
#        DEMO_SHORT=1 scripts/local-demo.sh  (about 35 s; what the test suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in curl python3 date; do
  command -v "$tool" >/dev/null || { echo "missing tool: $tool" >&2; exit 2; }
done
# shellcheck source=scripts/_venv.sh
source scripts/_venv.sh
ensure_venv
PY=.venv/bin/python
HS=.venv/bin/hascheduler

# Fires to see before the kill, and from the new leader's term after it.
if [ "${DEMO_SHORT:-0}" = 1 ]; then before_kill=3; after_kill=2; else
  before_kill=8; after_kill=5; fi

workdir=$(mktemp -d)
state="$workdir/dev"
dev_pid=""
keep_log="${DEMO_LOG:-}"  # copy the supervisor's log here before cleaning up (for tests)
cleanup() {
  if [ -n "$dev_pid" ] && kill -0 "$dev_pid" 2>/dev/null; then
    kill -TERM "$dev_pid" 2>/dev/null || true
    # The supervisor stops its children before it exits; wait for it (bounded).
    for _ in $(seq 1 300); do kill -0 "$dev_pid" 2>/dev/null || break; sleep 0.1; done
  fi
  if [ -n "$keep_log" ]; then cp "$workdir/dev.log" "$keep_log" 2>/dev/null || true; fi
  rm -rf "$workdir"
}
trap cleanup EXIT

say() { printf '[%s] %s\n' "$(date -u +%H:%M:%S.%3N)" "$*"; }
fail() { say "FAILED: $*"; exit 1; }
now_iso() { date -u +%Y-%m-%dT%H:%M:%S.%3NZ; }
json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
# Every worker's log (w1.log, w2.log, ...), one stream.
worker_logs() { cat "$state"/logs/w[0-9]*.log 2>/dev/null || true; }
fires_seen() { worker_logs | grep -c '"fire_received"' || true; }
# Fires the worker received whose line also matches $1 (a schedule id or a term).
fires_matching() {
  worker_logs | grep '"fire_received"' | grep -c -- "$1" || true
}
at_least() { [ "$1" -ge "$2" ]; }
# Runs the rest of the line every 0.2 s until it succeeds; fails the demo after $2 seconds.
wait_for() {
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || fail "$what: not within the time allowed"
    sleep 0.2
  done
}
seen_at_least() { at_least "$(fires_seen)" "$1"; }
seen_from() { at_least "$(fires_matching "$1")" "$2"; }

token() { "$PY" -c 'import secrets; print(secrets.token_urlsafe(24))'; }
write_token=$(token)
read_token=$(token)
say "starting the local cluster: hascheduler dev --replicas 3 --workers 2 (with a read and a write token)"
HASCHEDULER_WRITE_TOKENS="$write_token" HASCHEDULER_READ_TOKENS="$read_token" \
  "$HS" dev --replicas 3 --workers 2 --state-dir "$state" >"$workdir/dev.out" 2>"$workdir/dev.log" &
dev_pid=$!
for _ in $(seq 1 600); do
  grep -q '^ready:' "$workdir/dev.out" 2>/dev/null && break
  kill -0 "$dev_pid" 2>/dev/null || { cat "$workdir/dev.log" >&2; fail "the cluster did not start"; }
  sleep 0.1
done
grep -q '^ready:' "$workdir/dev.out" || fail "the cluster did not get ready in 60 s"
sed 's/^/    /' "$workdir/dev.out"

status=$("$HS" dev status --json --state-dir "$state")
api=$(echo "$status" | json 'd["replicas"][0]["url"]')
leader=$(echo "$status" | json 'd["leader"]')
say "leader: $leader; adding three schedules through $api"

post() {
  local code
  code=$(curl -s -o "$workdir/post.json" -w '%{http_code}' -X POST "$api/schedules" \
    -H "Authorization: Bearer $write_token" -H 'Content-Type: application/json' -d "$1")
  [ "$code" = 201 ] || fail "POST /schedules answered $code: $(cat "$workdir/post.json")"
  echo "    created $(json 'd["id"] + " (" + d["name"] + ")"' <"$workdir/post.json")"
}
once_at=$(date -u -d '+15 seconds' +%Y-%m-%dT%H:%M:%SZ)
post '{"id": "demo-cron", "name": "every 5 s (6-field cron)", "target": "demo.cron",
       "catchup": "all", "trigger": {"kind": "cron", "cron": "*/5 * * * * *"}}'
post '{"id": "demo-poll", "name": "every 2 s with 0.5 s jitter", "target": "demo.poll",
       "catchup": "all", "jitter": 0.5, "trigger": {"kind": "interval", "every": 2}}'
post "{\"id\": \"demo-once\", \"name\": \"once at $once_at\", \"target\": \"demo.once\",
       \"catchup\": \"all\", \"trigger\": {\"kind\": \"at\", \"at\": [\"$once_at\"]}}"
# The audit window starts once every schedule exists.
since=$(now_iso)
# Writes without the write token are refused; nothing is stored.
refused() {
  local expected=$1 label=$2 code
  shift 2
  code=$(curl -s -o "$workdir/refused.json" -w '%{http_code}' -X POST "$api/schedules" \
    -H 'Content-Type: application/json' "$@" \
    -d '{"id": "intruder", "name": "x", "target": "x", "trigger": {"kind": "interval", "every": 1}}')
  [ "$code" = "$expected" ] || fail "a write $label answered $code, not $expected"
  echo "    a write $label: HTTP $code $(json 'd["title"]' <"$workdir/refused.json")"
}
refused 401 "without a token"
refused 403 "with the read token" -H "Authorization: Bearer $read_token"
code=$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $read_token" \
  "$api/schedules/intruder")
[ "$code" = 404 ] || fail "a refused write was stored (GET answered $code)"

wait_for "fires reaching the worker" 60 seen_at_least "$before_kill"
wait_for "a fire of the cron schedule" 30 seen_from '"fire_id": "demo-cron@' 1
say "the worker has received $(fires_seen) fires; the last ones:"
worker_logs | grep '"fire_received"' | tail -n 3 | "$PY" -c '
import json, sys
for line in sys.stdin:
    fire = json.loads(line)
    print("    " + fire["fire_id"] + "  term " + str(fire["term"]))'
[ "$(fires_seen)" -gt 0 ] || fail "no fire reached the worker"
leader_url=$("$HS" dev status --json --state-dir "$state" | json '[r["url"] for r in d["replicas"] if r["leader"]][0]')
say "the leader's /metrics (no token needed; a NetworkPolicy guards it on Kubernetes):"
curl -fsS "$leader_url/metrics" >"$workdir/metrics.txt"
grep -E '^hascheduler_(leader|term|fires_total\{state="(published|failed)"\}|mirror_ready|mirror_schedules) ' \
  "$workdir/metrics.txt" | sed 's/^/    /'
grep -q '^hascheduler_leader 1.0$' "$workdir/metrics.txt" || fail "/metrics does not show the leader"
standby_url=$("$HS" dev status --json --state-dir "$state" | json '[r["url"] for r in d["replicas"] if not r["leader"]][0]')
say "dashboard: $standby_url/ui (read token $read_token, write token $write_token)"

say "SIGKILL the leader"
kill_out=$("$HS" dev kill-leader --signal KILL --json --state-dir "$state")
takeover=$(echo "$kill_out" | json 'd["takeover_ms"]')
new_term=$(echo "$kill_out" | json 'd["new_term"]')
say "$(echo "$kill_out" | json '"killed " + d["killed"] + " (term " + str(d["old_term"]) + "); new leader " + d["new_leader"] + " (term " + str(d["new_term"]) + ")"')"
say "takeover time: ${takeover} ms (lease ttl 4 s + renew interval 1 s allow 5000 ms)"
"$PY" -c "import sys; sys.exit(float('$takeover') > 5000)" || fail "takeover took longer than ttl + renew interval"

new_term_line="\"term\": ${new_term}[,}]"
wait_for "fires from the new leader" 60 seen_from "$new_term_line" "$after_kill"
say "the worker has received $(fires_matching "$new_term_line") fires from term $new_term"
if [ "${DEMO_SHORT:-0}" != 1 ]; then
  wait_for "the one-off fire" 60 seen_from '"fire_id": "demo-once@' 1
  say "the one-off fired: $(worker_logs | grep '"fire_id": "demo-once@' | head -n 1 | json 'd["fire_id"]')"
fi
say "what the workers made of the fires (hascheduler runs list):"
HASCHEDULER_TOKEN=$read_token "$HS" runs list --api "$standby_url" --limit 5 | sed 's/^/    /'
succeeded=$(HASCHEDULER_TOKEN=$read_token "$HS" runs list --api "$standby_url" --state succeeded --json | json 'len(d["items"])')
[ "$succeeded" -gt 0 ] || fail "no run succeeded"
say "scale the workers to 3 and back to 2"
"$HS" dev scale-workers 3 --state-dir "$state" | sed 's/^/    /'
"$HS" dev scale-workers 2 --state-dir "$state" | sed 's/^/    /'
say "scale to 5 replicas"
"$HS" dev scale 5 --state-dir "$state" | sed 's/^/    /'
say "scale to 1 replica"
"$HS" dev scale 1 --state-dir "$state" | sed 's/^/    /'
"$HS" dev status --state-dir "$state" | sed 's/^/    /'

until_at=$(now_iso)
say "counting fires in the broker stream due $since .. $until_at"
# The last fires due may still be in flight: audit again until none is missing (bounded);
# a duplicate stays a duplicate, so the final report decides.
audit_passes() {
  audit=$("$HS" dev audit --since "$since" --until "$until_at" --json --state-dir "$state")
}
ok=1
audit_deadline=$((SECONDS + 30))
until audit_passes; do
  if [ "$SECONDS" -ge "$audit_deadline" ]; then ok=0; break; fi
  sleep 0.5
done
echo "$audit" | json '"    expected %d, delivered %d, missing %d, duplicated %d, unexpected %d" % (d["expected"], d["delivered"], d["missing"], d["duplicated"], d["unexpected"])'
[ "$ok" = 1 ] || fail "fires missed or duplicated: $audit"
[ "$(echo "$audit" | json 'd["expected"]')" -gt 0 ] || fail "no fire was due in the window"
say "0 missed, 0 duplicated; takeover ${takeover} ms"
say "stopping the cluster"
kill -TERM "$dev_pid"
for _ in $(seq 1 300); do kill -0 "$dev_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$dev_pid" 2>/dev/null && fail "the cluster did not stop"
say "demo passed"
