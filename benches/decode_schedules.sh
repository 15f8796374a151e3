#!/usr/bin/env bash
# The decoding kernel's schedules in one device call: for each `KEYS:CUBES` pair of SCHEDULES
# (`BURN_FLASH_DECODE_KEYS`: keys per group per step; `BURN_FLASH_DECODE_CUBES`: cubes per
# multiprocessor the splits aim at; the test suites and benches read both, the GPT example
# takes `--decode-schedule`), the CUDA tests of the decoding kernel (`attention`
# `split_decode` and `paged`, f32 / bf16 / f16, one process each), the `decode` bench, and the
# GPT example's paged decoding; then the PyTorch peer once.
#
# Usage, from the project root on the GPU machine, after
#   ../shared/tools/gpu-pack --features cuda --bench decode --test attention --example gpt
# here:  SCHEDULES="8:4 4:16" benches/decode_schedules.sh
# Writes $OUT/decode-schedules.log and $OUT/decode-schedules.tar.gz (CSVs, PNGs, test logs).
set -uo pipefail
out=${OUT:-/tmp/decode-schedules}
mkdir -p "$out"
log=$out/decode-schedules.log
work=/tmp/decode-schedules
rm -rf "$work" && mkdir -p "$work/tests"
exec > >(tee -a "$log") 2>&1
.gpu/run ls >/dev/null # unpacks the binaries once
bin=/tmp/gpu-pack-bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
pack() { tar -czf "$out/decode-schedules.tar.gz" -C "$work" . 2>/dev/null; }
schedules=${SCHEDULES:-8:16}
batches=${BATCHES:-1,8,32,64}
contexts=${CONTEXTS:-8192,32768,131072}

# -- the tests under every schedule at once (one process per test and schedule) --
tests=$("$bin/attention.test" --list 2>/dev/null |
  sed -n 's/^\(cuda::[a-z0-9]*::\(split_decode\|paged\)\): test$/\1/p')
pids=()
for sched in $schedules; do
  for t in $tests; do
    (
      l="$work/tests/k${sched%:*}-c${sched#*:}-${t//::/-}.log"
      if BURN_FLASH_DECODE_KEYS=${sched%:*} BURN_FLASH_DECODE_CUBES=${sched#*:} \
        timeout 120 "$bin/attention.test" "$t" --exact --test-threads=1 >"$l" 2>&1; then
        echo "PASS $sched $t"
      else
        echo "FAIL $sched $t"
      fi
    ) &
    pids+=($!)
  done
done
wait "${pids[@]}"
pack

# -- the bench and the GPT example's decoding, one schedule after another --
for sched in $schedules; do
  export BURN_FLASH_DECODE_KEYS=${sched%:*} BURN_FLASH_DECODE_CUBES=${sched#*:}
  d="$work/k${sched%:*}-c${sched#*:}"
  echo "::: schedule $sched"
  timeout 60 "$bin/decode.bench" --runtimes cuda --dtypes bf16 --batches "$batches" \
    --contexts "$contexts" --passes 5 --impls contiguous,paged --out "$d" | grep -v '^wrote'
  timeout 60 "$bin/gpt.example" --runtime cuda --dtype bf16 --d-model 512 --layers 4 --heads 8 \
    --decode-schedule "$sched" --out "$d" decode --context 4096 --tokens 16 --caches contiguous,paged | grep '^gpt decode'
  pack
done
unset BURN_FLASH_DECODE_KEYS BURN_FLASH_DECODE_CUBES
timeout 60 python3 benches/decode_peer.py --batches "$batches" --contexts "$contexts" --passes 5 \
  --out "$work/peer" | grep -v '^wrote' | tail -n +1 >/dev/null
echo "::: tests: $(grep -c '^PASS ' "$log") passed, $(grep -c '^FAIL ' "$log") failed"
grep '^FAIL ' "$log"
pack
echo "::: done in $SECONDS s"
