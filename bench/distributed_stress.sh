#!/usr/bin/env bash
# Launch the two-process gloo run of examples/distributed_train.py many times
# under load and count the launches that fail, in particular those where a
# rank aborts ("terminate called ...", SIGABRT) after the run has finished.
#
#   bench/distributed_stress.sh MODE RUNS [JOBS] [HOGS] [OUTDIR]
#
# MODE ddp or fsdp; RUNS launches in all; JOBS launches at a time (default 2);
# HOGS busy loops (`yes > /dev/null`) kept running meanwhile (default 1);
# OUTDIR (default /tmp/opsmith-stress-MODE) gets one folder per failed launch
# with its output, and, where a rank dumped core, a gdb backtrace of all of
# its threads. The launch is the one tests/test_distributed.py makes (torchrun,
# 2 processes, --steps 6, OMP_NUM_THREADS=1), plus PYTHONFAULTHANDLER=1 so an
# aborting rank prints its Python stacks too. Prints one summary line:
#   mode=fsdp runs=100 ok=100 failed=0 aborted=0 load1=...
set -u
MODE=${1:?usage: $0 ddp|fsdp RUNS [JOBS] [HOGS] [OUTDIR]}
RUNS=${2:?usage: $0 ddp|fsdp RUNS [JOBS] [HOGS] [OUTDIR]}
JOBS=${3:-2}
HOGS=${4:-1}
OUT=${5:-/tmp/opsmith-stress-$MODE}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
rm -rf "$OUT"/run-*

hog_pids=()
cleanup() { for p in "${hog_pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT
for ((h = 0; h < HOGS; h++)); do yes > /dev/null & hog_pids+=($!); done

# one launch, in its own folder (cores land in the cwd); prints ok|fail|abort
launch() {
    local i=$1 dir="$OUT/run-$1" port
    mkdir -p "$dir"
    # ports below the ephemeral range (where gloo's own connections live),
    # distinct for the launches of one stress run
    port=$((20000 + (i + 97 * ($$ % 120)) % 12000))
    (
        cd "$dir" || exit 1
        ulimit -c unlimited
        PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1 \
            timeout -k 10 300 "$PY" -m torch.distributed.run --nproc_per_node=2 \
            --master_addr=127.0.0.1 --master_port=$port "$ROOT/examples/distributed_train.py" \
            --mode "$MODE" --device cpu --steps 6 > stdout 2> stderr
        echo $? > rc
    )
    local rc; rc=$(cat "$dir/rc")
    local json; json=$(grep -c '^{' "$dir/stdout")
    if [ "$rc" = 0 ] && [ "$json" = 1 ]; then
        rm -rf "$dir"; echo "ok"; return
    fi
    for core in "$dir"/core*; do
        [ -e "$core" ] || continue
        gdb -batch -q -ex "thread apply all bt" "$PY" "$core" > "$core.bt" 2>&1
        rm -f "$core"
    done
    if grep -q "terminate called\|Signal 6\|SIGABRT\|exitcode *: -6" "$dir/stderr"; then
        echo "abort"
    else
        echo "fail"
    fi
}

ok=0 failed=0 aborted=0 done_=0
load_sum=0
results=$(mktemp)
for ((i = 0; i < RUNS; i++)); do
    while [ "$(jobs -rp | wc -l)" -ge $((JOBS + HOGS)) ]; do wait -n; done
    launch "$i" >> "$results" &
    # a load sample per launch
    load_sum=$(awk -v s="$load_sum" '{print s + $1}' /proc/loadavg)
done
for p in $(jobs -rp); do
    skip=0
    for h in "${hog_pids[@]}"; do [ "$p" = "$h" ] && skip=1; done
    [ $skip = 0 ] && wait "$p"
done
ok=$(grep -c '^ok$' "$results")
failed=$(grep -c '^fail$' "$results")
aborted=$(grep -c '^abort$' "$results")
rm -f "$results"
echo "mode=$MODE runs=$RUNS jobs=$JOBS hogs=$HOGS ok=$ok failed=$failed aborted=$aborted" \
     "mean_load1=$(awk -v s="$load_sum" -v n="$RUNS" 'BEGIN {printf "%.2f", s / n}') cores=$(nproc) torch=$("$PY" -c 'import torch; print(torch.__version__)')"
