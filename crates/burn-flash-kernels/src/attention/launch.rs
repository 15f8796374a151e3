//! The forward's launch: shapes checked, the plan made, the kernel launched.

use cubecl::{CubeCount, CubeDim, prelude::*};

use super::options::{
    AttentionError, AttentionFeatures, AttentionKernel, AttentionOptions, AttentionPlan,
    attention_dims, broadcast_strides, check_seqs, expect_shape, rows_aligned, starts_aligned,
};
use super::plan::plan_attention;
use crate::flash::FlashTensors;
#[cfg(feature = "cuda")]
use crate::flash::forward::hopper;
use crate::flash::forward::{cmma, launch_forward, tiled};
use crate::tensor::TensorRef;

/// A tensor argument with the given strides.
fn arg<'a, R: Runtime>(t: &TensorRef<'a>, shape: &[usize], strides: &[usize]) -> TensorArg<R> {
    // SAFETY: the shape and strides describe the caller's buffer; zero strides along
    // broadcast dimensions only make every index read the same element.
    unsafe { TensorArg::from_raw_parts(t.handle.clone(), strides.into(), shape.into()) }
}

/// `out` and `lse` of attention over `q`, `k`, `v` with an optional `mask` and `bias`
/// (module docs). Returns the plan that ran; nothing is launched when an error is returned,
/// nor for an empty output.
#[allow(clippy::too_many_arguments)]
pub fn launch_attention<R: Runtime>(
    client: &ComputeClient<R>,
    q: TensorRef<'_>,
    k: TensorRef<'_>,
    v: TensorRef<'_>,
    mask: Option<TensorRef<'_>>,
    bias: Option<TensorRef<'_>>,
    slopes: Option<TensorRef<'_>>,
    sinks: Option<TensorRef<'_>>,
    seqs: Option<TensorRef<'_>>,
    out: TensorRef<'_>,
    lse: TensorRef<'_>,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<AttentionPlan, AttentionError> {
    crate::cache::ensure_linked();
    let dims = attention_dims(&q, &k, &v)?;
    if let Some(s) = &seqs {
        check_seqs(s, dims)?;
    }
    expect_shape("out", &out, &dims.out_shape())?;
    expect_shape("lse", &lse, &dims.lse_shape())?;
    if let Some(s) = &slopes {
        expect_shape("slopes", s, &[dims.heads_q])?;
    }
    if let Some(s) = &sinks {
        expect_shape("sinks", s, &[dims.heads_q])?;
    }
    let full = dims.scores_shape();
    let mask_strides = mask
        .as_ref()
        .map(|m| broadcast_strides("mask", m, full))
        .transpose()?;
    let bias_strides = bias
        .as_ref()
        .map(|b| broadcast_strides("bias", b, full))
        .transpose()?;
    let features = AttentionFeatures {
        aligned: rows_aligned(&[
            (q.shape, q.strides),
            (k.shape, k.strides),
            (v.shape, v.strides),
            (out.shape, out.strides),
        ]) && starts_aligned(&[&q, &k, &v, &out]),
        mask: mask.is_some(),
        alibi: slopes.is_some(),
        sinks: sinks.is_some(),
        varlen: seqs.is_some(),
        ..Default::default()
    }
    .with_bias(bias.as_ref().zip(bias_strides.as_deref()));
    let plan = plan_attention(client, dims, dtype, features, options)?;
    if dims.out_shape().contains(&0) {
        return Ok(plan);
    }
    if plan.kernel == AttentionKernel::SplitDecode {
        let t = crate::decode::DecodeTensors {
            q,
            k,
            v,
            paged: None,
            lengths: None,
            slopes,
            sinks,
            out,
            lse,
        };
        let decode = crate::decode::DecodePlan {
            splits: plan.cubes.0,
            rows: plan.config.block_q as usize,
            cubes: plan.cubes,
            config: plan.config,
        };
        // SAFETY: the shapes were checked above and describe the buffers.
        unsafe { crate::decode::launch_planned(client, &t, &decode, dtype, options) };
        return Ok(plan);
    }
    let Some(flash_kernel) = plan.kernel.flash_kernel() else {
        // SAFETY: the shapes were checked above and describe the buffers; the plan took the
        // Hopper kernel, so `hopper::unavailable` found nothing against this call, and
        // `aligned` includes the buffers' 16-byte starts.
        crate::launch_hand_written!(
            client,
            |cuda| unsafe {
                hopper::launch(
                    cuda,
                    &q,
                    &k,
                    &v,
                    mask.as_ref().zip(mask_strides.as_deref()),
                    bias.as_ref().zip(bias_strides.as_deref()),
                    slopes.as_ref(),
                    sinks.as_ref(),
                    seqs.as_ref(),
                    &out,
                    &lse,
                    dims,
                    dtype,
                    options,
                    &plan,
                )
            },
            Ok(plan)
        );
    };
    let count = CubeCount::Static(
        plan.cubes.0 as u32,
        plan.cubes.1 as u32,
        plan.cubes.2 as u32,
    );
    let dim = CubeDim::new_1d(plan.units);
    // An absent mask or bias is never read: `q` stands in.
    let unused = (q.shape, q.strides);
    let mask_arg = match (&mask, &mask_strides) {
        (Some(m), Some(s)) => arg::<R>(m, &full, s),
        _ => arg::<R>(&q, unused.0, unused.1),
    };
    let bias_arg = match (&bias, &bias_strides) {
        (Some(b), Some(s)) => arg::<R>(b, &full, s),
        _ => arg::<R>(&q, unused.0, unused.1),
    };
    // Absent slopes, sinks or sequences are never read: `lse` (f32) stands in.
    let per_head = |t: &Option<TensorRef<'_>>| match t {
        Some(s) => arg::<R>(s, s.shape, s.strides),
        None => arg::<R>(&lse, lse.shape, lse.strides),
    };
    let slopes_arg = per_head(&slopes);
    let sinks_arg = per_head(&sinks);
    let seqs_arg = per_head(&seqs);
    let tensors = FlashTensors {
        q: arg::<R>(&q, q.shape, q.strides),
        k: arg::<R>(&k, k.shape, k.strides),
        v: arg::<R>(&v, v.shape, v.strides),
        mask: mask_arg,
        bias: bias_arg,
        slopes: slopes_arg,
        sinks: sinks_arg,
        seqs: seqs_arg,
        out: arg::<R>(&out, out.shape, out.strides),
        lse: arg::<R>(&lse, lse.shape, lse.strides),
    };
    let rows = [
        (q.shape, q.strides),
        (k.shape, k.strides),
        (v.shape, v.strides),
        (out.shape, out.strides),
    ];
    let vector = match cmma::fragment(client, dtype, plan.config.tf32) {
        Some(f) if plan.kernel == AttentionKernel::CooperativeMatrix => {
            cmma::vector(&rows[..3], plan.config, f)
        }
        _ => tiled::vector(&rows),
    };
    // SAFETY: every index is bounds-checked against the shapes passed here, which describe the
    // caller's buffers (checked above); the matrix-unit kernel runs only on 16-byte aligned
    // rows (`rows_aligned`), its vector width; `vector` divides the rows and strides of `q`,
    // `k`, `v` and `out` (`tiled::vector`).
    unsafe {
        launch_forward(
            client,
            flash_kernel,
            count,
            dim,
            vector,
            tensors,
            options.scalars(),
            plan.config,
            dtype,
        );
    }
    Ok(plan)
}
