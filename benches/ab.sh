#!/usr/bin/env bash
# Same-call A/B of two builds on the GPU machine: the attention bench (bf16, D 64 / 128,
# S 1024 / 4096 / 16384, non-causal, forward and training step) and the seed sweeps
# (`softmax.bench`, `softmax_matmul.bench`, CUDA rows), each build run ROUNDS times in
# alternation (A B A B …) so that the spread between rounds of one build gives the noise.
#
# Usage, from the project root on the GPU machine:
#   benches/ab.sh A_DIR B_DIR [ROUNDS] [attention|softmax|smm ...]
# where A_DIR and B_DIR each hold `attention.bench`, `softmax.bench`, `softmax_matmul.bench`
# (stripped release builds of `--features cuda`, as `../shared/tools/gpu-pack` stages them).
# Every CSV goes to $OUT/ab/<a|b>-r<round>/, packed as $OUT/ab.tar.gz; the medians of the
# headline columns are printed last (`benches/ab_summary.py`).
set -uo pipefail
a=$1 b=$2 rounds=${3:-2}
shift 3 || shift $#
which=("$@")
[ ${#which[@]} -gt 0 ] || which=(attention softmax smm)
out=${OUT:-/tmp}/ab
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    dir=$a
    [ "$side" = b ] && dir=$b
    dest="$out/$side-r$r"
    mkdir -p "$dest"
    for w in "${which[@]}"; do
      case "$w" in
        attention) "$dir/attention.bench" --runtimes cuda --dtypes bf16 --dims 64,128 \
          --seqs 1024,4096,16384 --causal false --sweeps main --impls burn-flash \
          --modes fwd,train --no-memory --out "$dest" ;;
        softmax) "$dir/softmax.bench" --runtimes cuda --out "$dest" ;;
        smm) "$dir/softmax_matmul.bench" --runtimes cuda --out "$dest" ;;
        *) echo "ab.sh: unknown bench $w" >&2; exit 2 ;;
      esac >"$dest/$w.log" 2>&1 || echo "ab.sh: $side round $r $w failed (see $dest/$w.log)"
    done
  done
done
tar -czf "${OUT:-/tmp}/ab.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
python3 "$(dirname "$0")/ab_summary.py" "$out"
