#!/usr/bin/env bash
# Plant every wrong world of the registry (tests/wrong_worlds) and run the chapter in it, then run every
# exercise checker on its wrong solutions; print the table: chapter, check, wrong world, rejected by,
# message. Exit status 1 if a world was not rejected by the checks its entry names.
#   bash scripts/wrong_worlds.sh                  everything (about as long as running each chapter once per world)
#   bash scripts/wrong_worlds.sh 04 10_zero3      the worlds of these chapters
#   bash scripts/wrong_worlds.sh --checkers       the exercise checkers only
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ZERONB_TIMEOUT=${ZERONB_TIMEOUT:-120}
exec "${ZERONB_VENV:-.venv}/bin/python" tests/wrong_worlds/harness.py "$@"
