#!/usr/bin/env bash
# Set up .venv for zeronb: idempotent, and quiet when there is nothing to do.
#  - A torch that the system Python already has (a GPU box) is reused through
#    --system-site-packages and never replaced.
#  - Otherwise torch==2.13.0 is installed first: on the machines this course is
#    tested on that is a CPU wheel on disk; an unpinned torch would pull a
#    multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ZERONB_VENV:-.venv}
stamp="$VENV/.zeronb-setup"
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)

# the book's browser scripts, served by the site itself (idempotent; needs npm the first time)
bash scripts/fetch_assets.sh

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import torch, zeronb" 2>/dev/null; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: reusing the torch of $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  pip install "torch==2.13.0"
fi
echo "setup: installing requirements and zeronb into $VENV"
pip install -r requirements.txt
pip install --no-deps -e .
echo "$want" > "$stamp"
