#!/usr/bin/env bash
# The mutation check on the GPU machine: each deliberate kernel bug (`BURN_FLASH_MUTATION`, see
# `crates/burn-flash-kernels/src/mutation.rs`) against the CUDA tests that must catch it, one
# process per (mutation, test), JOBS at a time. A mutation is caught when at least one of its
# tests fails; the script exits non-zero if any mutation survives.
#
# Usage, from the project root on the GPU machine, after `../shared/tools/gpu-pack --features
# cuda,mutants --test softmax_family --test softmax_matmul --test attention --test
# attention_backward --test nn` here (the `dq-*`, `kv-early` and `zero-dq` cases, mutations of
# the Hopper backward, also run the kernels crate's `hopper_backward` test: `-p burn-flash -p
# burn-flash-kernels ... --test hopper_backward`):
#   benches/mutations.sh [JOBS]
# `ONLY=REGEX` keeps the cases whose whole mutation name matches (`ONLY='paged-lookup|drop-split'`),
# so that a call after a change to a few kernels runs their mutations beside the CUDA suite.
# Every line (CAUGHT/PASS per test, then a verdict per mutation) goes to $OUT/mutations.txt.
# Lines arrive in $OUT/mutations-progress.txt as each case ends (a call cut by its time guard
# keeps what finished).
# The CUDA check's own mutations (forced-spill, register-budget, hopper-syntax,
# uncounted-barriers) run on the CPU: `cargo xtask cuda-check --mutations`.
set -uo pipefail
jobs=${1:-14}
.gpu/run ls >/dev/null # unpacks the binaries once
bin=/tmp/gpu-pack-bin
summary=${OUT:-/tmp}/mutations.txt
mkdir -p "${OUT:-/tmp}" # a caller may point OUT at a subfolder of its own
# mutation, test binary, exact test name, and optionally VAR=value settings for the test's
# process, comma-separated (on an H100/H200 the plan gives 16-bit calls to the Hopper kernels:
# the `mma.sync` kernels' mutations are caught with BURN_FLASH_HOPPER=off, and where the Ampere
# backward would take the call, BURN_FLASH_AMPERE_BWD=off as well)
cases=$(cat <<'EOF'
zero-dx softmax_matmul.test cuda::f32::gradients
zero-dx softmax_matmul.test cuda::bf16::gradients
zero-dx softmax_family.test cuda::f32::gradients_every_tier
drop-delta softmax_matmul.test cuda::bf16::gradients
drop-delta softmax_family.test cuda::f32::gradients_every_tier
drop-delta attention_backward.test cuda::f32::shapes_and_options
no-rescale softmax_matmul.test cuda::f16::large_magnitudes
no-rescale softmax_matmul.test cuda::fused_f32::tiled_units
no-rescale softmax_family.test cuda::fused_f32::forced_tiers_agree
no-rescale attention.test cuda::bf16::causal
causal-top-left attention.test cuda::f32::causal
causal-top-left attention_backward.test cuda::bf16::causal
zero-dq attention_backward.test cuda::f32::shapes_and_options
zero-dq attention_backward.test cuda::bf16::shapes_and_options
gqa-modulo attention_backward.test cuda::f32::grouped_query_heads
gqa-modulo attention_backward.test cuda::bf16::grouped_query_heads
dropout-fresh-mask attention_backward.test cuda::f32::dropout_gradients
dropout-fresh-mask attention_backward.test cuda::bf16::dropout_gradients
fill-grad attention_backward.test cuda::f32::masked_score_and_quiet
fill-grad attention_backward.test cuda::bf16::masked_score_and_quiet
quiet-off attention.test cuda::f32::masked_score_and_quiet
quiet-off attention.test cuda::bf16::masked_score_and_quiet
stage-head-start softmax_matmul.test cuda::bf16::gradients
stage-head-start softmax_matmul.test cuda::wide_dx_rows
stage-head-start attention_backward.test cuda::bf16::causal
dx-narrow-blocks softmax_matmul.test cuda::wide_dx_rows
dx-narrow-blocks softmax_matmul.test cuda::bf16::gradients
dx-narrow-blocks softmax_matmul.test cuda::wide_dx_rows BURN_FLASH_HOPPER=off
stage-head-start attention_backward.test cuda::bf16::causal BURN_FLASH_HOPPER=off,BURN_FLASH_AMPERE_BWD=off
fill-grad attention_backward.test cuda::bf16::masked_score_and_quiet BURN_FLASH_HOPPER=off
no-rescale attention.test cuda::f16::cooperative_matrix_kernel
keep-fragments attention.test cuda::f16::cooperative_matrix_kernel
keep-fragments attention.test cuda::bf16::cooperative_matrix_kernel
zero-dk attention_backward.test cuda::f16::cooperative_backward
zero-dk attention_backward.test cuda::bf16::cooperative_backward
keep-fragments attention.test cuda::f32::tf32_products
zero-dk attention_backward.test cuda::f32::tf32_training
ds-skipped-rows attention_backward.test cuda::bf16::hopper_tracked_bias
ds-skipped-rows attention_backward.test cuda::f16::hopper_tracked_bias
window-right attention.test cuda::bf16::windows_and_alibi
window-right attention_backward.test cuda::bf16::windows_and_alibi
window-right attention_backward.test cuda::bf16::windows_and_alibi BURN_FLASH_HOPPER=always
window-right attention_backward.test cuda::f16::windows_and_alibi BURN_FLASH_HOPPER=off
quiet-off attention.test cuda::bf16::attention_sinks
varlen-first-row attention.test cuda::bf16::varlen BURN_FLASH_HOPPER=always
varlen-first-row attention.test cuda::bf16::varlen BURN_FLASH_HOPPER=off
varlen-first-row attention.test cuda::f32::varlen
varlen-first-row attention_backward.test cuda::bf16::varlen BURN_FLASH_HOPPER=always
varlen-first-row attention_backward.test cuda::bf16::varlen BURN_FLASH_HOPPER=off
paged-lookup attention.test cuda::bf16::paged
paged-lookup attention.test cuda::f32::paged
drop-split attention.test cuda::bf16::split_decode
drop-split attention.test cuda::f32::split_decode
biased-norm nn.test cuda::bf16::fused_layer_norm
biased-norm nn.test cuda::f32::fused_layer_norm
skip-k-lane nn.test cuda::bf16::fused_linear
skip-k-lane nn.test cuda::f32::fused_linear
dq-skip-tile attention_backward.test cuda::bf16::shapes_and_options
dq-skip-tile hopper_backward.test hopper_backward_matches_f64
dq-skip-tile hopper_backward.test hopper_causal_backward_matches_f64
dq-bulk-no-wait hopper_backward.test hopper_backward_matches_f64
dq-bulk-no-wait hopper_backward.test hopper_causal_backward_matches_f64
dq-unordered hopper_backward.test hopper_deterministic_backward_bits
bias-block attention.test cuda::bf16::bias_tiles
bias-block attention.test cuda::f16::bias_tiles
bias-block-bwd attention_backward.test cuda::bf16::hopper_bias_tiles
bias-block-bwd attention_backward.test cuda::f16::hopper_bias_tiles
dq-unordered attention_backward.test cuda::bf16::deterministic_backward
q-early attention.test cuda::bf16::tile_schedules
q-early attention.test cuda::f16::tile_schedules
hopper-no-wait attention.test cuda::bf16::tile_schedules
tile-skip attention.test cuda::bf16::tile_schedules
tile-skip attention.test cuda::f16::tile_schedules
defer-wrong-buffer attention_backward.test cuda::bf16::backward_overlaps
kv-early hopper_backward.test hopper_persistent_backward
zero-dq hopper_backward.test hopper_backward_row_layouts
zero-dk hopper_backward.test ampere_backward_matches_f64
ds-store-skipped hopper_backward.test ampere_backward_matches_f64
warp-cols hopper_backward.test ampere_backward_matches_f64
causal-top-left hopper_backward.test ampere_backward_matches_f64
gqa-modulo hopper_backward.test ampere_backward_matches_f64
fill-grad attention_backward.test cuda::bf16::ampere_backward_rules
dropout-fresh-mask attention_backward.test cuda::f16::ampere_backward_rules
ds-tile-rows attention_backward.test cuda::bf16::ampere_backward_rules
ds-skipped-rows attention_backward.test cuda::f16::ampere_backward_rules
window-right attention_backward.test cuda::bf16::ampere_backward_rules
zero-dx softmax_matmul.test cuda::ampere_gradients
drop-delta softmax_matmul.test cuda::ampere_gradients
warp-cols softmax_matmul.test cuda::ampere_gradients
EOF
)
[ -z "${ONLY:-}" ] || cases=$(echo "$cases" | awk -v re="^(${ONLY})$" '$1 ~ re')
echo "mutations: $(echo "$cases" | wc -l) cases, $jobs at a time"
logs=/tmp/mutations
rm -rf "$logs" && mkdir -p "$logs"
# A test that fails under its mutation has caught it (CAUGHT); one that passes has not (PASS);
# one whose binary was not staged did not run (MISSING); one that panicked because a Hopper
# mutation's site is not in its source (`hopper::mutated`) tested nothing (NOSITE).
echo "$cases" | xargs -P "$jobs" -L 1 bash -c '
  m=$0; b=$1; t=$2; log="'"$logs"'/$m-${b%.test}-${t//::/-}-${3:-plan}.log"
  [ -x "'"$bin"'/$b" ] || { echo "MISSING $m $b $t ${3:-}"; exit 0; }
  if env ${3:+${3//,/ }} BURN_FLASH_MUTATION=$m timeout 480 "'"$bin"'/$b" "$t" --exact --test-threads=1 >"$log" 2>&1
  then echo "PASS $m $b $t ${3:-}"
  elif grep -q "mutation site .* is missing" "$log"; then echo "NOSITE $m $b $t ${3:-}"
  else echo "CAUGHT $m $b $t ${3:-}"; fi
' | tee "${summary%.txt}-progress.txt" | sort | tee "$summary"
survivors=0
for m in $(echo "$cases" | cut -d' ' -f1 | sort -u); do
  if grep -q "^CAUGHT $m " "$summary"; then
    echo "mutation $m: caught by $(grep -c "^CAUGHT $m " "$summary") of $(grep -c " $m " "$summary") tests"
  elif grep -q "^NOSITE $m " "$summary"; then
    echo "mutation $m: SITE MISSING (the kernel moved; update its site in the launch)"
    survivors=$((survivors + 1))
  elif ! grep -q "^PASS $m " "$summary"; then
    echo "mutation $m: not run (no staged binary)"
  else
    echo "mutation $m: SURVIVED"
    survivors=$((survivors + 1))
  fi
done | tee -a "$summary"
tar -czf "${OUT:-/tmp}/mutation-logs.tar.gz" -C /tmp mutations
[ "$survivors" -eq 0 ]
