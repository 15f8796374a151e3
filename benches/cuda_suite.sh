#!/usr/bin/env bash
# The CUDA test suite on the GPU machine, one process per test.
#
# Most of a CUDA test's time is NVRTC compiling its kernel variants, and one process compiles
# one kernel at a time whatever `--test-threads` says (the runtime's client serialises its
# launches). One process per test lets those compiles run on every core.
#
# Usage, from the project root on the GPU machine, after `../shared/tools/gpu-pack --features
# cuda --test NAME ...` here:
#   benches/cuda_suite.sh [JOBS] [BINARY.test ...]     # default: 14 jobs, every staged test
# The summary (PASS/FAIL, seconds, test) goes to $OUT/cuda-suite.txt, every test's log to
# $OUT/cuda-suite-logs.tar.gz (the device tool brings back few files).
# Exits non-zero if any test failed or did not finish. `SUITE_PREFIX=wgpu::` runs the wgpu
# tests instead (Vulkan on the GPU machine); `TEST_TIMEOUT` (seconds, default 480) bounds each;
# `SUITE_LOGS` names the logs' folder (default /tmp/cuda-suite; suites run side by side need one each).
set -uo pipefail
jobs=${1:-14}
shift || true
.gpu/run ls >/dev/null # unpacks the binaries once
bin=/tmp/gpu-pack-bin
out=${SUITE_LOGS:-/tmp/cuda-suite} # two suites at once need two folders
summary=${OUT:-/tmp}/cuda-suite.txt
mkdir -p "${OUT:-/tmp}" # a caller may point OUT at a subfolder of its own
rm -rf "$out" && mkdir -p "$out"
binaries=("$@")
[ ${#binaries[@]} -gt 0 ] || mapfile -t binaries < <(cd "$bin" && ls -- *.test)
list=$(mktemp)
for b in "${binaries[@]}"; do
  "$bin/$b" --list 2>/dev/null | sed -n "s/^\(${SUITE_PREFIX:-cuda::}.*\): test\$/\1/p" |
    sed "s|^|$b |" >>"$list"
done
echo "cuda_suite: $(wc -l <"$list") tests, $jobs at a time"
start=$SECONDS
# Each line: binary, test name. A test prints PASS or FAIL with its time.
xargs -P "$jobs" -L 1 bash -c '
  b=$0; t=$1; log="'"$out"'/${b%.test}-${t//::/-}.log"; s=$SECONDS
  if timeout '"${TEST_TIMEOUT:-480}"' "'"$bin"'/$b" "$t" --exact --test-threads=1 >"$log" 2>&1; then r=PASS; else r=FAIL; fi
  echo "$r $((SECONDS - s))s $b $t"
' <"$list" | tee "$summary"
tar -czf "${OUT:-/tmp}/cuda-suite-logs.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
fails=$(grep -c '^FAIL' "$summary")
total=$(wc -l <"$list")
done_=$(wc -l <"$summary")
echo "cuda_suite: $((done_ - fails)) passed, $fails failed, $((total - done_)) not run, $((SECONDS - start)) s" |
  tee -a "$summary"
[ "$fails" -eq 0 ] && [ "$done_" -eq "$total" ]
