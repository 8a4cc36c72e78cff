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
  # one line per stage on stderr; pip's own output (and its warnings) goes to $VENV/setup.log, shown on failure
  mkdir -p "$VENV"
  LOG="$VENV/setup.log"
  : > "$LOG"
  t0=$SECONDS
  stage() {  # stage N/M "what" command...
    local n=$1 what=$2
    shift 2
    local t=$SECONDS
    printf 'setting up %s [%s] %s ...' "$VENV" "$n" "$what" >&2
    if ! "$@" >>"$LOG" 2>&1; then
      printf ' failed\n' >&2
      echo "error: ./dev.sh set-up: $what failed; the last lines of $LOG:" >&2
      tail -n 20 "$LOG" >&2
      exit 1
    fi
    printf ' %d s\n' $((SECONDS - t)) >&2
  }
  stage 1/4 "creating the virtual environment" "$PY" -m venv "$VENV"
  upgrade_pip() { "$VENV/bin/pip" install -q --upgrade pip || echo "(pip not upgraded: kept the venv's own)"; }
  stage 2/4 "upgrading pip" upgrade_pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    stage 3/4 "installing torch 2.13.0 (CPU build)" "$VENV/bin/pip" install -q "torch==2.13.0"
  else
    echo "setting up $VENV [3/4] torch: the CUDA build comes with the dependencies" >&2
  fi
  stage 4/4 "installing digenrl (editable) with diffusers, transformers, peft, ray and the dev tools" \
    "$VENV/bin/pip" install -q -e ".[dev,ocr]"
  touch "$VENV/.installed"
  echo "setting up $VENV: done in $((SECONDS - t0)) s (pip's log: $LOG)" >&2
fi

cmd=${1:-}
shift || true
case "$cmd" in
  train) exec "$VENV/bin/digenrl" train "$@" ;;
  # two pytest-xdist workers (the 2-core machine's CPUs; DIGENRL_TEST_WORKERS=0 runs in one process,
  # e.g. for --pdb); what runs together and in which order: tests/conftest.py
  test) exec "$VENV/bin/python" -m pytest -q -n "${DIGENRL_TEST_WORKERS:-2}" --dist loadgroup "$@" ;;
  *) echo "usage: ./dev.sh train [options] | ./dev.sh test [pytest options]" >&2; exit 2 ;;
esac
