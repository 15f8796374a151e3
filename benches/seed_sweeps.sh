#!/usr/bin/env bash
# The seed benchmarks and their peers in one device call: burn-flash's softmax and/or
# softmax(X)·V sweeps, then benches/softmax_peers.py (torch, Triton) on the same shapes, then the
# PNGs redrawn with every implementation on one plot per sweep.
#
# Usage, from the project root on the GPU machine, after
# `../shared/tools/gpu-pack --features cuda --bench softmax --bench softmax_matmul` here:
#   benches/seed_sweeps.sh softmax|smm|both [extra bench args...]
# Everything goes to $OUT/seed (CSV, PNG, logs), packed as $OUT/seed.tar.gz as well.
set -uo pipefail
which=${1:-both}
shift || true
.gpu/run ls >/dev/null
bin=/tmp/gpu-pack-bin
out=${OUT:-/tmp}/seed
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv >"$out/gpu.txt"
if [ "$which" = softmax ] || [ "$which" = both ]; then
  "$bin/softmax.bench" --runtimes cuda --out "$out" "$@" 2>&1 | tee "$out/softmax.log"
  python3 benches/softmax_peers.py --sweeps softmax --out "$out" 2>&1 | tee "$out/softmax_peers.log"
  "$bin/softmax.bench" --plot "$out/softmax.csv"
fi
if [ "$which" = smm ] || [ "$which" = both ]; then
  "$bin/softmax_matmul.bench" --runtimes cuda --out "$out" "$@" 2>&1 | tee "$out/softmax_matmul.log"
  python3 benches/softmax_peers.py --sweeps smm --out "$out" 2>&1 | tee "$out/smm_peers.log"
  "$bin/softmax_matmul.bench" --plot "$out/softmax_matmul.csv"
fi
tar -czf "${OUT:-/tmp}/seed.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
