#!/usr/bin/env bash
# On a GPU box: the GPU tests, every chapter through nbval, and the train CLI for every stage, on
# the GPUs there; then a table of what ran on which backend and device, what passed, the figures.
#   bash scripts/gpu_check.sh                 sets up .venv (keeping the machine's own torch) first
#   ZERONB_PYTHON=python3 bash scripts/gpu_check.sh   uses that Python as it is (no set-up)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${ZERONB_PYTHON:-}" ]; then
  PY=$ZERONB_PYTHON
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  bash scripts/setup.sh
  PY=${ZERONB_VENV:-.venv}/bin/python
fi
export ZERONB_TIMEOUT=${ZERONB_TIMEOUT:-300}
exec "$PY" scripts/gpu_check.py "$@"
