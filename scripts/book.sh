#!/usr/bin/env bash
# Build the rendered book: runs every notebook, then renders the HTML into _build/html.
#   bash scripts/book.sh                         clean build, warnings are errors
#   ZERONB_INCREMENTAL=1 bash scripts/book.sh    keep _build and reuse executed notebooks unless they or
#                                                zeronb changed (faster; may hide warnings)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

# An incremental build only re-reads changed pages, so warnings from unchanged ones never show
# again and -W passes when it should not. Build from scratch unless asked otherwise.
config=_config.yml
if [ "${ZERONB_INCREMENTAL:-0}" != "1" ]; then
  rm -rf _build
else
  # Fast local rebuilds: executed notebooks are cached (jupyter-cache) and reused while they are
  # unchanged - but the cache does not see imported modules, so any change to zeronb empties it.
  mkdir -p _build
  hash=$(find zeronb -name '*.py' -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-16)
  if [ "$(cat _build/.zeronb-sources 2>/dev/null)" != "$hash" ]; then
    rm -rf _build/.jupyter_cache
    echo "$hash" > _build/.zeronb-sources
  fi
  config=.config-cached.yml  # beside _config.yml: its relative paths must stay right
  sed 's/^\(  *execute_notebooks:\).*/\1 cache/' _config.yml > "$config"
fi

VENV=${ZERONB_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
# The notebooks ask for kernel "python3". Put this environment's kernelspec first, so that a
# python3 kernel registered elsewhere (e.g. `ipykernel install --user`) cannot run them with a
# Python that lacks zeronb.
export JUPYTER_PATH="$VENV/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
"$VENV/bin/jupyter-book" build . --config "$config" -W -n --keep-going

echo "book: open $(pwd)/_build/html/index.html"
