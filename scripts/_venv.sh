# shellcheck shell=bash
# Sourced by the scripts: make sure .venv exists and holds this project with its development
# tools (dev/, the [dev] extra) and the test suite's tools (the [test] extra).
# Needs only Python 3.11+ on the PATH (as python3, or set PYTHON).

# One line per set-up step, with the time it took (on stderr: stdout is the command's).
step() {
  local what="$1"
  shift
  local began=$SECONDS
  echo "set-up: $what ..." >&2
  "$@"
  echo "set-up: $what: done in $((SECONDS - began)) s" >&2
}

ensure_venv() {
  local python="${PYTHON:-python3}"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "hascheduler needs Python 3.11 or newer as '$python' (set PYTHON to choose one)" >&2
    exit 2
  fi
  if [ ! -x .venv/bin/python ]; then
    step "creating .venv" "$python" -m venv .venv
  fi
  # Reinstall when either pyproject.toml changed since the last install. The [dev] extra's
  # hascheduler-dev is the package in dev/, named on the same command line.
  if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ] \
      || [ dev/pyproject.toml -nt .venv/.installed ]; then
    step "upgrading pip" .venv/bin/python -m pip install --quiet --upgrade pip
    step "installing hascheduler and its tools (a minute or two)" \
      .venv/bin/python -m pip install --quiet -e '.[dev,test]' -e ./dev
    touch .venv/.installed
  fi
  # The development server's hot modules compiled with mypyc
  # (dev/hascheduler_dev/devmongo/native.py), again whenever its sources or the venv
  # changed; if that fails the server runs from its sources, and says why here.
  local stamp=dev/.compiled/.checked
  if [ ! -f "$stamp" ] || [ .venv/.installed -nt "$stamp" ] \
      || [ -n "$(find dev/hascheduler_dev/devmongo -name '*.py' -newer "$stamp" -print -quit)" ]; then
    step "compiling the development server (a minute)" \
      .venv/bin/python -m hascheduler_dev.devmongo.native build >/dev/null || true
    mkdir -p dev/.compiled && touch "$stamp"
  fi
}

# schemathesis (tests/test_schemathesis.py) in a venv of its own, .venv/schemathesis: it
# needs rich, and structlog imports rich wherever it is installed, so in .venv every
# replica, worker and command the suite starts would load what no production install has.
SCHEMATHESIS_SPEC='schemathesis>=4.0,<5'
ensure_schemathesis() {
  local venv=.venv/schemathesis
  if [ -e .venv/bin/schemathesis ]; then  # a .venv from before it moved out
    .venv/bin/python -m pip uninstall --quiet --yes schemathesis rich
  fi
  if [ ! -x "$venv/bin/schemathesis" ] \
      || [ "$(cat "$venv/.spec" 2>/dev/null)" != "$SCHEMATHESIS_SPEC" ]; then
    .venv/bin/python -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$SCHEMATHESIS_SPEC"
    echo "$SCHEMATHESIS_SPEC" > "$venv/.spec"
  fi
}

# Debian packages the test suite runs for real: chromium (the dashboard's browser test),
# openssl (certificates for the TLS tests), rabbitmq-server (the RabbitMQ and Celery
# tests, run as the tests' own child), faketime (libfaketime: replicas whose wall clock
# is wrong), nftables (the partitions cut inside network namespaces) and prometheus
# (promtool checks and unit-tests the shipped alert rules; a real server evaluates them). Installed with apt-get when missing; a machine
# without apt-get must provide them (the tests fail, never skip, without them).
ensure_test_tools() {
  local missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server)
  compgen -G '/usr/lib/*/faketime/libfaketime.so.1' >/dev/null || missing+=(faketime)
  command -v nft >/dev/null 2>&1 || missing+=(nftables)
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "the tests need ${missing[*]}; install them (no apt-get here to do it)" >&2
    exit 2
  fi
  echo "installing ${missing[*]} with apt-get" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
}
