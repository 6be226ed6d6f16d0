#!/usr/bin/env bash
# Schedules across three replicas, with curl: start the development MongoDB server and three
# `hascheduler serve` replicas, create a schedule on one, see it on the other two (same
# previews, equal mirror digests), and show every kind of bad input getting its 4xx.
# Exits non-zero if a check fails. Usage: scripts/schedules-demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in curl python3; do
  command -v "$tool" >/dev/null || { echo "missing tool: $tool" >&2; exit 2; }
done
# shellcheck source=scripts/_venv.sh
source scripts/_venv.sh
ensure_venv
PY=.venv/bin/python
workdir=$(mktemp -d)
# PIDs go to a file: start() runs inside $(...), a subshell, so a variable would be lost.
# The replicas stop first: stopping, each hands back its lease and leaves the members, which
# needs the database, so the database goes last. Whatever outlives its grace is killed.
stop_all() {
  local pid alive
  for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
  # Not our shell's children (they were started in subshells): poll until they are gone.
  for _ in $(seq 1 150); do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && return
    sleep 0.1
  done
  for pid in "$@"; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "process $pid did not stop within 15 s of SIGTERM; killed" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}
cleanup() {
  if [ -f "$workdir/pids" ]; then
    mapfile -t pids <"$workdir/pids"
    [ "${#pids[@]}" -gt 1 ] && stop_all "${pids[@]:1}"
    stop_all "${pids[0]}"
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT

say() { printf '[%s] %s\n' "$(date +%H:%M:%S.%3N)" "$*"; }
json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
# Start a command in the background and wait for the first line it prints (its address).
start() {
  local name=$1; shift
  "$@" >"$workdir/$name.out" 2>"$workdir/$name.log" &
  echo $! >>"$workdir/pids"
  for _ in $(seq 1 200); do
    if [ -s "$workdir/$name.out" ]; then head -n 1 "$workdir/$name.out"; return; fi
    sleep 0.1
  done
  echo "$name did not start; its log:" >&2; cat "$workdir/$name.log" >&2; exit 1
}

mongo=$(start devmongo .venv/bin/hascheduler devmongo --port 0)
db_uri="${mongo%%/\?*}/demo?${mongo#*\?}"
say "development MongoDB server: $mongo"
declare -A api
for r in a b c; do
  api[$r]=$(start "$r" .venv/bin/hascheduler serve --mongodb-uri "$db_uri" --http-port 0 \
    --replica-id "$r")
  say "replica $r: ${api[$r]}"
done
for r in a b c; do
  until curl -sf "${api[$r]}/readyz" >/dev/null; do sleep 0.1; done
done
say "all three mirrors are ready"

say "create a schedule on a"
curl -sf -X POST "${api[a]}/schedules" -H 'Content-Type: application/json' -d '{
  "id": "weekly-report", "name": "weekly report",
  "trigger": {"kind": "cron", "cron": "0 9 * * mon", "timezone": "Europe/Paris"},
  "jitter": 30, "target": "reports.weekly", "payload": {"format": "pdf"}}' | json 'd["id"], "revision", d["revision"]'

for r in b c; do
  for _ in $(seq 1 100); do
    curl -sf "${api[$r]}/mirror/weekly-report" >/dev/null && break
    sleep 0.02
  done
  curl -sf "${api[$r]}/mirror/weekly-report" >/dev/null || { say "FAIL: not on $r"; exit 1; }
  say "replica $r mirrors it: $(curl -sf "${api[$r]}/mirror/weekly-report" | json 'd["revision"], d["next_nominal"]')"
done

previews=$(for r in a b c; do curl -sf "${api[$r]}/schedules/weekly-report/next?count=3"; echo; done | sort -u | wc -l)
[ "$previews" -eq 1 ] || { say "FAIL: previews differ"; exit 1; }
say "GET /schedules/weekly-report/next agrees on all three:"
curl -sf "${api[c]}/schedules/weekly-report/next?count=3" | json '"\n".join(t["fire_at"] + "  " + t["fire_id"] for t in d["times"])'

digests=$(for r in a b c; do curl -sf "${api[$r]}/readyz" | json 'd["digest"]'; done | sort -u)
[ "$(echo "$digests" | wc -l)" -eq 1 ] || { say "FAIL: digests differ: $digests"; exit 1; }
say "mirror digests equal: $digests"

check() {  # expected status, description, curl arguments...
  local want=$1 what=$2; shift 2
  local got
  got=$(curl -s -o "$workdir/body" -w '%{http_code}' "$@")
  if [ "$got" != "$want" ]; then say "FAIL: $what gave $got, not $want"; cat "$workdir/body"; exit 1; fi
  say "$got $what: $(json '"; ".join(e["field"] + ": " + e["message"] for e in d.get("errors", [])) or d["title"]' <"$workdir/body")"
}
post() { check "$1" "$2" -X POST "${api[b]}/schedules" -H 'Content-Type: application/json' -d "$3"; }
base='"name": "bad", "target": "t"'
post 422 "bad cron" "{$base, \"trigger\": {\"kind\": \"cron\", \"cron\": \"61 * * * *\"}}"
post 422 "unknown time zone" "{$base, \"trigger\": {\"kind\": \"cron\", \"cron\": \"* * * * *\", \"timezone\": \"Mars/Base\"}}"
post 422 "interval <= 0" "{$base, \"trigger\": {\"kind\": \"interval\", \"every\": 0}}"
post 422 "instant in the past" "{$base, \"trigger\": {\"kind\": \"at\", \"at\": \"2001-01-01T00:00:00Z\"}}"
post 422 "unknown field" "{$base, \"trigger\": {\"kind\": \"interval\", \"every\": 5}, \"colour\": \"red\"}"
big=$("$PY" -c 'print("x" * 70000)')
post 422 "oversized payload" "{$base, \"trigger\": {\"kind\": \"interval\", \"every\": 5}, \"payload\": {\"b\": \"$big\"}}"
check 415 "wrong content type" -X POST "${api[b]}/schedules" -H 'Content-Type: text/plain' -d 'x'
check 404 "unknown id" "${api[c]}/schedules/nope"
check 409 "stale If-Match" -X PUT "${api[c]}/schedules/weekly-report" -H 'Content-Type: application/json' \
  -H 'If-Match: "9"' -d '{"name": "n", "target": "t", "trigger": {"kind": "interval", "every": 5}}'
say "stored schedules: $(curl -sf "${api[a]}/schedules" | json 'len(d["items"])') (nothing invalid was stored)"
say "demo passed"
