#!/usr/bin/env bash
# Nsight Compute on the decoding path, in one device call: (1) the decoding kernel's ceiling at
# one bench point (speed of light, occupancy, launch statistics, warp stalls, memory), and (2)
# the device time of every kernel of the GPT example's paged decoding, so that a decoded
# token's device time can be set against its wall time (host-bound or not).
#
# Usage, from the project root on the GPU machine, after
#   ../shared/tools/gpu-pack --features cuda --bench decode --test attention --example gpt
# here:  benches/profile_decode.sh
# Writes $OUT/profile-decode.log and $OUT/profile-decode.tar.gz (ncu's reports as text and CSV).
set -uo pipefail
out=${OUT:-/tmp/profile-decode}
mkdir -p "$out"
work=/tmp/profile-decode
rm -rf "$work" && mkdir -p "$work"
exec > >(tee -a "$out/profile-decode.log") 2>&1
.gpu/run ls >/dev/null # unpacks the binaries once
bin=/tmp/gpu-pack-bin
pack() { tar -czf "$out/profile-decode.tar.gz" -C "$work" . 2>/dev/null; }
ncu --version | tail -1

# (1) the kernel at batch BATCH, context CONTEXT (bf16, Hq 32 / Hkv 8, D 128), contiguous and paged.
for impl in contiguous paged; do
  echo "::: ncu flash_decode, $impl"
  timeout 150 ncu -k regex:'[Ff]lash_?[Dd]ecode' --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis \
    "$bin/decode.bench" --runtimes cuda --dtypes bf16 --batches "${BATCH:-8}" \
    --contexts "${CONTEXT:-32768}" --passes 1 --impls "$impl" --out "$work/bench-$impl" \
    >"$work/ncu-decode-$impl.txt" 2>&1
  echo "::: exit $?"
  grep -E 'Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Stall|L1/TEX Hit|Waves Per SM|Grid Size|Shared Memory Configuration Size' \
    "$work/ncu-decode-$impl.txt" | head -40
  pack
done

# (2) every kernel's device time through the GPT example's paged decoding (d 512, 4 layers,
# 8 heads, bf16, 4096 tokens of context, TOKENS tokens), in launch order.
echo "::: ncu, every kernel of gpt decode --caches paged"
timeout 300 ncu --metrics gpu__time_duration.sum --csv --print-units base \
  "$bin/gpt.example" --runtime cuda --dtype bf16 --d-model 512 --layers 4 --heads 8 \
  --out "$work/gpt" decode --context 4096 --tokens "${TOKENS:-4}" --caches paged \
  >"$work/ncu-gpt-decode.csv" 2>"$work/ncu-gpt-decode.err"
echo "::: exit $?: $(grep -c gpu__time_duration "$work/ncu-gpt-decode.csv") kernels"
grep '^gpt decode' "$work/ncu-gpt-decode.err" "$work/ncu-gpt-decode.csv" | head -3
pack
echo "::: done in $SECONDS s"
