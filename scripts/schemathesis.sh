#!/usr/bin/env bash
# The long schemathesis run against a replica on the development server (the suite runs a
# short one). Usage: scripts/schemathesis.sh [EXAMPLES_PER_OPERATION, default 500]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_venv.sh
source scripts/_venv.sh
ensure_venv
ensure_schemathesis
HASCHEDULER_SCHEMATHESIS_SEED="" HASCHEDULER_SCHEMATHESIS_EXAMPLES="${1:-500}" exec .venv/bin/python -m pytest -q \
  tests/test_schemathesis.py -p no:cacheprovider -o addopts="" --timeout 3600
