//! Fused attention backward: `dQ`, `dK`, `dV` (and `dS`, what a bias's gradient is made of)
//! from the forward's inputs, its output and row log-sum-exp, and the output gradient, without
//! anything of size `Sq × Sk` but the optional `dS`. The kernels are
//! [`crate::flash::backward`]'s; this is their plan and launch.

use cubecl::{CubeCount, CubeDim, prelude::*, server::Handle};

use super::{
    AttentionDims, AttentionError, AttentionOptions, MAX_HEAD_DIM, attention_dims,
    broadcast_strides, expect_shape,
};
use crate::flash::{FlashConfig, ScoreSource, backward};
use crate::softmax::TensorRef;

/// The kernels of a backward launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionBackwardKernel {
    /// Plain units, every runtime and float type, f32 arithmetic:
    /// [`backward::flash_delta()`], then [`backward::flash_backward_dkv()`] (one cube per key
    /// block, looping over the query rows of the group) and [`backward::flash_backward_dq()`]
    /// (one cube per block of query rows, looping over the keys they see).
    Units,
}

/// The backward launch [`plan_attention_backward`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionBackwardPlan {
    /// The kernels that run.
    pub kernel: AttentionBackwardKernel,
    /// Query rows per block.
    pub block_rows: usize,
    /// Keys per block.
    pub block_keys: usize,
    /// Head dim the kernels are compiled for (`D` rounded up).
    pub head_dim: usize,
    /// Value head dim the kernels are compiled for (`Dv` rounded up).
    pub value_dim: usize,
    /// Cubes of the `dK`/`dV` kernel: (key blocks, and `B·Hkv` folded over y and z).
    pub dkv_cubes: (usize, usize, usize),
    /// Cubes of the `dQ` kernel: (row blocks of `G·Sq`, and `B·Hkv` folded over y and z).
    pub dq_cubes: (usize, usize, usize),
}

/// `B·Hkv` over the grid's y and z axes (the kernels read `z·count_y + y`).
fn fold(pairs: usize, max_y: u32) -> (usize, usize) {
    let y = pairs.clamp(1, max_y as usize);
    (y, pairs.div_ceil(y).max(1))
}

/// The backward launch for `dims`, without launching.
pub fn plan_attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<AttentionBackwardPlan, AttentionError> {
    // The forward's plan checks dtype, heads, head dims and options the same way.
    super::plan_attention(
        client,
        dims,
        dtype,
        false,
        &AttentionOptions {
            kernel: None,
            block_k: None,
            ..*options
        },
    )?;
    let AttentionDims {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
    } = dims;
    debug_assert!(head_dim <= MAX_HEAD_DIM && value_dim <= MAX_HEAD_DIM);
    let hw = &client.properties().hardware;
    if hw.max_units_per_cube < backward::UNITS || hw.max_shared_memory_size < backward::SHARED_BYTES
    {
        return Err(AttentionError::KernelUnavailable {
            kernel: super::AttentionKernel::Units,
            reason: format!(
                "the backward needs {} units and {} B of shared memory per cube",
                backward::UNITS,
                backward::SHARED_BYTES
            ),
        });
    }
    let (mx, my, mz) = hw.max_cube_count;
    let (y, z) = fold(batch * heads_kv, my);
    let rows = heads_q / heads_kv * seq_q;
    let dkv_cubes = (seq_k.div_ceil(backward::BLOCK_KEYS as usize), y, z);
    let dq_cubes = (rows.div_ceil(backward::BLOCK_ROWS as usize), y, z);
    for cubes in [dkv_cubes, dq_cubes] {
        if cubes.0 > mx as usize || cubes.2 > mz as usize {
            return Err(AttentionError::TooLarge { cubes });
        }
    }
    Ok(AttentionBackwardPlan {
        kernel: AttentionBackwardKernel::Units,
        block_rows: backward::BLOCK_ROWS as usize,
        block_keys: backward::BLOCK_KEYS as usize,
        head_dim: head_dim.next_multiple_of(backward::CHUNK as usize),
        value_dim: value_dim.next_multiple_of(backward::CHUNK as usize),
        dkv_cubes,
        dq_cubes,
    })
}

/// The tensors of a backward launch.
pub struct BackwardTensors<'a> {
    /// The forward's queries `[B, Hq, Sq, D]`.
    pub q: TensorRef<'a>,
    /// Keys `[B, Hkv, Sk, D]`.
    pub k: TensorRef<'a>,
    /// Values `[B, Hkv, Sk, Dv]`.
    pub v: TensorRef<'a>,
    /// The forward's mask (1 = masked out, in the element type), broadcasting.
    pub mask: Option<TensorRef<'a>>,
    /// The forward's bias, broadcasting.
    pub bias: Option<TensorRef<'a>>,
    /// The forward's output `[B, Hq, Sq, Dv]`.
    pub out: TensorRef<'a>,
    /// The forward's row log-sum-exp `[B, Hq, Sq]`, f32.
    pub lse: TensorRef<'a>,
    /// The output's gradient `[B, Hq, Sq, Dv]`.
    pub d_out: TensorRef<'a>,
    /// `dQ` (written), `q`'s shape.
    pub dq: TensorRef<'a>,
    /// `dK` (written), `k`'s shape.
    pub dk: TensorRef<'a>,
    /// `dV` (written), `v`'s shape.
    pub dv: TensorRef<'a>,
    /// Where given, `dS` (written) `[B, Hq, Sq, Sk]`: the gradient of every score, which a
    /// bias's gradient sums over its broadcast dimensions.
    pub ds: Option<TensorRef<'a>>,
}

/// A tensor argument with the given strides.
fn arg<R: Runtime>(t: &TensorRef<'_>, shape: &[usize], strides: &[usize]) -> TensorArg<R> {
    // SAFETY: the shape and strides describe the caller's buffer; zero strides along
    // broadcast dimensions only make every index read the same element.
    unsafe { TensorArg::from_raw_parts(t.handle.clone(), strides.into(), shape.into()) }
}

fn plain<R: Runtime>(t: &TensorRef<'_>) -> TensorArg<R> {
    arg(t, t.shape, t.strides)
}

/// Writes the gradients of [`super::launch_attention`] (same `options`) into `t.dq`, `t.dk`,
/// `t.dv` (and `t.ds`). Returns the plan that ran; nothing is launched when an error is
/// returned. Needs one f32 per query row of scratch (`δ`).
pub fn launch_attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    t: BackwardTensors<'_>,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<AttentionBackwardPlan, AttentionError> {
    let dims = attention_dims(&t.q, &t.k, &t.v)?;
    let AttentionDims {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        value_dim,
        ..
    } = dims;
    let out_shape = [batch, heads_q, seq_q, value_dim];
    expect_shape("out", &t.out, &out_shape)?;
    expect_shape("d_out", &t.d_out, &out_shape)?;
    expect_shape("lse", &t.lse, &[batch, heads_q, seq_q])?;
    expect_shape("dq", &t.dq, t.q.shape)?;
    expect_shape("dk", &t.dk, t.k.shape)?;
    expect_shape("dv", &t.dv, t.v.shape)?;
    let full = [batch, heads_q, seq_q, seq_k];
    if let Some(ds) = &t.ds {
        expect_shape("ds", ds, &full)?;
    }
    let mask_strides = t
        .mask
        .as_ref()
        .map(|m| broadcast_strides("mask", m, full))
        .transpose()?;
    let bias_strides = t
        .bias
        .as_ref()
        .map(|b| broadcast_strides("bias", b, full))
        .transpose()?;
    let plan = plan_attention_backward(client, dims, dtype, options)?;
    let pairs = batch * heads_kv;
    let rows = pairs * (heads_q / heads_kv) * seq_q;
    if pairs == 0 {
        return Ok(plan);
    }
    let config = FlashConfig {
        source: ScoreSource::QueryKey,
        block_q: backward::BLOCK_ROWS,
        row_tiles: 1,
        block_k: backward::BLOCK_KEYS,
        head_dim: plan.head_dim as u32,
        value_dim: plan.value_dim as u32,
        causal: options.causal,
        mask: t.mask.is_some(),
        bias: t.bias.is_some(),
        softcap: options.softcap.is_some(),
        dropout: options.dropout.is_some(),
    };
    let delta: Handle = client.empty(rows.max(1) * 4);
    let delta_shape = [rows.max(1)];
    let delta_strides = [1];
    let delta_ref = TensorRef {
        handle: &delta,
        shape: &delta_shape,
        strides: &delta_strides,
    };
    let delta_cubes = rows.div_ceil(backward::DELTA_ROWS as usize).max(1);
    let delta_x = delta_cubes.min(65535);
    let (q_shape, q_strides) = (t.q.shape, t.q.strides);
    let mask_arg = || match (&t.mask, &mask_strides) {
        (Some(m), Some(s)) => arg::<R>(m, &full, s),
        _ => arg::<R>(&t.q, q_shape, q_strides),
    };
    let bias_arg = || match (&t.bias, &bias_strides) {
        (Some(b), Some(s)) => arg::<R>(b, &full, s),
        _ => arg::<R>(&t.q, q_shape, q_strides),
    };
    let count = |c: (usize, usize, usize)| CubeCount::Static(c.0 as u32, c.1 as u32, c.2 as u32);
    let units = CubeDim::new_1d(backward::UNITS);
    let scale = options.scale;
    let softcap = options.softcap.unwrap_or(1.0);
    let drop = options
        .dropout
        .unwrap_or(crate::dropout::DropoutParams::new(0.0, 0));
    // SAFETY: every index is bounds-checked against the shapes passed here, which describe the
    // caller's buffers (checked above) and the `delta` scratch; an absent mask, bias or `ds`
    // is never read or written (`q` or `dq` stands in).
    unsafe {
        if rows > 0 {
            backward::flash_delta::launch_unchecked::<R>(
                client,
                CubeCount::Static(delta_x as u32, delta_cubes.div_ceil(delta_x) as u32, 1),
                CubeDim::new_1d(32 * backward::DELTA_ROWS),
                plain(&t.d_out),
                plain(&t.out),
                plain(&delta_ref),
                dtype,
            );
        }
        if seq_k > 0 {
            backward::flash_backward_dkv::launch_unchecked::<R>(
                client,
                count(plan.dkv_cubes),
                units,
                plain(&t.q),
                plain(&t.k),
                plain(&t.v),
                mask_arg(),
                bias_arg(),
                plain(&t.d_out),
                plain(&t.lse),
                plain(&delta_ref),
                plain(&t.dk),
                plain(&t.dv),
                scale,
                softcap,
                drop.seed_lo,
                drop.seed_hi,
                drop.threshold,
                drop.inv_keep(),
                config,
                dtype,
            );
        }
        if rows > 0 {
            let ds = t.ds.as_ref().unwrap_or(&t.dq);
            backward::flash_backward_dq::launch_unchecked::<R>(
                client,
                count(plan.dq_cubes),
                units,
                plain(&t.q),
                plain(&t.k),
                plain(&t.v),
                mask_arg(),
                bias_arg(),
                plain(&t.d_out),
                plain(&t.lse),
                plain(&delta_ref),
                plain(&t.dq),
                plain(ds),
                scale,
                softcap,
                drop.seed_lo,
                drop.seed_hi,
                drop.threshold,
                drop.inv_keep(),
                config,
                t.ds.is_some(),
                dtype,
            );
        }
    }
    Ok(plan)
}
