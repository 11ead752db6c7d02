#!/usr/bin/env bash
# Run every test: the unit and fault tests of zeronb, the real-kernel tests, every notebook as a
# test (nbval: the check cells' asserts are the test), and the book build with its page tests. Each
# chapter runs once: the book is rendered from nbval's run of it (tests/nbrecord.py), and a chapter
# that failed there is executed by the build itself.
#   bash scripts/test.sh               all of it
#   bash scripts/test.sh -k cluster    extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
VENV=${ZERONB_VENV:-.venv}

# The page tests drive a real browser: Debian's Chromium, installed here when missing.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing chromium (Debian package) for the browser tests"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "test: chromium not found and cannot install it here: the browser tests will be skipped"
  fi
fi

# A hung call fails in two minutes, not the thirty of gloo's own timeout.
export ZERONB_TIMEOUT=${ZERONB_TIMEOUT:-120}
# -v: the log shows every test and every notebook cell that ran; --durations: the slowest ones.
exec "$VENV/bin/python" -m pytest -v -p no:cacheprovider --timeout 900 --durations=15 \
  --nbval-lax --nbval-current-env tests notebooks "$@"
