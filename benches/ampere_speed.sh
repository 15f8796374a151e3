#!/usr/bin/env bash
# The speed of the hand-written Ampere kernels against what they would replace, with the Hopper
# path off (what sm_80-89 run), one device call: softmax·V's backward (sm80_given.cu against
# the #[cube] mma.sync kernels; seed protocol, d2 256 / 1024 / 4096, two alternating rounds)
# and the attention backward's score rules (sm80.cu against mma.sync; bf16 D 128 S 4096:
# mask, ALiBi, window, bias, dropout), then torch's softmax(x) @ v on the same shapes.
#
# Usage, from the project root on the GPU machine, after `../shared/tools/gpu-pack --features
# cuda --bench attention --bench softmax_matmul` here:
#   BUDGET=SECONDS benches/ampere_speed.sh       # default 560
# $OUT/c2-log.txt (one line per run), $OUT/c2-summary.txt (the CSVs), $OUT/c2-bench.tar.gz.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
mkdir -p "$OUT" /tmp/c2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/c2-log.txt"
.gpu/run ls >/dev/null
b=/tmp/gpu-pack-bin
log() { echo "[$SECONDS s] $*" >> "$OUT/c2-log.txt"; }
go() { # tag, ampere use, binary, args...
  local tag=$1 mode=$2 bin=$3; shift 3
  [ $SECONDS -lt $((END - 45)) ] || { log "SKIP $tag $mode (time)"; return; }
  local s=$SECONDS
  BURN_FLASH_HOPPER=off BURN_FLASH_AMPERE_BWD=$mode timeout $((END - SECONDS - 10)) $b/$bin \
    --runtimes cuda --out /tmp/c2/$tag-$mode "$@" > /tmp/c2/$tag-$mode.log 2>&1
  log "rc $? $tag $mode $((SECONDS - s)) s"
}
for round in 1 2; do
  for mode in always off; do
    go smm$round $mode softmax_matmul.bench --sweeps backward --d2s 256,1024,4096
  done
done
for mode in always off; do
  go rules $mode attention.bench --dtypes bf16 --seqs 4096 --dims 128 --causal false,true \
    --sweeps mask,alibi,window,bias --impls burn-flash --no-memory --passes 5
done
for mode in always off; do
  go dropout $mode attention.bench --dtypes bf16 --seqs 4096 --dims 128 --causal false,true \
    --sweeps main --dropout 0.1 --impls burn-flash --no-memory --passes 5
done
[ $SECONDS -lt $((END - 60)) ] && timeout $((END - SECONDS - 10)) python3 benches/softmax_peers.py --sweeps smm --dtypes f16,bf16 --d2s 256,1024,4096 --out /tmp/c2/peers > /tmp/c2/peers.log 2>&1
log "peers rc $?"
for f in /tmp/c2/*/softmax_matmul_backward.csv /tmp/c2/*/attention.csv; do echo "== $f"; cat "$f"; done > "$OUT/c2-summary.txt" 2>/dev/null
tar -czf "$OUT/c2-bench.tar.gz" -C /tmp c2
