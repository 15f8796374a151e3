//! Peak device memory of the attention forward and of a training step (forward + backward under
//! `Autodiff`), in its own test binary (its own process): the
//! measurement ([`common::peak_memory`]) puts the process's memory pools in cubecl's persistent
//! mode before any device starts, which no other test binary should share.

mod common;

use burn::tensor::{DType, Distribution, FloatDType, Tensor, module};
use burn_flash::attention::AttentionDims;
use burn_flash::{FlashBackend, attention, attention_backward_plan};
use common::memory_check::{check_backend, check_peak};
use common::peak_memory::use_exact_pool;

/// Memory allowed beyond inputs + output + log-sum-exp: launch metadata and alignment, far
/// below one `Sq × Sk` score matrix of the sizes below.
const SLACK: u64 = 64 << 10;

/// `(batch, heads, seq, head_dim)` of one check (`Sq = Sk`, `Dv = D`, `Hkv = Hq`).
type Dims = (usize, usize, usize, usize);

/// Checks the forward's peak memory: inputs + output + one f32 per query row + [`SLACK`].
/// `composed = true` runs Burn's `attention_fallback` instead, which holds the scores and
/// must fail the same check: the proof that the check can fail.
fn forward_peak<B: FlashBackend, R: cubecl::Runtime>(
    device: &B::Device,
    dtype: FloatDType,
    composed: bool,
    (b, h, s, d): Dims,
) where
    R::Device: From<B::Device>,
{
    let draw = || {
        Tensor::<B, 4>::random([b, h, s, d], Distribution::Uniform(-1.0, 1.0), device).cast(dtype)
    };
    let (q, k, v) = (draw(), draw(), draw());
    let options = burn::tensor::ops::AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let elem = DType::from(dtype).size() as u64;
    let inputs = 3 * (b * h * s * d) as u64 * elem;
    let outputs = (b * h * s * d) as u64 * elem + (b * h * s) as u64 * 4;
    let name = if composed { "Burn's fallback" } else { "fused" };
    let what = format!(
        "{name} {dtype:?} B{b} H{h} S{s} D{d} (inputs {} KiB + outputs {} KiB + {SLACK} B)",
        inputs >> 10,
        outputs >> 10,
    );
    let (out, _) = check_peak::<B, R, _>(device, &what, composed, inputs + outputs + SLACK, || {
        if composed {
            module::attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options)
        } else {
            attention(q.clone(), k.clone(), v.clone(), None, None, options)
        }
    });
    drop((q, k, v, out));
}

/// Small enough for a CPU (lavapipe): the fallback's f32 scores (2 MiB) are 32 × the slack.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_forward_within_inputs_plus_output() {
    use_exact_pool();
    let dims = (1, 2, 512, 64);
    check_backend::<burn::backend::Wgpu, _>(
        dims,
        &[(dims, FloatDType::F32), (dims, FloatDType::F16)],
        forward_peak::<burn::backend::Wgpu, cubecl::wgpu::WgpuRuntime>,
    );
}

/// The shape: B 4, H 16, S 16384, D 128, where the scores alone would be 32 GiB in
/// bf16; the fallback's self-check runs at S 2048 (1 GiB of f32 scores).
#[cfg(feature = "cuda")]
#[test]
fn cuda_forward_within_inputs_plus_output() {
    use_exact_pool();
    common::plan_inputs();
    let big = (4, 16, 16384, 128);
    check_backend::<burn::backend::Cuda, _>(
        (4, 16, 2048, 128),
        &[
            (big, FloatDType::BF16),
            (big, FloatDType::F16),
            ((4, 16, 4096, 128), FloatDType::F32),
        ],
        forward_peak::<burn::backend::Cuda, cubecl::cuda::CudaRuntime>,
    );
}

/// Checks a training step's peak memory (forward, then `out.backward()` under `Autodiff`):
/// inputs + output + log-sum-exp + the output's gradient (Burn's seed, ones) + the three
/// gradients + the backward plan's scratch (`δ`, one f32 per query row; the Hopper backward's
/// f32 `dQ` accumulator: `AttentionBackwardPlan::scratch_bytes`) + [`SLACK`]: nothing
/// `Sq × Sk`.
/// `composed = true` runs Burn's autodiff of `attention_fallback`, which must fail the same
/// check.
fn training_peak<B: FlashBackend, R: cubecl::Runtime>(
    device: &B::Device,
    dtype: FloatDType,
    composed: bool,
    (b, h, s, d): Dims,
) where
    R::Device: From<B::Device>,
{
    type A<B> = burn::backend::Autodiff<B>;
    let draw = || {
        Tensor::<A<B>, 4>::random([b, h, s, d], Distribution::Uniform(-1.0, 1.0), device)
            .cast(dtype)
            .require_grad()
    };
    let (q, k, v) = (draw(), draw(), draw());
    let options = burn::tensor::ops::AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let elem = DType::from(dtype).size() as u64;
    let n = (b * h * s * d) as u64 * elem;
    let rows = (b * h * s) as u64 * 4;
    // The fused backward's scratch, as its plan states it (Burn's fallback: δ's size, the bound
    // it must fail anyway).
    let dims = AttentionDims {
        batch: b,
        heads_q: h,
        heads_kv: h,
        seq_q: s,
        seq_k: s,
        head_dim: d,
        value_dim: d,
    };
    let scratch = match composed {
        true => rows,
        false => attention_backward_plan::<A<B>>(
            device,
            dims,
            dtype.into(),
            options.into(),
            false,
            false,
        )
        .expect("a fused backward")
        .expect("its plan")
        .scratch_bytes(dims) as u64,
    };
    // q, k, v; out, lse; the output's gradient; dq, dk, dv; the backward's scratch.
    let allowed = 3 * n + (n + rows) + n + 3 * n + scratch + SLACK;
    let name = if composed { "Burn's fallback" } else { "fused" };
    let what = format!("train {name} {dtype:?} B{b} H{h} S{s} D{d}");
    let (grads, _) = check_peak::<B, R, _>(device, &what, composed, allowed, || {
        let out = if composed {
            module::attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options)
        } else {
            attention(q.clone(), k.clone(), v.clone(), None, None, options)
        };
        out.backward()
    });
    drop((q, k, v, grads));
}

/// A training step on lavapipe: the fallback's f32 scores (2 MiB per saved tensor) fail, the
/// fused step stays within its inputs, outputs and gradients.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_training_step_within_inputs_outputs_and_gradients() {
    use_exact_pool();
    let dims = (1, 2, 512, 64);
    check_backend::<burn::backend::Wgpu, _>(
        dims,
        &[(dims, FloatDType::F32)],
        training_peak::<burn::backend::Wgpu, cubecl::wgpu::WgpuRuntime>,
    );
}

/// The shape for a training step: B 4, H 16, S 16384, D 128 in bf16 (the scores alone
/// would be 32 GiB); the fallback's self-check at S 2048. With the suite's plan inputs
/// (`BURN_FLASH_HOPPER`, `BURN_FLASH_AMPERE_BWD`), so that each backward's scratch is checked.
#[cfg(feature = "cuda")]
#[test]
fn cuda_training_step_within_inputs_outputs_and_gradients() {
    use_exact_pool();
    // The suite's plan inputs (`BURN_FLASH_HOPPER=off`: the Ampere backward's scratch).
    common::plan_inputs();
    check_backend::<burn::backend::Cuda, _>(
        (4, 16, 2048, 128),
        &[((4, 16, 16384, 128), FloatDType::BF16)],
        training_peak::<burn::backend::Cuda, cubecl::cuda::CudaRuntime>,
    );
}
