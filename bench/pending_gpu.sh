#!/usr/bin/env bash
# What waits for a GPU (bench/NOTES.md names each "not yet run on a GPU"),
# in one call on the GPU machine: the library built for sm_90 with the C
# tests; the CUDA cases of the changes not yet run (the autograd nodes'
# in-place rules and symbolic sizes: cross-entropy, the fused linear op,
# RMSNorm's in-place backward, the fused add's dtype promotion, rotary); on an H200 also the norm forwards' and
# softmax's plans compared in one build ("Next on the H200: the norm
# forwards' plans, one build"). Logs and rows under OUT. `norms` instead
# runs the norms' benchmark against eager, torch.compile and Liger (Liger
# carried as a wheel; issue 12's README table and plots come from it), its
# folder packed into OUT/norms.tgz so that it comes back as one file.
# Usage: bench/pending_gpu.sh OUT [tests|plans|norms]   (default: tests and plans)
set -uo pipefail
out=${1:?usage: $0 OUT [tests|plans|norms]}
what=${2:-both}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{
  echo "date: $(date -u +%F)"
  echo "gpu: $gpu"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  python3 -c 'import torch, triton; print("torch:", torch.__version__, "| triton:", triton.__version__)'
} > "$out/env.txt"
cat "$out/env.txt"
t0=$(date +%s)
make -j"$(nproc)" build build/test_c CUDA_ARCH="-gencode arch=compute_90,code=sm_90" > "$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
rc=0
if [ "$what" = norms ]; then
  timeout 540 python3 -m opsmith bench --quick --budget 120 --ops rms_norm layer_norm fused_add_rms_norm \
    --out "$out/norms" > "$out/norms.log" 2>&1 || rc=1
  tar czf "$out/norms.tgz" -C "$out" norms && rm -rf "$out/norms"
  tail -5 "$out/norms.log"
  exit $rc
fi
if [ "$what" != plans ]; then
  python3 -m pytest -q -k cuda tests/test_fused_linear_cross_entropy.py tests/test_cross_entropy.py \
    tests/test_rms_norm_options.py tests/test_fused_add_rms_norm.py tests/test_rotary.py > "$out/pytest_cuda.txt" 2>&1 || rc=1
  tail -1 "$out/pytest_cuda.txt"
fi
case "$gpu" in *H200*) ;; *) what=tests ;; esac
if [ "$what" != tests ]; then
  bench/compare_plans.sh "$out" bench/ring_plans.py "ln rms add" default "" resident \
    "OPSMITH_NORM_RING_MIN_PACKS=4096" narrow "OPSMITH_NORM_RING_MIN_PACKS=128" lean4 "OPSMITH_NORM_WARP_ROW_LEAN=4" || rc=1
  bench/compare_plans.sh "$out" bench/ring_plans.py "softmax" sm-block "" sm-ring "OPSMITH_SOFTMAX_BLOCK_PACKS=0" || rc=1
fi
echo "done in $(( $(date +%s) - t0 )) s, exit $rc"
exit $rc
