#!/usr/bin/env bash
# Set up .venv for zeronb: idempotent, and quiet when there is nothing to do.
#  - A torch that the system Python already has (a GPU box) is reused through
#    --system-site-packages and never replaced.
#  - Otherwise torch==2.13.0 is installed first, the CPU build: from PyTorch's
#    CPU index where it can be reached, else from pip's own index (on the
#    machines this course is tested on, a CPU wheel on disk).
#  - Everything else at the versions in constraints.txt (scripts/refresh_constraints.sh
#    makes it), so that every machine builds the same book; on a Python those pins
#    do not install on, the newest versions that do, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ZERONB_VENV:-.venv}
stamp="$VENV/.zeronb-setup"
want=$(cat requirements.txt constraints.txt pyproject.toml | sha256sum | cut -c1-16)

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
pinned() {
  pip install -c constraints.txt "$@" && return
  echo "setup: the versions pinned in constraints.txt do not install with $("$VENV/bin/python" --version); installing the newest that do"
  pip install "$@"
}
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  # from PyTorch's CPU index (on Linux the public index's wheel is the multi-GB CUDA build); where that
  # index cannot be reached (offline, behind a mirror), from the index pip is configured with
  pip install --retries 0 --timeout 10 --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" 2>/dev/null \
    || pinned "torch==2.13.0"
fi
echo "setup: installing requirements (pinned by constraints.txt) and zeronb into $VENV"
pinned -r requirements.txt
pip install --no-deps -e .
echo "$want" > "$stamp"
