#!/usr/bin/env bash
# The Kubernetes story on a Kind cluster: create it, build and load the image, apply k8s/base,
# wait for MongoDB's replica set and NATS, then the story (scripts/_k8s_story.sh, shared with
# scripts/k8s-local-demo.sh): schedules through the HTTP endpoint, the leader pod deleted
# (then the next one force-deleted), fires continuing, scaled to 5 replicas and back to 2,
# workers to 3 and back, and an audit of the stream.
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
API=http://127.0.0.1:8080  # kind-config.yaml maps the Service's node port here
say() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
kc() { kubectl --context "kind-$CLUSTER" "$@"; }
k() { kc -n "$NS" "$@"; }
api_url() { echo "$API"; }
# shellcheck source=scripts/_k8s_story.sh
source scripts/_k8s_story.sh

if ! kind get clusters | grep -qx "$CLUSTER"; then
  say "creating the Kind cluster $CLUSTER"
  kind create cluster --config kind-config.yaml
fi
say "building $IMAGE and loading it into the cluster"
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

story_secret
say "applying k8s/base (kustomize)"
kc apply -k k8s/base
k rollout status statefulset/mongodb --timeout=300s
k wait --for=condition=complete job/mongodb-rs-init --timeout=300s
k rollout status statefulset/nats --timeout=300s

story_run
say "the API stays on $API, the dashboard on $API/ui (write token: kubectl -n $NS get secret hascheduler-tokens -o jsonpath='{.data.write}' | base64 -d); scripts/kind-down.sh deletes the cluster"
