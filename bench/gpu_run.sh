#!/usr/bin/env bash
# One GPU-machine session: build, every test, the demo, and a benchmark;
# logs and a summary under $1 (default bench/results/latest).
# Usage: bench/gpu_run.sh OUT_DIR [bench arguments...]
set -uo pipefail
out=${1:-bench/results/latest}; shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  echo "date: $(date -u +%F)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  python3 -c 'import torch, sys; print("torch:", torch.__version__, "| cuda:", torch.version.cuda, "| python:", sys.version.split()[0])'
  nvcc --version | tail -1 | sed 's/^/nvcc: /'
} > "$out/env.txt"
timeout "${TEST_TIMEOUT:-1200}" make test > "$out/test.log" 2>&1; test_rc=$?
python3 -m opsmith demo > "$out/demo.log" 2>&1
if [ "$#" -gt 0 ]; then
  timeout "${BENCH_TIMEOUT:-1800}" python3 -m opsmith bench --out "$out/bench" "$@" > "$out/bench.log" 2>&1
fi
{
  cat "$out/env.txt"
  echo "make test exit code: $test_rc"
  echo "C tests: $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out/test.log" | head -1)"
  echo "C tests under ASan+UBSan: $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out/test.log" | tail -1)"
  echo "pytest: $(grep -E '(passed|failed)' "$out/test.log" | grep -E ' in [0-9.]+s' | tail -1)"
} > "$out/summary.txt"
cat "$out/summary.txt"
tail -15 "$out/demo.log"
exit $test_rc
