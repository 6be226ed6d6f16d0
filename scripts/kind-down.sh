#!/usr/bin/env bash
# Deletes the Kind cluster that scripts/kind-demo.sh created.
set -euo pipefail
command -v kind >/dev/null || { echo "kind-down needs: kind (not found on the PATH)" >&2; exit 2; }
kind delete cluster --name hascheduler
