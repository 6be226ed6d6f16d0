# shellcheck shell=bash
# Sourced by the scripts: make sure .venv exists and holds this project with its dev extras.
# Needs only Python 3.11+ on the PATH (as python3, or set PYTHON).
ensure_venv() {
  local python="${PYTHON:-python3}"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "hascheduler needs Python 3.11 or newer as '$python' (set PYTHON to choose one)" >&2
    exit 2
  fi
  if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
  fi
  # Reinstall when pyproject.toml changed since the last install.
  if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    touch .venv/.installed
  fi
}
