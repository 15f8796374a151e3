#!/usr/bin/env bash
# Issue 36's serving checks and measurements in one device call, within a few minutes: the CUDA
# tests of the serving path (nn: paged and rolling caches, ServingEncoder, fused layer norm and
# linear, KV caches, transformer; attention: split decoding and paged caches), the decoding bench under each
# schedule of SCHEDULES (same call), its PyTorch peer, and the GPT example's `decode` (with
# kernel counts) and `serve` tasks.
#
# Usage, from the project root on the GPU machine, after
#   ../shared/tools/gpu-pack --features cuda --example gpt --test nn --test attention --bench decode
# here:  benches/serving_gpu.sh
# Writes $OUT/serving-gpu.log (everything printed) and $OUT/serving-gpu.tar.gz (CSVs, PNGs,
# per-test logs). Each step has its own time limit; a failed step is logged and the rest runs.
# A dry run on lavapipe (the same binaries, wgpu, small shapes):
#   PREFIX=wgpu RUNTIME=wgpu DTYPE=f32 BATCHES=1 CONTEXTS=512 CONTEXT=256 REQUESTS=3 \
#     PROMPT=16x64 NEW=2x6 OUT=/tmp/dry benches/serving_gpu.sh
# SCHEDULES (default `8:16`): the decoding schedules to time, `KEYS:CUBES` pairs separated by
# spaces (`BURN_FLASH_DECODE_KEYS`, `BURN_FLASH_DECODE_CUBES`: keys per group per step, cubes
# per multiprocessor the splits aim at); the first is the default build's schedule.
set -uo pipefail
out=${OUT:-/tmp/serving-gpu}
mkdir -p "$out"
log=$out/serving-gpu.log
work=/tmp/serving-gpu
rm -rf "$work" && mkdir -p "$work/tests"
exec > >(tee -a "$log") 2>&1
.gpu/run ls >/dev/null # unpacks the binaries once
bin=/tmp/gpu-pack-bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# Each step's files are packed again after it: a call stopped at its limit still brings back
# what the finished steps wrote.
pack() { tar -czf "$out/serving-gpu.tar.gz" -C "$work" . 2>/dev/null; }
step() {
  local limit=$1 s=$SECONDS
  shift
  echo "::: $*"
  timeout "$limit" "$@"
  echo "::: exit $? after $((SECONDS - s)) s: $*"
  pack
}

# -- tests, one process per test, all at once (most of a CUDA test's time is NVRTC) --
s=$SECONDS
{
  "$bin/nn.test" --list 2>/dev/null |
    sed -n 's/^\('"${PREFIX:-cuda}"'::[a-z0-9]*::\(serving\|paged\|fused_layer_norm\|fused_linear\|rolling\|kv_cache\|transformer\|sliding\)[a-z_]*\): test$/nn.test \1/p'
  "$bin/attention.test" --list 2>/dev/null |
    sed -n 's/^\('"${PREFIX:-cuda}"'::[a-z0-9]*::\(split_decode\|paged\)[a-z_]*\): test$/attention.test \1/p'
} >"$work/tests.txt"
echo "::: $(wc -l <"$work/tests.txt") tests"
# `wait` with the jobs' pids: a bare `wait` would also wait for the `tee` above, which never
# ends (s37's call hung there until its limit).
pids=()
while read -r b t; do
  (
    l="$work/tests/${b%.test}-${t//::/-}.log"
    s0=$SECONDS
    if timeout "${TEST_TIMEOUT:-75}" "$bin/$b" "$t" --exact --test-threads=1 >"$l" 2>&1; then r=PASS; else r=FAIL; fi
    echo "$r $((SECONDS - s0))s $b $t"
  ) &
  pids+=($!)
done <"$work/tests.txt"
# compute-sanitizer on the new and changed kernels, beside the tests.
san() {
  local tool=$1 kns=$2 b=$3 t=$4 l="$work/tests/sanitizer-$1-${4//::/-}.log" s0=$SECONDS
  timeout "${SANITIZER_TIMEOUT:-75}" compute-sanitizer --tool "$tool" --kernel-name "kns=$kns" \
    "$bin/$b" "$t" --exact --test-threads=1 >"$l" 2>&1
  echo "SANITIZER $tool $kns $t: exit $? after $((SECONDS - s0)) s: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$l" | tail -1)"
}
p=${PREFIX:-cuda}
san memcheck layer_norm nn.test "$p::${DTYPE:-bf16}::fused_layer_norm" &
pids+=($!)
san racecheck layer_norm nn.test "$p::f32::fused_layer_norm" &
pids+=($!)
san memcheck decode attention.test "$p::${DTYPE:-bf16}::paged" &
pids+=($!)
san racecheck decode attention.test "$p::${DTYPE:-bf16}::split_decode" &
pids+=($!)
san memcheck linear_rows nn.test "$p::${DTYPE:-bf16}::fused_linear" &
pids+=($!)
san racecheck linear_rows nn.test "$p::f32::fused_linear" &
pids+=($!)
wait "${pids[@]}"
echo "::: tests took $((SECONDS - s)) s"
pack

# -- the decoding kernel under each schedule, then torch --
dec=(--runtimes "${RUNTIME:-cuda}" --dtypes "${DTYPE:-bf16}" --batches "${BATCHES:-8,32}" --contexts "${CONTEXTS:-8192,32768}"
  --passes 5 --impls contiguous,paged)
for sched in ${SCHEDULES:-8:16}; do
  BURN_FLASH_DECODE_KEYS=${sched%:*} BURN_FLASH_DECODE_CUBES=${sched#*:} \
    step 40 "$bin/decode.bench" "${dec[@]}" --out "$work/decode-k${sched%:*}-c${sched#*:}"
done
step 40 python3 benches/decode_peer.py --batches "${BATCHES:-8,32}" --contexts "${CONTEXTS:-8192,32768}" \
  --passes 5 --out "$work/decode-peer"

# -- the GPT example: a decoded token per cache (and kernels per token), then serving --
gpt=(--runtime "${RUNTIME:-cuda}" --dtype "${DTYPE:-bf16}" --d-model 512 --layers 4 --heads 8)
step 60 "$bin/gpt.example" "${gpt[@]}" --out "$work/gpt" decode --context "${CONTEXT:-4096}" --tokens 16 \
  --caches contiguous,paged --count-kernels
# The contiguous cache first: the others' first tokens are checked against its.
step 90 "$bin/gpt.example" "${gpt[@]}" --out "$work/gpt" serve --requests "${REQUESTS:-16}" \
  --prompt "${PROMPT:-64x1024}" --new "${NEW:-16x64}" --runs 1 --caches "${SERVE_CACHES:-contiguous,paged,burn}"

echo "::: tests: $(grep -c '^PASS ' "$log") passed, $(grep -c '^FAIL ' "$log") failed"
grep '^FAIL \|^SANITIZER' "$log"
pack
echo "::: done in $SECONDS s"
