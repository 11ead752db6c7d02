#!/usr/bin/env bash
# Does every chapter pass when opened alone, on a quiet machine and on a busy one? Runs each chapter
# through nbval on its own, several times, quiet and with one busy process beside it
# (python3 -c "while True: pass"), and prints a table of passes and times. Not part of CI: it takes
# long (about 40 minutes for the whole book on 2 cores).
#   bash scripts/steadiness.sh                    every chapter: 5 + 5 runs for those that assert a
#                                                 time, 2 + 2 for the others
#   bash scripts/steadiness.sh 13 05              only these chapters (numbers or file names)
#   RUNS=1 bash scripts/steadiness.sh 13          1 quiet + 1 busy run each
# A failing run's nbval log is kept in _build/steadiness/.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${ZERONB_VENV:-.venv}
export JUPYTER_PATH="$PWD/$VENV/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"

# The chapters whose checks assert a time (a duration, a speed-up, an order of events in time)
TIMED="01 04 05 11 12 13"

chapters=()
if [ $# -eq 0 ]; then
  for f in notebooks/*.ipynb; do chapters+=("$f"); done
else
  for a in "$@"; do chapters+=($(ls notebooks/"${a%.ipynb}"*.ipynb)); done
fi

logs=_build/steadiness
mkdir -p "$logs"
busy=""
stop_busy() { [ -n "$busy" ] && kill "$busy" 2>/dev/null; busy=""; }
trap stop_busy EXIT

printf '%-22s %8s %8s %12s %12s\n' chapter quiet busy "quiet s" "busy s"
total_fail=0
for nb in "${chapters[@]}"; do
  name=$(basename "$nb" .ipynb)
  runs=${RUNS:-2}
  case " $TIMED " in *" ${name%%_*} "*) runs=${RUNS:-5} ;; esac
  declare -A passed=([quiet]=0 [busy]=0) times=([quiet]="" [busy]="")
  for i in $(seq "$runs"); do
    for load in quiet busy; do  # taking turns, so that a slow spell of the machine hits both
      [ "$load" = busy ] && { python3 -c "while True: pass" & busy=$!; }
      t0=$(date +%s%N)
      if "$VENV/bin/python" -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env "$nb" \
           > "$logs/$name.$load.$i.log" 2>&1; then
        passed[$load]=$((passed[$load] + 1)); rm -f "$logs/$name.$load.$i.log"
      else
        total_fail=$((total_fail + 1))
      fi
      times[$load]+="$(( ($(date +%s%N) - t0) / 1000000000 )) "
      stop_busy
    done
  done
  med() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {printf "%.0f", a[int((NR+1)/2)]}'; }
  printf '%-22s %8s %8s %12s %12s\n' "$name" "${passed[quiet]}/$runs" "${passed[busy]}/$runs" \
    "$(echo "${times[quiet]}" | med)" "$(echo "${times[busy]}" | med)"
  unset passed times
done
echo "failed runs: $total_fail (logs in $logs/)"
[ "$total_fail" = 0 ]
