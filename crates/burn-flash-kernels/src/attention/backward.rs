//! Fused attention backward: `dQ`, `dK`, `dV` (and `dS`, what a bias's gradient is made of)
//! from the forward's inputs, its output and row log-sum-exp, and the output gradient, without
//! anything of size `Sq × Sk` but the optional `dS`. The kernels are
//! [`crate::flash::backward`]'s; this is their plan and launch.

use cubecl::prelude::*;

use super::options::{
    AmpereUse, AttentionDims, AttentionError, AttentionFeatures, AttentionOptions, BackwardTensors,
    attention_dims, broadcast_strides, expect_shape, validate,
};
use crate::flash::backward::{
    Schedule, cmma, hopper, launch_backward, launch_delta, mma, sm80, units,
};
use crate::flash::block::fold_pairs;
use crate::flash::{BackwardOperands, FlashConfig, Operand, ScoreSource, Tile};
use crate::fragment::{self, MatrixUnitsUnavailable};
use crate::tensor::TensorRef;

/// The kernels of a backward launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionBackwardKernel {
    /// Plain units, every runtime and float type, f32 arithmetic:
    /// [`crate::flash::backward::flash_delta()`], then [`units::flash_backward_dkv()`] (one
    /// cube per key block, looping over the query rows of the group) and
    /// [`units::flash_backward_dq()`] (one cube per block of query rows, looping over the keys
    /// they see).
    Units,
    /// The matrix units (f16/bf16 on CUDA sm_80+, 16-byte aligned rows):
    /// [`crate::flash::backward::flash_delta()`],
    /// [`crate::flash::backward::mma_dkv::flash_backward_dkv_mma()`] and
    /// [`crate::flash::backward::mma_dq::flash_backward_dq_mma()`] (which also writes `dS` for
    /// a tracked bias). Computed scores with scale, softcap, masks, biases, causal, grouped
    /// heads and dropout, `D`, `Dv` up to [`mma::MAX_DIM`].
    MatrixUnits,
    /// Cooperative matrices (f16/bf16 where cubecl's `cmma` runs and no `mma` does — Vulkan
    /// through SPIR-V, Metal — or with the forward forced to
    /// [`super::AttentionKernel::CooperativeMatrix`]): [`crate::flash::backward::flash_delta()`],
    /// [`cmma::flash_backward_dkv_cmma()`] and [`cmma::flash_backward_dq_cmma()`], every score
    /// rule, `D`, `Dv` up to [`cmma::MAX_DIM`].
    CooperativeMatrix,
    /// Hopper's `wgmma` and TMA (f16/bf16 on sm_90, [`hopper::unavailable`]; a written `dS`
    /// only without a softcap, [`hopper::takes_ds`]): a per-row prepass (`δ`, the log-sum-exp
    /// in base 2, the `dQ` accumulator zeroed), one kernel per block of 128 keys (64 at head
    /// dims over 128) writing `dK`, `dV` (and `dS`) and adding `dQ` into the f32 accumulator,
    /// then `dQ` in the element type.
    /// Planned on sm_90 unless [`HopperUse::Off`](super::HopperUse::Off), another forward kernel is forced, or
    /// the call has a bias TMA cannot load as tiles ([`hopper::preferred`]: slower there, unless
    /// `=always`).
    Hopper,
    /// FlashAttention-2's data flow on `mma.sync` (f16/bf16 on CUDA sm_80+,
    /// [`sm80::unavailable`]): the Hopper backward's per-row prepass, one kernel per block of
    /// 128 keys (64 where shared memory is 99 KiB) writing `dK`, `dV` and adding `dQ` into the
    /// f32 accumulator, then `dQ` in the element type. Planned where the Hopper backward does
    /// not take the call on the GPUs where it has run ([`sm80::default_on`]; everywhere under
    /// [`AmpereUse::Always`], ahead of the Hopper backward; never under [`AmpereUse::Off`]) and
    /// no forward kernel is forced.
    Ampere,
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
    /// Whether the bias was loaded as tiles by TMA (the Hopper backward,
    /// [`hopper::Variant::bias_tiles`]) rather than read per element.
    pub bias_tiles: bool,
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

/// The backward launch [`plan_attention_backward`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionBackwardPlan {
    /// The kernels that run.
    pub kernel: AttentionBackwardKernel,
    /// The `dQ` kernel's configuration: score rules and tile (query rows per cube, keys per
    /// step, head dims rounded up); the `dK`/`dV` kernel's follows from it.
    pub config: FlashConfig,
    /// Keys per cube of the `dK`/`dV` kernel.
    pub block_keys: usize,
    /// Cubes of the `dK`/`dV` kernel: (key blocks — times column tiles on plain units — and
    /// `B·Hkv` folded over y and z; on Hopper `Hkv` and `B`).
    pub dkv_cubes: (usize, usize, usize),
    /// Cubes of the `dQ` kernel: (row blocks of `G·Sq`, and `B·Hkv` folded over y and z; on
    /// Hopper the blocks of 8 rows of the per-row kernels over `B·Hq` padded heads).
    pub dq_cubes: (usize, usize, usize),
    /// Why the matrix units do not run this call (`None`: they do).
    pub matrix_units: Option<MatrixUnitsUnavailable>,
}

impl AttentionBackwardPlan {
    /// Device scratch the launch allocates beyond the caller's tensors for `dims`, in bytes:
    /// `δ`, one f32 per query row; the Hopper backward, per query row padded to
    /// [`hopper::BLOCK_Q`], `δ`, the base-2 log-sum-exp and the f32 `dQ` accumulator
    /// (`config.head_dim` columns): `O(Sq·D)`, never `Sq × Sk`.
    pub fn scratch_bytes(&self, dims: AttentionDims) -> usize {
        match self.kernel {
            // δ, the base-2 lse and the accumulator per row; a counter per 64 rows
            // (deterministic).
            AttentionBackwardKernel::Hopper | AttentionBackwardKernel::Ampere => {
                hopper::padded_rows(dims) * (2 + self.config.head_dim as usize) * 4
                    + hopper::padded_rows(dims) / hopper::BLOCK_Q * 4
            }
            _ => (dims.batch * dims.heads_q * dims.seq_q).max(1) * 4,
        }
    }
}

/// The matrix-unit backward's tile (the `dQ` kernel's: [`mma::DQ_ROWS`] rows per cube,
/// [`mma::step_len`] keys per step) for `D`, `Dv` rounded up to 16.
pub fn mma_tile(d16: u32, dv16: u32) -> Tile {
    Tile {
        block_q: mma::DQ_ROWS,
        row_tiles: 1,
        block_k: mma::step_len(d16, dv16),
        head_dim: d16,
        value_dim: dv16,
    }
}

/// The plain-unit backward's tile (the `dQ` kernel's): [`units::BLOCK_ROWS`] rows per cube,
/// [`units::STEP_KEYS`] keys per step, `D` and `Dv` rounded up to [`units::CHUNK`].
pub fn units_tile(head_dim: usize, value_dim: usize) -> Tile {
    Tile {
        block_q: units::BLOCK_ROWS,
        row_tiles: 1,
        block_k: units::STEP_KEYS,
        head_dim: head_dim.next_multiple_of(units::CHUNK as usize) as u32,
        value_dim: value_dim.next_multiple_of(units::CHUNK as usize) as u32,
    }
}

/// Why the matrix-unit backward cannot run a call of config `c` (`None`: it can): the
/// device and alignment ([`fragment::unavailable`]), head dims up to [`mma::MAX_DIM`], and
/// both kernels' units and shared memory.
fn mma_unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    aligned: bool,
    c: FlashConfig,
) -> Option<MatrixUnitsUnavailable> {
    let hw = &client.properties().hardware;
    fragment::unavailable(client, dtype, aligned).or(
        if c.head_dim.max(c.value_dim) > mma::MAX_DIM {
            Some(MatrixUnitsUnavailable::HeadDim { max: mma::MAX_DIM })
        } else if hw.max_units_per_cube < mma::PLANES * fragment::PLANE
            || hw.max_shared_memory_size
                < mma::dkv_shared_bytes(mma::dkv_config(c)).max(mma::dq_shared_bytes(c))
        {
            Some(MatrixUnitsUnavailable::Resources)
        } else {
            None
        },
    )
}

/// The backward launch for `dims` that writes no `dS`, without launching: the Hopper kernels
/// on sm_90 where they take the call, else the Ampere kernel (CUDA sm_80+) where it takes it
/// (as [`AttentionOptions::ampere_backward`] says), else the matrix units where they take it,
/// else plain units.
pub fn plan_attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Result<AttentionBackwardPlan, AttentionError> {
    plan_attention_backward_writing(client, dims, dtype, features, options, false)
}

/// [`plan_attention_backward`] for a call that writes `dS` where `write_ds` (a tracked bias,
/// whose gradient sums it): every kernel writes it, the Hopper backward only without a softcap
/// ([`hopper::takes_ds`]).
pub fn plan_attention_backward_writing<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
    write_ds: bool,
) -> Result<AttentionBackwardPlan, AttentionError> {
    let hopper_ok = !write_ds || hopper::takes_ds(options.softcap.is_some());
    validate(client, dims, dtype, options)?;
    let hw = &client.properties().hardware;
    if hw.max_units_per_cube < units::UNITS || hw.max_shared_memory_size < units::SHARED_BYTES {
        return Err(AttentionError::KernelUnavailable {
            kernel: super::AttentionKernel::Units,
            reason: format!(
                "the backward needs {} units and {} B of shared memory per cube",
                units::UNITS,
                units::SHARED_BYTES
            ),
        });
    }
    let (mx, my, mz) = hw.max_cube_count;
    let (y, z) = fold_pairs(dims.batch * dims.heads_kv, my);
    let rows = dims.group() * dims.seq_q;
    let rules = options.rules(features);
    let mma_config = FlashConfig::new(
        ScoreSource::QueryKey,
        rules,
        mma_tile(
            dims.head_dim.next_multiple_of(16) as u32,
            dims.value_dim.next_multiple_of(16) as u32,
        ),
    );
    let matrix_units = mma_unavailable(client, dtype, features.aligned, mma_config);
    // Cooperative matrices: where the device has no `mma` (or the forward is forced onto them,
    // or an f32 call allows TF32 and no forward kernel is forced) and they take the head dims
    // and fit the device.
    let tf32 = options.tf32_for(dtype);
    let cooperative = crate::flash::forward::cmma::fragment(client, dtype, tf32).and_then(|f| {
        let c = FlashConfig::new(
            ScoreSource::QueryKey,
            rules,
            cmma::tile(dims.head_dim, dims.value_dim, f),
        )
        .with_tf32(tf32);
        let wanted = options.kernel == Some(super::AttentionKernel::CooperativeMatrix)
            || matches!(matrix_units, Some(MatrixUnitsUnavailable::NoMma { .. }))
            || (tf32 && options.kernel.is_none());
        (wanted && cmma::runs(client, c, f)).then_some((f, c))
    });
    // The Ampere backward where it runs the call (no forward kernel forced): ahead of the
    // Hopper backward under `AmpereUse::Always`, else (`Faster`) where the Hopper backward does
    // not take the call, on the GPUs where it has run (`sm80::default_on`). Asked only where
    // the use wants it.
    let ampere = || {
        (options.kernel.is_none()
            && ampere_reason(client, dims, dtype, features, options, write_ds).is_none())
        .then(|| sm80::shape(dims, options.ampere_tile, hw.max_shared_memory_size))
        .flatten()
        .map(|shape| {
            let block_keys = shape.keys as usize;
            AttentionBackwardPlan {
                kernel: AttentionBackwardKernel::Ampere,
                config: FlashConfig::new(ScoreSource::QueryKey, rules, shape.tile(dims)),
                block_keys,
                dkv_cubes: (dims.seq_k.div_ceil(block_keys), dims.heads_kv, dims.batch),
                dq_cubes: (hopper::padded_rows(dims).div_ceil(8), 1, 1),
                matrix_units,
            }
        })
    };
    if options.ampere_backward == AmpereUse::Always
        && let Some(plan) = ampere()
    {
        return Ok(plan);
    }
    // The Hopper backward where it runs the call and is the faster one, or the forward was
    // forced onto Hopper.
    let hopper_wanted = options.kernel == Some(super::AttentionKernel::Hopper)
        || hopper::preferred(features, options.hopper);
    if hopper_ok && hopper_wanted && hopper_reason(client, dims, dtype, features, options).is_none()
    {
        let config = FlashConfig::new(ScoreSource::QueryKey, rules, hopper::tile(dims));
        let rows = hopper::padded_rows(dims);
        let block_keys = config.block_k as usize;
        return Ok(AttentionBackwardPlan {
            kernel: AttentionBackwardKernel::Hopper,
            config,
            block_keys,
            dkv_cubes: (dims.seq_k.div_ceil(block_keys), dims.heads_kv, dims.batch),
            dq_cubes: (rows.div_ceil(8), 1, 1),
            matrix_units,
        });
    }
    if options.ampere_backward == AmpereUse::Faster
        && sm80::default_on(client)
        && sm80::default_rules(rules, write_ds)
        && let Some(plan) = ampere()
    {
        return Ok(plan);
    }
    let (kernel, config, block_keys, dkv_cubes) = match (cooperative, matrix_units) {
        (Some((f, c)), _) => (
            AttentionBackwardKernel::CooperativeMatrix,
            c,
            cmma::block_keys(f),
            (dims.seq_k.div_ceil(cmma::block_keys(f) as usize), y, z),
        ),
        (None, None) => (
            AttentionBackwardKernel::MatrixUnits,
            mma_config,
            mma::DKV_KEYS,
            (dims.seq_k.div_ceil(mma::DKV_KEYS as usize), y, z),
        ),
        (None, Some(_)) => (
            AttentionBackwardKernel::Units,
            FlashConfig::new(
                ScoreSource::QueryKey,
                rules,
                units_tile(dims.head_dim, dims.value_dim),
            ),
            units::BLOCK_KEYS,
            (
                units::dkv_blocks(dims.seq_k, dims.head_dim, dims.value_dim, false),
                y,
                z,
            ),
        ),
    };
    let dq_cubes = (rows.div_ceil(config.block_q as usize), y, z);
    for cubes in [dkv_cubes, dq_cubes] {
        if cubes.0 > mx as usize || cubes.2 > mz as usize {
            return Err(AttentionError::TooLarge { cubes });
        }
    }
    Ok(AttentionBackwardPlan {
        kernel,
        config,
        block_keys: block_keys as usize,
        dkv_cubes,
        dq_cubes,
        matrix_units,
    })
}

/// Why the Ampere backward does not run a call (`None`: it does): [`sm80::unavailable`].
pub fn ampere_reason<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
    write_ds: bool,
) -> Option<String> {
    sm80::unavailable(
        sm80::cuda(client),
        fragment::unavailable(client, dtype, features.aligned),
        dims,
        options.rules(features),
        options,
        write_ds,
        client.properties().hardware.max_shared_memory_size,
    )
}

/// Why the Hopper backward does not run a call (`None`: it does): switched off, another
/// forward kernel forced, or [`hopper::unavailable`].
fn hopper_reason<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Option<String> {
    if let Some(kernel) = options
        .kernel
        .filter(|&k| k != super::AttentionKernel::Hopper)
    {
        return Some(format!("the forward is forced onto {kernel:?}"));
    }
    let ordered = hopper::dq_tiled(FlashConfig::new(
        ScoreSource::QueryKey,
        options.rules(features),
        hopper::tile(dims),
    ));
    if options.deterministic && !ordered {
        return Some(
            "the Hopper backward adds dQ in a fixed order (deterministic) at head dims up to 128, without the hopper-atomic-dq feature".into(),
        );
    }
    options
        .hopper
        .switched_off()
        .or_else(|| hopper::unavailable(super::sm90(client), dims, dtype, features))
}

/// Writes the gradients of [`super::launch_attention`] (same `options`) into `t.dq`, `t.dk`,
/// `t.dv` (and `t.ds`). Returns the plan that ran; nothing is launched when an error is
/// returned. Needs [`AttentionBackwardPlan::scratch_bytes`] of scratch (`δ`; on Hopper also
/// the f32 `dQ` accumulator).
pub fn launch_attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    t: BackwardTensors<'_>,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<AttentionBackwardPlan, AttentionError> {
    crate::cache::ensure_linked();
    let dims = attention_dims(&t.q, &t.k, &t.v)?;
    expect_shape("out", &t.out, &dims.out_shape())?;
    expect_shape("d_out", &t.d_out, &dims.out_shape())?;
    expect_shape("lse", &t.lse, &dims.lse_shape())?;
    expect_shape("dq", &t.dq, t.q.shape)?;
    expect_shape("dk", &t.dk, t.k.shape)?;
    expect_shape("dv", &t.dv, t.v.shape)?;
    let full = dims.scores_shape();
    if let Some(ds) = &t.ds {
        expect_shape("ds", ds, &full)?;
    }
    if let Some(s) = &t.slopes {
        expect_shape("slopes", s, &[dims.heads_q])?;
    }
    if let Some(s) = &t.seqs {
        super::check_seqs(s, dims)?;
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
    let features = AttentionFeatures {
        aligned: super::rows_aligned(&[
            (t.q.shape, t.q.strides),
            (t.k.shape, t.k.strides),
            (t.v.shape, t.v.strides),
            (t.d_out.shape, t.d_out.strides),
        ]) && super::starts_aligned(&[&t.q, &t.k, &t.v, &t.d_out]),
        mask: t.mask.is_some(),
        alibi: t.slopes.is_some(),
        varlen: t.seqs.is_some(),
        ..Default::default()
    }
    .with_bias(t.bias.as_ref().zip(bias_strides.as_deref()));
    let plan =
        plan_attention_backward_writing(client, dims, dtype, features, options, t.ds.is_some())?;
    let pairs = dims.batch * dims.heads_kv;
    let rows = pairs * dims.group() * dims.seq_q;
    if pairs == 0 {
        return Ok(plan);
    }
    if plan.kernel == AttentionBackwardKernel::Hopper {
        // SAFETY: the shapes were checked above and describe the buffers; the plan took the
        // Hopper backward, so `hopper::unavailable` found nothing against this call (rows and
        // starts aligned, non-empty sequences) and a `ds` comes without a softcap
        // (`hopper::takes_ds`); the mask and bias strides were checked against
        // `[B, Hq, Sq, Sk]`, `ds`'s shape is `[B, Hq, Sq, Sk]`.
        crate::launch_hand_written!(
            client,
            |cuda| unsafe {
                let bias_tiles = hopper::launch(
                    cuda,
                    &t,
                    dims,
                    dtype,
                    options,
                    plan.config,
                    (mask_strides.as_deref(), bias_strides.as_deref()),
                    hopper::UNITS,
                    hopper::shared_bytes(plan.config),
                    plan.dkv_cubes,
                );
                record_launch(BackwardLaunch {
                    dims,
                    kernel: plan.kernel,
                    mask: t.mask.is_some(),
                    ds: t.ds.is_some(),
                    bias_tiles,
                });
            },
            Ok(plan)
        );
    }
    if plan.kernel == AttentionBackwardKernel::Ampere {
        // SAFETY: the shapes were checked above and describe the buffers; the plan took the
        // Ampere backward, so `sm80::unavailable` found nothing against this call (the `mma`
        // path's alignment, head dims up to 128, a `ds` only without a softcap, non-empty
        // sequences); the mask and bias strides were checked against `[B, Hq, Sq, Sk]`, `ds`'s
        // shape is `[B, Hq, Sq, Sk]`.
        crate::launch_hand_written!(
            client,
            |cuda| unsafe {
                let max_shared = cuda.properties().hardware.max_shared_memory_size;
                let shape = sm80::shape(dims, options.ampere_tile, max_shared)
                    .expect("the plan found the Ampere backward's shape");
                sm80::launch(
                    cuda,
                    &t,
                    dims,
                    dtype,
                    options,
                    plan.config,
                    (mask_strides.as_deref(), bias_strides.as_deref()),
                    shape,
                    plan.dkv_cubes,
                );
                record_launch(BackwardLaunch {
                    dims,
                    kernel: plan.kernel,
                    mask: t.mask.is_some(),
                    ds: t.ds.is_some(),
                    bias_tiles: false,
                });
            },
            Ok(plan)
        );
    }
    let operand = |t: &TensorRef<'_>, strides: Option<&Vec<usize>>| Operand {
        handle: t.handle.clone(),
        shape: match strides {
            Some(_) => full.to_vec(),
            None => t.shape.to_vec(),
        },
        strides: strides.cloned().unwrap_or_else(|| t.strides.to_vec()),
    };
    // An absent mask, bias or `ds` is never read or written: `q` or `dq` stands in.
    let operands = BackwardOperands {
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
        // Absent slopes are never read: `lse` (f32) stands in.
        slopes: operand(t.slopes.as_ref().unwrap_or(&t.lse), None),
        // The backward reads no sinks (the stored lse includes them): `lse` stands in.
        sinks: operand(&t.lse, None),
        // Absent sequences are never read: `lse` stands in.
        seqs: operand(t.seqs.as_ref().unwrap_or(&t.lse), None),
        out: operand(&t.out, None),
        d_out: operand(&t.d_out, None),
        lse: operand(&t.lse, None),
        dq: operand(&t.dq, None),
        dk: operand(&t.dk, None),
        dv: operand(&t.dv, None),
        ds: operand(t.ds.as_ref().unwrap_or(&t.dq), None),
    };
    let write_ds = t.ds.is_some();
    let schedule =
        match plan.kernel {
            AttentionBackwardKernel::MatrixUnits => Schedule::MatrixUnits {
                write_ds,
                p_buffer: None,
            },
            AttentionBackwardKernel::CooperativeMatrix => Schedule::CooperativeMatrix {
                write_ds,
                vector: crate::flash::forward::cmma::fragment(client, dtype, plan.config.tf32)
                    .map_or(1, |f| {
                        crate::flash::forward::cmma::vector(
                            &[
                                (t.q.shape, t.q.strides),
                                (t.k.shape, t.k.strides),
                                (t.v.shape, t.v.strides),
                                (t.d_out.shape, t.d_out.strides),
                            ],
                            plan.config,
                            f,
                        )
                    }),
            },
            AttentionBackwardKernel::Units => Schedule::Units { write_ds },
            AttentionBackwardKernel::Hopper | AttentionBackwardKernel::Ampere => {
                unreachable!("launched above")
            }
        };
    // SAFETY: every index is bounds-checked against the shapes passed here, which describe the
    // caller's buffers (checked above); on the matrix units the rows of `q`, `k`, `v` and `dO`
    // are 16-byte aligned (`features.aligned`), the kernels' vector width; the grids are the
    // plan's.
    unsafe {
        let delta = launch_delta(client, &operands.out, &operands.d_out, rows, dtype);
        launch_backward(
            client,
            schedule,
            &operands,
            &delta,
            (dims.seq_k > 0).then_some(plan.dkv_cubes),
            (rows > 0).then_some(plan.dq_cubes),
            options.scalars(),
            plan.config,
            dtype,
        );
    }
    record_launch(BackwardLaunch {
        dims,
        kernel: plan.kernel,
        mask: t.mask.is_some(),
        ds: write_ds,
        bias_tiles: false,
    });
    Ok(plan)
}
