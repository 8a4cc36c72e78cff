#!/usr/bin/env bash
# DigenRL's two entry points on a fresh machine. Sets up .venv on first use (or when pyproject.toml
# changed), then runs:
#   ./dev.sh train [digenrl train options]   the main job (default: the tiny FLUX colour demo)
#   ./dev.sh test  [pytest options]          the whole test suite (what CI runs)
#   ./dev.sh test -m "not slow"               the fast loop: no Ray, subprocess or learning tests
# On a machine without an NVIDIA GPU it installs the CPU build of torch first (torch==2.13.0 is a
# local CPU build on these machines), never the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DIGENRL_VENV:-.venv}
PY=${PYTHON:-python3}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

if [ ! -f "$VENV/.installed" ] || [ pyproject.toml -nt "$VENV/.installed" ]; then
  echo "setting up $VENV ..." >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
  quiet() { "$@" 2>&1 | { grep -vE "Location 'file:.* is ignored|BuildBackendWarning|^\s*(!!|\*+)?\s*$" || true; }; }
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    quiet "$VENV/bin/pip" install -q "torch==2.13.0"
  fi
  quiet "$VENV/bin/pip" install -q -e ".[dev]"
  touch "$VENV/.installed"
fi

cmd=${1:-}
shift || true
case "$cmd" in
  train) exec "$VENV/bin/digenrl" train "$@" ;;
  test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
  *) echo "usage: ./dev.sh train [options] | ./dev.sh test [pytest options]" >&2; exit 2 ;;
esac
