#!/usr/bin/env bash
# The correctness check of the hand-written Ampere kernels (sm80.cu's score rules, sm80_given.cu's
# softmax·V backward) on the GPU machine, one device call: their tests (each must run a test:
# a missing name is reported, not passed), compute-sanitizer memcheck / racecheck / synccheck
# on them, the 16-bit attention_backward and softmax_matmul suites with the kernels forced
# (`BURN_FLASH_AMPERE_BWD=always BURN_FLASH_HOPPER=off`), then the mutations with sites in them.
#
# Usage, from the project root on the GPU machine, after `../shared/tools/gpu-pack -p burn-flash
# -p burn-flash-kernels --features burn-flash/cuda,burn-flash/mutants --test attention_backward
# --test softmax_matmul --test hopper_backward` (or a pack with more) here:
#   BUDGET=SECONDS benches/ampere_check.sh       # default 570: stops what is left at the end
# One line per run in $OUT/c1-log.txt (exit status, seconds, the test summary, the sanitizer's),
# the forced suites under $OUT/always, the mutations under $OUT/mut, every log in
# $OUT/c1-logs.tar.gz.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
mkdir -p "$OUT" /tmp/c1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/c1-log.txt"
.gpu/run ls >/dev/null
b=/tmp/gpu-pack-bin
ls $b >> "$OUT/c1-log.txt"
log() { echo "[$SECONDS s] $*" >> "$OUT/c1-log.txt"; }
run1() { # name, timeout, command... (PASS needs a test that ran)
  local n=$1 t=$2; shift 2; local s=$SECONDS
  timeout "$t" "$@" > "/tmp/c1/$n.log" 2>&1; local rc=$?
  local ran=$(grep -o 'test result: [a-zA-Z]*\. [0-9]* passed; [0-9]* failed' "/tmp/c1/$n.log" | tail -1)
  local err=$(grep -o 'ERROR SUMMARY: [0-9]* error\|RACECHECK SUMMARY: [0-9]* hazard[^,]*' "/tmp/c1/$n.log" | tail -1)
  log "rc=$rc $n $((SECONDS-s)) s | $ran | $err"
}
run1 smm-ampere 400 $b/softmax_matmul.test cuda::ampere_gradients --exact --test-threads=1 &
p0=$!
run1 rules-f16 300 $b/attention_backward.test cuda::f16::ampere_backward_rules --exact --test-threads=1 &
p1=$!
run1 rules-bf16 300 $b/attention_backward.test cuda::bf16::ampere_backward_rules --exact --test-threads=1 &
p2=$!
run1 hopper-bwd-ampere 400 $b/hopper_backward.test ampere --test-threads=1 &
p3=$!
for tool in memcheck racecheck synccheck; do
  run1 san-rules-$tool 500 compute-sanitizer --tool $tool --kernel-name kns=burn_flash_sm80_backward --print-limit 20 \
    $b/attention_backward.test cuda::bf16::ampere_backward_rules --exact --test-threads=1 &
  run1 san-smm-$tool 500 compute-sanitizer --tool $tool --kernel-name kns=burn_flash_sm80_smm --print-limit 20 \
    $b/softmax_matmul.test cuda::ampere_gradients --exact --test-threads=1 &
done
( BURN_FLASH_AMPERE_BWD=always BURN_FLASH_HOPPER=off SUITE_PREFIX='cuda::\(f16\|bf16\)::' \
  SUITE_LOGS=/tmp/suite-always OUT=$OUT/always TEST_TIMEOUT=300 benches/cuda_suite.sh 4 attention_backward.test softmax_matmul.test \
  > /tmp/c1/always.log 2>&1; log "always suite rc $?" ) &
wait $p0 $p1 $p2 $p3
log "tests done"
( ONLY='fill-grad|dropout-fresh-mask|ds-tile-rows|ds-skipped-rows|window-right|zero-dk|ds-store-skipped|warp-cols|zero-dx|drop-delta' \
  OUT=$OUT/mut timeout $((END - SECONDS - 20)) benches/mutations.sh 4 > /tmp/c1/mut.log 2>&1; log "mutations rc $?" ) &
while [ $SECONDS -lt $((END - 15)) ] && jobs -r | grep -q .; do sleep 3; done
log "end; still running: $(jobs -r | wc -l)"
tar -czf "$OUT/c1-logs.tar.gz" -C /tmp c1 mutations 2>/dev/null
