//! Fused attention backward: `dQ`, `dK`, `dV` (and `dS`, what a bias's gradient is made of)
//! from the forward's inputs, its output and row log-sum-exp, and the output gradient, without
//! anything of size `Sq × Sk` but the optional `dS`. The kernels are
//! [`crate::flash::backward`]'s; this is their plan and launch.

use cubecl::prelude::*;

use super::{
    AttentionDims, AttentionError, AttentionOptions, MAX_HEAD_DIM, attention_dims,
    broadcast_strides, expect_shape,
};
use crate::flash::{FlashConfig, ScoreSource, backward, mma_backward};
use crate::softmax::TensorRef;

/// The kernels of a backward launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionBackwardKernel {
    /// Plain units, every runtime and float type, f32 arithmetic:
    /// [`backward::flash_delta()`], then [`backward::flash_backward_dkv()`] (one cube per key
    /// block, looping over the query rows of the group) and [`backward::flash_backward_dq()`]
    /// (one cube per block of query rows, looping over the keys they see).
    Units,
    /// The matrix units (f16/bf16 on CUDA sm_80+, 16-byte aligned rows):
    /// [`backward::flash_delta()`], [`mma_backward::flash_backward_dkv_mma()`] and
    /// [`mma_backward::flash_backward_dq_mma()`] (which also writes `dS` for a tracked bias).
    /// Computed scores with scale, softcap, masks, biases, causal, grouped heads and dropout,
    /// `D`, `Dv` up to [`mma_backward::MAX_DIM`].
    MatrixUnits,
    /// The matrix units with `dQ` fused into the dK/dV kernel (FlashAttention-2's schedule):
    /// [`backward::flash_delta()`], [`mma_backward::flash_backward_dkv_mma()`] adding each
    /// step's `dS·K` to an f32 `dQ` with atomics (zeroed and converted by
    /// [`mma_backward::flash_dq_accum()`]). Five products instead of seven, an f32 scratch of
    /// `dQ`'s size. Opt-in (`BURN_FLASH_BACKWARD_DQ=fused`): slower than
    /// [`AttentionBackwardKernel::MatrixUnits`] on an H100 (NOTES.md, session 12: the atomics).
    /// The scope of [`AttentionBackwardKernel::MatrixUnits`] without a mask, bias or dropout, where
    /// [`mma_backward::dq_split()`] splits a step's `dQ` tile evenly over the planes.
    MatrixUnitsFusedDq,
}

/// The `dQ` schedule of the matrix-unit backward, from `BURN_FLASH_BACKWARD_DQ`: `fused`
/// (atomics from the dK/dV kernel, where it applies) or anything else, the default: its own
/// kernel, the faster one measured. A switch for benchmarks and tests of both schedules.
fn fused_dq_wanted() -> bool {
    // Read once: the plan runs on every backward call.
    static FUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FUSED.get_or_init(|| std::env::var("BURN_FLASH_BACKWARD_DQ").is_ok_and(|v| v == "fused"))
}

/// Backward launches kept by [`recent_backward_launches`].
const RECORDED: usize = 64;

/// The last [`RECORDED`] backward launches of this process, oldest first.
static LAUNCHES: std::sync::Mutex<std::collections::VecDeque<BackwardLaunch>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());

/// One backward launch as [`launch_attention_backward`] made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardLaunch {
    /// The call's sizes.
    pub dims: AttentionDims,
    /// The kernels that were launched.
    pub kernel: AttentionBackwardKernel,
    /// Whether a mask was read.
    pub mask: bool,
    /// Whether `dS` (a tracked bias's gradient) was written.
    pub ds: bool,
}

/// The most recent backward launches of this process (at most 64, oldest first), as they
/// were enqueued, on any runtime: which kernels took a call, observed rather than planned.
pub fn recent_backward_launches() -> Vec<BackwardLaunch> {
    let log = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    log.iter().copied().collect()
}

fn record_launch(launch: BackwardLaunch) {
    let mut log = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    if log.len() == RECORDED {
        log.pop_front();
    }
    log.push_back(launch);
}

/// What of a call beyond its sizes the backward plan depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackwardFeatures {
    /// `q`, `k`, `v` and `dO` rows are 16-byte aligned ([`super::rows_aligned`]).
    pub aligned: bool,
    /// A mask is given.
    pub mask: bool,
    /// A bias is given.
    pub bias: bool,
}

/// The backward launch [`plan_attention_backward`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionBackwardPlan {
    /// The kernels that run.
    pub kernel: AttentionBackwardKernel,
    /// Query rows per cube of the `dQ` kernel.
    pub block_rows: usize,
    /// Keys per cube of the `dK`/`dV` kernel.
    pub block_keys: usize,
    /// Keys per step of the `dQ` kernel (query rows per step of the `dK`/`dV` kernel: the
    /// same on the matrix units, [`backward::STEP_ROWS`] on plain units).
    pub step: usize,
    /// Head dim the kernels are compiled for (`D` rounded up).
    pub head_dim: usize,
    /// Value head dim the kernels are compiled for (`Dv` rounded up).
    pub value_dim: usize,
    /// Cubes of the `dK`/`dV` kernel: (key blocks — times column tiles on plain units — and
    /// `B·Hkv` folded over y and z).
    pub dkv_cubes: (usize, usize, usize),
    /// Cubes of the `dQ` kernel: (row blocks of `G·Sq`, and `B·Hkv` folded over y and z).
    pub dq_cubes: (usize, usize, usize),
}

/// The backward launch for `dims`, without launching: the matrix units where
/// [`AttentionBackwardKernel::MatrixUnits`] takes the call, else plain units.
pub fn plan_attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: BackwardFeatures,
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
    let (y, z) = backward::fold_pairs(batch * heads_kv, my);
    let rows = heads_q / heads_kv * seq_q;
    let (d16, dv16) = (
        head_dim.next_multiple_of(16) as u32,
        value_dim.next_multiple_of(16) as u32,
    );
    let mma_config = mma_config(d16, dv16, options, features);
    let fused_dq = fused_dq_wanted()
        && !features.mask
        && !features.bias
        && options.dropout.is_none()
        && mma_backward::dq_split(mma_config.block_k, d16).is_some()
        && hw.max_shared_memory_size >= mma_backward::dkv_shared_bytes(mma_config, true);
    let mma = crate::fragment::supported(client, dtype)
        && features.aligned
        && d16.max(dv16) <= mma_backward::MAX_DIM
        && hw.max_units_per_cube >= mma_backward::PLANES * crate::fragment::PLANE
        && hw.max_shared_memory_size
            >= mma_backward::dkv_shared_bytes(mma_config, false).max(
                mma_backward::dq_shared_bytes(FlashConfig {
                    block_q: mma_backward::DQ_ROWS,
                    ..mma_config
                }),
            );
    if mma {
        let dkv_cubes = (seq_k.div_ceil(mma_backward::DKV_KEYS as usize), y, z);
        let dq_cubes = if fused_dq {
            backward::row_groups_grid(batch * heads_q * seq_q)
        } else {
            (rows.div_ceil(mma_backward::DQ_ROWS as usize), y, z)
        };
        for cubes in [dkv_cubes, dq_cubes] {
            if cubes.0 > mx as usize || cubes.2 > mz as usize {
                return Err(AttentionError::TooLarge { cubes });
            }
        }
        return Ok(AttentionBackwardPlan {
            kernel: if fused_dq {
                AttentionBackwardKernel::MatrixUnitsFusedDq
            } else {
                AttentionBackwardKernel::MatrixUnits
            },
            block_rows: mma_backward::DQ_ROWS as usize,
            block_keys: mma_backward::DKV_KEYS as usize,
            step: mma_config.block_k as usize,
            head_dim: d16 as usize,
            value_dim: dv16 as usize,
            dkv_cubes,
            dq_cubes,
        });
    }
    let dkv_cubes = (
        backward::dkv_blocks(seq_k, head_dim, value_dim, false),
        y,
        z,
    );
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
        step: backward::STEP_KEYS as usize,
        head_dim: head_dim.next_multiple_of(backward::CHUNK as usize),
        value_dim: value_dim.next_multiple_of(backward::CHUNK as usize),
        dkv_cubes,
        dq_cubes,
    })
}

/// The configuration of the matrix-unit kernels (the dK/dV kernel's; the dQ kernel's has
/// `block_q` = [`mma_backward::DQ_ROWS`]): `block_q` rows (keys) per cube, `block_k` per step.
fn mma_config(
    d16: u32,
    dv16: u32,
    options: &AttentionOptions,
    features: BackwardFeatures,
) -> FlashConfig {
    FlashConfig {
        source: ScoreSource::QueryKey,
        block_q: mma_backward::DKV_KEYS,
        row_tiles: 1,
        block_k: mma_backward::step_len(d16, dv16),
        head_dim: d16,
        value_dim: dv16,
        causal: options.causal,
        mask: features.mask,
        bias: features.bias,
        softcap: options.softcap.is_some(),
        dropout: options.dropout.is_some(),
        masked_score: options.masked_score.map(f32::to_bits),
        quiet: options.quiet,
    }
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

/// Writes the gradients of [`super::launch_attention`] (same `options`) into `t.dq`, `t.dk`,
/// `t.dv` (and `t.ds`). Returns the plan that ran; nothing is launched when an error is
/// returned. Needs one f32 per query row of scratch (`δ`).
pub fn launch_attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    t: BackwardTensors<'_>,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<AttentionBackwardPlan, AttentionError> {
    crate::cache::ensure_linked();
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
    let features = BackwardFeatures {
        aligned: super::rows_aligned(&[
            (t.q.shape, t.q.strides),
            (t.k.shape, t.k.strides),
            (t.v.shape, t.v.strides),
            (t.d_out.shape, t.d_out.strides),
        ]),
        mask: t.mask.is_some(),
        bias: t.bias.is_some() || t.ds.is_some(),
    };
    let plan = plan_attention_backward(client, dims, dtype, features, options)?;
    let pairs = batch * heads_kv;
    let rows = pairs * (heads_q / heads_kv) * seq_q;
    if pairs == 0 {
        return Ok(plan);
    }
    let record = |kernel| {
        record_launch(BackwardLaunch {
            dims,
            kernel,
            mask: t.mask.is_some(),
            ds: t.ds.is_some(),
        })
    };
    let config = FlashConfig {
        source: ScoreSource::QueryKey,
        block_q: backward::BLOCK_ROWS,
        row_tiles: 1,
        block_k: backward::STEP_KEYS,
        head_dim: plan.head_dim as u32,
        value_dim: plan.value_dim as u32,
        causal: options.causal,
        mask: t.mask.is_some(),
        bias: t.bias.is_some(),
        softcap: options.softcap.is_some(),
        dropout: options.dropout.is_some(),
        masked_score: options.masked_score.map(f32::to_bits),
        quiet: options.quiet,
    };
    // Both launchers take the same dropout (none: a probability of 0, never read).
    let dropout = options
        .dropout
        .unwrap_or(crate::dropout::DropoutParams::new(0.0, 0));
    let operand = |t: &TensorRef<'_>, strides: Option<&Vec<usize>>| backward::Operand {
        handle: t.handle.clone(),
        shape: match strides {
            Some(_) => full.to_vec(),
            None => t.shape.to_vec(),
        },
        strides: strides.cloned().unwrap_or_else(|| t.strides.to_vec()),
    };
    // An absent mask, bias or `ds` is never read or written: `q` or `dq` stands in.
    let operands = backward::BackwardOperands {
        q: operand(&t.q, None),
        k: operand(&t.k, None),
        v: operand(&t.v, None),
        mask: match (&t.mask, &mask_strides) {
            (Some(m), Some(s)) => operand(m, Some(s)),
            _ => operand(&t.q, None),
        },
        bias: match (&t.bias, &bias_strides) {
            (Some(b), Some(s)) => operand(b, Some(s)),
            _ => operand(&t.q, None),
        },
        out: operand(&t.out, None),
        d_out: operand(&t.d_out, None),
        lse: operand(&t.lse, None),
        dq: operand(&t.dq, None),
        dk: operand(&t.dk, None),
        dv: operand(&t.dv, None),
        ds: operand(t.ds.as_ref().unwrap_or(&t.dq), None),
    };
    if matches!(
        plan.kernel,
        AttentionBackwardKernel::MatrixUnits | AttentionBackwardKernel::MatrixUnitsFusedDq
    ) {
        let fused = plan.kernel == AttentionBackwardKernel::MatrixUnitsFusedDq;
        let c = FlashConfig {
            bias: t.bias.is_some(),
            ..mma_config(
                plan.head_dim as u32,
                plan.value_dim as u32,
                options,
                features,
            )
        };
        // SAFETY: every index is bounds-checked against the shapes passed here, which describe
        // the caller's buffers (checked above); the rows of `q`, `k`, `v` and `dO` are 16-byte
        // aligned (`features.aligned`), the kernels' vector width; the grids are the plan's.
        unsafe {
            mma_backward::launch_backward_mma(
                client,
                &operands,
                rows,
                (seq_k > 0).then_some(plan.dkv_cubes),
                (rows > 0).then_some(plan.dq_cubes),
                options.scale,
                options.softcap.unwrap_or(1.0),
                dropout,
                c,
                mma_backward::DQ_ROWS,
                t.ds.is_some(),
                fused,
                None,
                dtype,
            );
        }
        record(plan.kernel);
        return Ok(plan);
    }
    // SAFETY: every index is bounds-checked against the shapes passed here, which describe the
    // caller's buffers (checked above); the grids are the plan's.
    unsafe {
        backward::launch_backward(
            client,
            &operands,
            rows,
            (seq_k > 0).then_some(plan.dkv_cubes),
            (rows > 0).then_some(plan.dq_cubes),
            options.scale,
            options.softcap.unwrap_or(1.0),
            dropout,
            config,
            t.ds.is_some(),
            dtype,
        );
    }
    record(AttentionBackwardKernel::Units);
    Ok(plan)
}
