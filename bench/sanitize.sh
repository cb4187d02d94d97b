#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over every
# CUDA op, forward and backward (bench/sanitize_ops.py), on a GPU machine.
# The caching allocator is off so out-of-bounds accesses land outside any
# allocation and uninitialised reads are not hidden by reused blocks.
# Usage: bench/sanitize.sh OUT_DIR   (after `make build`)
set -uo pipefail
out=${1:-bench/results/latest}
mkdir -p "$out"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
summary="$out/sanitize-summary.txt"
: > "$summary"
status=0
# the four tools run at once (independent processes; the GPU has room)
run_tool() {
  local tool=$1 log="$out/sanitize-$1.log"
  timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --print-limit 20 python3 bench/sanitize_ops.py > "$log" 2>&1
  echo $? > "$out/sanitize-$tool.rc"
}
tools="memcheck racecheck initcheck synccheck"
for tool in $tools; do run_tool "$tool" & done
wait
for tool in $tools; do
  log="$out/sanitize-$tool.log"
  rc=$(cat "$out/sanitize-$tool.rc"); rm -f "$out/sanitize-$tool.rc"
  # racecheck reports hazards; the other tools report errors
  errors=$(grep -Eo '(ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?, [0-9]+ warnings?\))' "$log" | tail -1)
  echo "$tool: exit $rc; ${errors:-no summary line}; $(grep -E '^sanitize_ops:' "$log" | tail -1)" | tee -a "$summary"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
