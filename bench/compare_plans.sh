#!/usr/bin/env bash
# One plans script (bench/ring_plans.py, bench/rotary_plans.py) run once a
# labelled setting of the tuning variables, each in its own process (the
# kernels read their variables once), all in one build, so the plans
# compare within one run; the rows go to OUT/plans.txt and OUT/*.jsonl.
# Usage: bench/compare_plans.sh OUT SCRIPT "ARGS" LABEL "VAR=V ..." [LABEL "VAR=V ..."]...
# e.g.   bench/compare_plans.sh out bench/ring_plans.py "softmax" \
#            block "" ring "OPSMITH_SOFTMAX_BLOCK_PACKS=0"
set -uo pipefail
if [ "$#" -lt 5 ] || [ $(( ($# - 3) % 2 )) -ne 0 ]; then
  echo "usage: $0 OUT SCRIPT \"ARGS\" LABEL \"VAR=V ...\" [LABEL \"VAR=V ...\"]..." >&2
  exit 2
fi
out=$1 script=$2 args=$3
shift 3
mkdir -p "$out"
rc=0
while [ "$#" -gt 0 ]; do
  label=$1 vars=$2
  shift 2
  # shellcheck disable=SC2086  # ARGS and VARS are word lists
  env $vars OUT="$out" python3 "$script" "$label" $args 2>&1 | tee -a "$out/plans.txt"
  st=${PIPESTATUS[0]}
  [ "$st" -eq 0 ] || { echo "$label: exit $st" >&2; rc=1; }
done
exit $rc
