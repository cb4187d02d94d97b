#!/usr/bin/env bash
# One plans script (bench/ring_plans.py, bench/rotary_plans.py) run against
# two builds in one session: this tree ("new"), then the tree with the files
# under BASE swapped in ("base"; BASE mirrors the tree's paths, e.g.
# BASE/csrc/cuda/rotary.cu, copied there with `git show REV:PATH`), then
# this tree again ("new2", to see the drift between runs). Only the swapped
# files' objects are rebuilt. MAKEFLAGS passes through (CUDA_ARCH=... to build
# one architecture). Rows to OUT/plans.txt and OUT/*.jsonl.
# Usage: bench/compare_builds.sh OUT BASE SCRIPT "ARGS"
# e.g.   bench/compare_builds.sh out .base bench/ring_plans.py "glu"
set -uo pipefail
if [ "$#" -ne 4 ]; then
  echo "usage: $0 OUT BASE SCRIPT \"ARGS\"" >&2
  exit 2
fi
out=$1 base=$2 script=$3 args=$4
mkdir -p "$out"
saved=$(mktemp -d)
files=$(cd "$base" && find . -type f | sed 's|^\./||')
[ -n "$files" ] || { echo "$0: no files under $base" >&2; exit 2; }
run() {  # LABEL
  # shellcheck disable=SC2086  # ARGS is a word list
  OUT="$out" python3 "$script" "$1" $args 2>&1 | tee -a "$out/plans.txt"
}
build() {  # LABEL
  make -j"$(nproc)" build > "$out/build-$1.log" 2>&1 || { tail -20 "$out/build-$1.log" >&2; return 1; }
}
rc=0
build new && run new || rc=1
for f in $files; do mkdir -p "$saved/$(dirname "$f")" && cp "$f" "$saved/$f" && cp "$base/$f" "$f"; done
build base && run base || rc=1
# copied back (a newer time than the objects built from BASE: rebuilt)
for f in $files; do cp "$saved/$f" "$f"; done
build new2 && run new2 || rc=1
rm -rf "$saved"
exit $rc
