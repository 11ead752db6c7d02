#!/usr/bin/env bash
# Build the rendered book: runs every notebook, then renders the HTML into _build/html.
#   bash scripts/book.sh                         clean build, warnings are errors
#   ZERONB_INCREMENTAL=1 bash scripts/book.sh    keep the previous _build (faster; may hide warnings)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

# An incremental build only re-reads changed pages, so warnings from unchanged ones never show
# again and -W passes when it should not. Build from scratch unless asked otherwise.
if [ "${ZERONB_INCREMENTAL:-0}" != "1" ]; then
  rm -rf _build
fi

VENV=${ZERONB_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
# The notebooks ask for kernel "python3". Put this environment's kernelspec first, so that a
# python3 kernel registered elsewhere (e.g. `ipykernel install --user`) cannot run them with a
# Python that lacks zeronb.
export JUPYTER_PATH="$VENV/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
"$VENV/bin/jupyter-book" build . -W -n --keep-going

echo "book: open $(pwd)/_build/html/index.html"
