//! Fused attention forward: `out = softmax(S)·V` with `S` computed on chip from `Q·Kᵀ` and
//! never written, plus the row log-sum-exp of `S` (what a backward needs).
//!
//! Tensors are 4-D and read through their strides: `q` `[B, Hq, Sq, D]`, `k` `[B, Hkv, Sk, D]`,
//! `v` `[B, Hkv, Sk, Dv]`, `out` `[B, Hq, Sq, Dv]`, `lse` `[B, Hq, Sq]` (f32). `Hkv` divides
//! `Hq` (grouped-query attention: query head `h` reads key/value head `h / (Hq / Hkv)`).
//! Optional `mask` (1 = masked out, 0 = visible, in the element type of `q`) and `bias`,
//! `[B or 1, Hq or 1, Sq or 1, Sk]`: dimensions of size 1 broadcast.
//!
//! The score of query `i` and key `j` is, in this order (Burn's `attention_fallback`'s):
//! `s = scale·q·k`, `s = c·tanh(s / c)` (softcap), masked keys removed, causal (bottom-right
//! aligned: `j ≤ i + Sk − Sq`) keys removed, `s += bias`. A row without a visible key gives
//! zeros and `lse = −inf`.
//!
//! [`plan_attention`] picks one kernel ([`AttentionKernel`]); all are the flash forward loops
//! of [`crate::flash`] with computed scores ([`ScoreSource::QueryKey`]):
//! - [`mma`]: FlashAttention-2's schedule on the matrix units, f16/bf16 on CUDA (sm_80+) with
//!   16-byte aligned rows;
//! - [`cmma`]: the same loop on cooperative matrices, f16/bf16 where the device offers them
//!   and has no manual `mma` (Vulkan through SPIR-V, Metal);
//! - [`tiled`]: plain units, every runtime and float type, f32 arithmetic, register-tiled
//!   128 × 128 outputs per cube (outputs of at least 65 × 65);
//! - [`units`]: plain units for the rest (and where 256 units or the tiled kernel's shared
//!   memory are missing).

pub mod backward;

use core::fmt;

use cubecl::{CubeCount, CubeDim, prelude::*};

use crate::dropout::DropoutParams;
use crate::flash::forward::{cmma, hopper, launch_forward, mma, tiled, units};
use crate::flash::{
    FlashConfig, FlashKernel, FlashTensors, Scalars, ScoreRules, ScoreSource, Tile,
};
use crate::fragment::{self, MatrixUnitsUnavailable};
use crate::tensor::{TensorRef, UnsupportedDType};

pub use backward::{
    AttentionBackwardKernel, AttentionBackwardPlan, BackwardLaunch, BackwardTensors,
    launch_attention_backward, plan_attention_backward, plan_attention_backward_writing,
    recent_backward_launches,
};

/// Largest head dim (of queries/keys and of values) any kernel takes.
pub const MAX_HEAD_DIM: usize = 256;

/// The kernel of a launch, chosen once by [`plan_attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKernel {
    /// [`units::flash_forward_units()`]: plain units, every runtime and float type.
    Units,
    /// [`tiled::flash_forward_tiled()`]: plain units, every runtime and float type,
    /// register-tiled (128 query rows × 128 output columns per cube, 16 keys per step).
    Tiled,
    /// [`mma::flash_forward_mma()`]: f16/bf16 on the matrix units with `cp.async`
    /// double buffering (CUDA sm_80+, 16-byte aligned rows).
    MatrixUnits,
    /// [`cmma::flash_forward_cmma()`]: f16/bf16 on cooperative matrices (cubecl's `cmma`):
    /// where the device offers them ([`cmma::fragment`]) — Vulkan through SPIR-V, Metal, and
    /// CUDA's `wmma` when forced.
    CooperativeMatrix,
    /// [`hopper`]: f16/bf16 on Hopper GPUs (sm_90) with TMA, `wgmma` and warp specialisation
    /// (FlashAttention-3's schedule), hand-written CUDA (CUDA builds only; what it takes:
    /// [`hopper::unavailable`]).
    Hopper,
    /// [`crate::decode`]: split-KV decoding (FlashDecoding), for few query rows per key/value
    /// head ([`crate::decode::DECODE_ROWS`]) against long contexts: the keys split over cubes,
    /// the splits' states merged by a second kernel. Every runtime and float type; no mask,
    /// bias, dropout or packed sequences.
    SplitDecode,
}

impl AttentionKernel {
    /// The `#[cube]` forward loop of this kernel (`None`: the hand-written Hopper kernel).
    fn flash_kernel(self) -> Option<FlashKernel> {
        match self {
            Self::Units => Some(FlashKernel::Units),
            Self::Tiled => Some(FlashKernel::Tiled),
            Self::MatrixUnits => Some(FlashKernel::MatrixUnits),
            Self::CooperativeMatrix => Some(FlashKernel::CooperativeMatrix),
            Self::Hopper | Self::SplitDecode => None,
        }
    }
}

/// Why the Hopper forward cannot run this call on `client`'s device (`None`: it can).
fn hopper_unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
) -> Option<String> {
    hopper_switched_off().or_else(|| hopper::unavailable(sm90(client), dims, dtype, features))
}

/// Why no Hopper kernel runs in this process (`None`: they may): `BURN_FLASH_HOPPER=off`.
pub(crate) fn hopper_switched_off() -> Option<String> {
    (hopper::usage() == hopper::Use::Off)
        .then(|| "the Hopper kernels are switched off (BURN_FLASH_HOPPER=off)".into())
}

/// Whether `client` is a CUDA client of a Hopper GPU (sm_90).
pub(crate) fn sm90<R: Runtime>(client: &ComputeClient<R>) -> bool {
    #[cfg(feature = "cuda")]
    return crate::hopper::with_cuda_client!(client, |cuda| crate::hopper::sm90(cuda))
        .unwrap_or(false);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = client;
        false
    }
}

/// What the scores are made of, and overrides of the host heuristic.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Factor of `q·k`.
    pub scale: f32,
    /// Softcap `c` (`s = c·tanh(s / c)`), positive and finite.
    pub softcap: Option<f32>,
    /// Bottom-right aligned causal mask.
    pub causal: bool,
    /// Force a kernel; an impossible choice is an error, never a silent fallback.
    pub kernel: Option<AttentionKernel>,
    /// Force the keys per step: a multiple of 16 up to 128 on the matrix units, [`units::BLOCK_K`]
    /// or [`tiled::BLOCK_K`] on plain units; an impossible choice is an error.
    pub block_k: Option<usize>,
    /// Dropout on the attention weights ([`crate::dropout`]): `None` or a probability of 0 is
    /// none. Every forward kernel but the register-tiled one ([`AttentionKernel::Tiled`])
    /// takes it.
    pub dropout: Option<DropoutParams>,
    /// The score a key masked by the bool mask takes, instead of leaving the softmax
    /// (burn-nn's `mask_fill(mask, min_float)`): finite, so a fully masked row is uniform.
    /// After scale, softcap and bias; the causal mask and keys past the end still leave.
    /// `None`: masked keys are invisible.
    pub masked_score: Option<f32>,
    /// Quiet softmax, `e^s / (1 + Σ e^s)` (burn's `quiet_softmax`): the stored log-sum-exp
    /// is `ln(1 + Σ e^s)`.
    pub quiet: bool,
    /// Sliding window `(left, right)`: query `i` sees keys from `a − left` to `a + right`
    /// inclusive, `a = i + Sk − Sq` (bottom-right aligned, as the causal mask; with `causal`
    /// the right side is 0). Key blocks outside every row's window are skipped. A side wider
    /// than the sequence sees every key on that side.
    pub window: Option<(usize, usize)>,
}

impl AttentionOptions {
    /// The score rules of a call with these options and `features`.
    pub fn rules(&self, features: AttentionFeatures) -> ScoreRules {
        ScoreRules {
            causal: self.causal,
            mask: features.mask,
            bias: features.bias,
            softcap: self.softcap.is_some(),
            dropout: self.dropout.is_some(),
            masked_score: self.masked_score.map(f32::to_bits),
            quiet: self.quiet,
            window: self.window.is_some(),
            alibi: features.alibi,
            sinks: features.sinks,
            varlen: features.varlen,
        }
    }

    /// The kernels' runtime scalars.
    pub fn scalars(&self) -> Scalars {
        Scalars {
            scale: self.scale,
            softcap: self.softcap,
            dropout: self.dropout,
            window: self.window,
        }
    }
}

/// What of a call beyond its sizes a plan depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionFeatures {
    /// The rows of `q`, `k`, `v` and `out` (backward: `dO`) are 16-byte aligned
    /// ([`rows_aligned`]).
    pub aligned: bool,
    /// A mask is given.
    pub mask: bool,
    /// A bias is given (backward: or `dS` is asked for).
    pub bias: bool,
    /// ALiBi slopes are given.
    pub alibi: bool,
    /// Attention-sink logits are given (forward only: the backward kernels read the stored
    /// log-sum-exp, which includes them).
    pub sinks: bool,
    /// The call is a packed variable-length batch (`seqs` given, [`check_seqs`]).
    pub varlen: bool,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionDims {
    /// Batch.
    pub batch: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads (divides `heads_q`).
    pub heads_kv: usize,
    /// Query positions.
    pub seq_q: usize,
    /// Key/value positions.
    pub seq_k: usize,
    /// Head dim of queries and keys.
    pub head_dim: usize,
    /// Head dim of values and of the output.
    pub value_dim: usize,
}

impl AttentionDims {
    /// Query heads per key/value head, `G = Hq / Hkv`.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// The shape of the output (and of its gradient), `[B, Hq, Sq, Dv]`.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.value_dim]
    }

    /// The shape of the row log-sum-exp, `[B, Hq, Sq]`.
    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seq_q]
    }

    /// The shape of the scores (a full mask, a bias, `dS`), `[B, Hq, Sq, Sk]`.
    pub fn scores_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.seq_k]
    }
}

/// The launch [`plan_attention`] chose: the kernel and the configuration it is compiled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPlan {
    /// The kernel that runs.
    pub kernel: AttentionKernel,
    /// Its configuration: score rules and tile (query rows per cube, keys per step, head dims
    /// rounded up, output columns per cube).
    pub config: FlashConfig,
    /// Units per cube.
    pub units: u32,
    /// Shared memory per cube, in bytes.
    pub shared_bytes: usize,
    /// Cubes along `(x, y, z)` = (column tiles of `Dv`, row blocks of `G·Sq`, `B·Hkv`), the
    /// last two folded so that any `B·Hkv` runs ([`crate::flash::block::fold_grid`]).
    pub cubes: (usize, usize, usize),
    /// Why the matrix units do not run this call (`None`: they do, or could).
    pub matrix_units: Option<MatrixUnitsUnavailable>,
}

/// Why an attention launch was refused. Nothing is launched when one is returned.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionError {
    /// A tensor's shape does not fit the others.
    ShapeMismatch {
        /// Which argument.
        arg: &'static str,
        /// What it should be.
        expected: String,
        /// Its shape.
        got: Vec<usize>,
    },
    /// The element type is not f32, f16 or bf16, or the device cannot run it.
    UnsupportedDType {
        /// The element type, as cubecl names it.
        dtype: String,
    },
    /// A head dim no kernel takes.
    UnsupportedHeadDim {
        /// `D`.
        head_dim: usize,
        /// `Dv`.
        value_dim: usize,
    },
    /// An option is out of range.
    InvalidOption {
        /// Why.
        reason: String,
    },
    /// The forced kernel cannot run this call on this device.
    KernelUnavailable {
        /// The forced kernel.
        kernel: AttentionKernel,
        /// Why not.
        reason: String,
    },
    /// More cubes along one grid axis than the device can launch.
    TooLarge {
        /// Cubes along each axis the launch would need.
        cubes: (usize, usize, usize),
    },
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ShapeMismatch { arg, expected, got } => {
                write!(f, "`{arg}` has shape {got:?}, expected {expected}")
            }
            Self::UnsupportedDType { dtype } => write!(
                f,
                "dtype {dtype} is not supported (f32, f16 and bf16 are, where the device has them)"
            ),
            Self::UnsupportedHeadDim {
                head_dim,
                value_dim,
            } => write!(
                f,
                "head dims D = {head_dim}, Dv = {value_dim} are not supported (1 ..= {MAX_HEAD_DIM} each)"
            ),
            Self::InvalidOption { reason } => write!(f, "invalid option: {reason}"),
            Self::KernelUnavailable { kernel, reason } => {
                write!(f, "kernel {kernel:?} is not available: {reason}")
            }
            Self::TooLarge { cubes } => write!(
                f,
                "the launch needs {cubes:?} cubes along (x, y, z), more than the device allows"
            ),
        }
    }
}

impl core::error::Error for AttentionError {}

impl From<UnsupportedDType> for AttentionError {
    fn from(e: UnsupportedDType) -> Self {
        Self::UnsupportedDType { dtype: e.dtype }
    }
}

/// Whether the matrix-unit kernel can read these `q`, `k`, `v` and write this `out` (shape,
/// strides): unit stride along the head dim, head dims and every other stride multiples of 8
/// elements (16 bytes).
pub fn rows_aligned(tensors: &[(&[usize], &[usize])]) -> bool {
    tensors.iter().all(|(shape, strides)| {
        strides.len() == 4
            && strides[3] == 1
            && shape[3].is_multiple_of(8)
            && strides[..3].iter().all(|s| s.is_multiple_of(8))
    })
}

/// Whether each buffer starts on 16 bytes, as 16-byte row loads (and TMA) need.
pub fn starts_aligned(tensors: &[&TensorRef<'_>]) -> bool {
    tensors
        .iter()
        .all(|t| t.handle.offset_start.unwrap_or(0).is_multiple_of(16))
}

/// Checks what every attention plan needs, forward and backward: a float type the device
/// runs, `Hkv` dividing `Hq`, head dims in `1..=`[`MAX_HEAD_DIM`], finite options.
pub fn validate<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<(), AttentionError> {
    crate::tensor::check_dtype(client, dtype)?;
    let (heads_q, heads_kv) = (dims.heads_q, dims.heads_kv);
    let (head_dim, value_dim) = (dims.head_dim, dims.value_dim);
    if heads_kv == 0 || !heads_q.is_multiple_of(heads_kv) {
        return Err(AttentionError::ShapeMismatch {
            arg: "k",
            expected: format!("a number of heads dividing Hq = {heads_q}"),
            got: vec![dims.batch, heads_kv, dims.seq_k, head_dim],
        });
    }
    if !(1..=MAX_HEAD_DIM).contains(&head_dim) || !(1..=MAX_HEAD_DIM).contains(&value_dim) {
        return Err(AttentionError::UnsupportedHeadDim {
            head_dim,
            value_dim,
        });
    }
    let invalid = |reason: String| Err(AttentionError::InvalidOption { reason });
    if !options.scale.is_finite() {
        return invalid(format!("scale must be finite, got {}", options.scale));
    }
    if let Some(cap) = options.softcap
        && !(cap > 0.0 && cap.is_finite())
    {
        return invalid(format!("softcap must be positive and finite, got {cap}"));
    }
    if let Some(fill) = options.masked_score
        && !fill.is_finite()
    {
        return invalid(format!("masked_score must be finite, got {fill}"));
    }
    Ok(())
}

/// The launch for `dims`, without launching.
///
/// Heuristic (no autotuning): the matrix units for f16/bf16 where the device has `mma`,
/// `ldmatrix` and `cp.async` and the rows are aligned ([`mma_tile`]); cooperative matrices
/// where it has no manual `mma` but offers a `cmma` fragment for the dtype ([`cmma_tile`]);
/// plain units otherwise:
/// the register-tiled kernel for outputs of at least 65 × 65 (`G·Sq` rows, `Dv` columns)
/// where it fits and no dropout is asked for, else [`units_tile`].
pub fn plan_attention<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Result<AttentionPlan, AttentionError> {
    validate(client, dims, dtype, options)?;
    let (head_dim, value_dim) = (dims.head_dim, dims.value_dim);
    let matrix_units = fragment::unavailable(client, dtype, features.aligned);
    let decode = match options.kernel {
        Some(AttentionKernel::SplitDecode) => true,
        None => decode_preferred(dims, features, options),
        Some(_) => false,
    };
    if decode {
        let plan = crate::decode::plan_decode(client, dims, dtype, features, options)?;
        return Ok(AttentionPlan {
            kernel: AttentionKernel::SplitDecode,
            config: plan.config,
            units: crate::decode::kernel::UNITS,
            shared_bytes: crate::decode::shared_bytes(client, &plan),
            cubes: plan.cubes,
            matrix_units,
        });
    }
    let rules = options.rules(features);
    let unavailable = |kernel, reason: String| AttentionError::KernelUnavailable { kernel, reason };
    let coop = cmma::fragment(client, dtype);
    let tiled_config = FlashConfig::new(ScoreSource::QueryKey, rules, tiled::tile(head_dim));
    let hopper_reason = hopper_unavailable(client, dims, dtype, features);
    let kernel = match (options.kernel, matrix_units) {
        (Some(AttentionKernel::Hopper), _) if hopper_reason.is_some() => {
            return Err(unavailable(
                AttentionKernel::Hopper,
                hopper_reason.unwrap_or_default(),
            ));
        }
        (Some(AttentionKernel::Tiled), _) if options.dropout.is_some() => {
            return Err(unavailable(
                AttentionKernel::Tiled,
                "dropout runs on the matrix-unit and plain-unit kernels only".into(),
            ));
        }
        (Some(AttentionKernel::MatrixUnits), Some(why)) => {
            return Err(unavailable(AttentionKernel::MatrixUnits, why.to_string()));
        }
        (Some(AttentionKernel::CooperativeMatrix), _) if coop.is_none() => {
            return Err(unavailable(
                AttentionKernel::CooperativeMatrix,
                format!(
                    "this device offers no cooperative matrix for {dtype:?} with f32 accumulators"
                ),
            ));
        }
        (Some(kernel), _) => kernel,
        (None, None) if hopper_reason.is_none() && hopper::preferred(features) => {
            AttentionKernel::Hopper
        }
        (None, None) => AttentionKernel::MatrixUnits,
        (None, Some(MatrixUnitsUnavailable::NoMma { .. })) if coop.is_some() => {
            AttentionKernel::CooperativeMatrix
        }
        (None, Some(_))
            if options.dropout.is_none()
                && dims.group() * dims.seq_q > 64
                && value_dim > 64
                && tiled::fits(client, tiled_config) =>
        {
            AttentionKernel::Tiled
        }
        (None, Some(_)) => AttentionKernel::Units,
    };
    let max_shared = client.properties().hardware.max_shared_memory_size;
    let config = match kernel {
        AttentionKernel::MatrixUnits => FlashConfig::new(
            ScoreSource::QueryKey,
            rules,
            mma_tile(head_dim, value_dim, options.block_k)?,
        ),
        AttentionKernel::Hopper => {
            let tile = hopper::tile(dims);
            fixed_block_k(options.block_k, tile.block_k, "the Hopper kernel")?;
            FlashConfig::new(ScoreSource::QueryKey, rules, tile)
        }
        AttentionKernel::CooperativeMatrix => {
            let f = coop.expect("checked above");
            let config = FlashConfig::new(
                ScoreSource::QueryKey,
                rules,
                cmma_tile(head_dim, value_dim, f, options.block_k)?,
            );
            if !cmma::fits(config, f) {
                return Err(AttentionError::InvalidOption {
                    reason: format!(
                        "block_k {} on cooperative matrices of {f:?}: a multiple of {}",
                        config.block_k,
                        (4 * f.lanes_per_row()).max(f.n).max(f.k)
                    ),
                });
            }
            config
        }
        AttentionKernel::Tiled => {
            fixed_block_k(options.block_k, tiled::BLOCK_K, "the tiled kernel")?;
            tiled_config
        }
        AttentionKernel::SplitDecode => unreachable!("the decoding kernel is planned above"),
        AttentionKernel::Units => {
            fixed_block_k(options.block_k, units::BLOCK_K, "plain units")?;
            FlashConfig::new(
                ScoreSource::QueryKey,
                rules,
                units_tile(head_dim, value_dim),
            )
        }
    };
    // Keys per step on the matrix units fall to 16 where shared memory is short.
    let config = match kernel {
        AttentionKernel::MatrixUnits
            if options.block_k.is_none() && mma::shared_bytes(config) > max_shared =>
        {
            FlashConfig {
                block_k: 16,
                ..config
            }
        }
        // Rows per cube fall to 64, then keys per step to 16, where shared memory is short.
        AttentionKernel::CooperativeMatrix if cmma::shared_bytes(config) > max_shared => {
            let narrow = FlashConfig {
                block_q: cmma::BLOCK_Q,
                ..config
            };
            match options.block_k {
                None if cmma::shared_bytes(narrow) > max_shared => FlashConfig {
                    block_k: 16,
                    ..narrow
                },
                _ => narrow,
            }
        }
        _ => config,
    };
    let (units, shared_bytes) = match kernel {
        AttentionKernel::MatrixUnits => (mma::units(config), mma::shared_bytes(config)),
        AttentionKernel::CooperativeMatrix => (
            coop.map_or(0, |f| f.units(config.block_q)),
            cmma::shared_bytes(config),
        ),
        AttentionKernel::Tiled => (
            tiled::UNITS,
            tiled::shared_bytes(config, tiled::planes(client)),
        ),
        AttentionKernel::Units => (units::UNITS, units::shared_bytes(config)),
        AttentionKernel::Hopper => (hopper::units(config), hopper::shared_bytes(config)),
        AttentionKernel::SplitDecode => unreachable!("the decoding kernel is planned above"),
    };
    let hw = &client.properties().hardware;
    if units > hw.max_units_per_cube || shared_bytes > max_shared {
        return Err(unavailable(
            kernel,
            format!(
                "needs {units} units and {shared_bytes} B of shared memory per cube; the device has {} and {max_shared}",
                hw.max_units_per_cube
            ),
        ));
    }
    let unfolded = (
        value_dim.div_ceil(config.value_dim as usize).max(1),
        (dims.group() * dims.seq_q)
            .div_ceil(config.block_q as usize)
            .max(1),
        (dims.batch * dims.heads_kv).max(1),
    );
    let cubes = if kernel == AttentionKernel::Hopper {
        // One block per `block_q` query rows of each (query head, batch).
        (
            dims.seq_q.div_ceil(config.block_q as usize).max(1),
            dims.heads_q,
            dims.batch,
        )
    } else {
        crate::flash::block::fold_grid(unfolded.0, unfolded.1, unfolded.2, hw.max_cube_count)
            .ok_or(AttentionError::TooLarge { cubes: unfolded })?
    };
    Ok(AttentionPlan {
        kernel,
        config,
        units,
        shared_bytes,
        cubes,
        matrix_units,
    })
}

/// Whether the plan takes the decoding kernel unasked: few query rows per key/value head
/// (`G·Sq` ≤ [`crate::decode::DECODE_ROWS`]), which the other kernels' row blocks of 64–192
/// would mostly leave empty, against at least one split's worth of keys
/// ([`crate::decode::MIN_SPLIT_KEYS`]), and a call it takes.
fn decode_preferred(
    dims: AttentionDims,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> bool {
    dims.group() * dims.seq_q <= crate::decode::DECODE_ROWS
        && dims.seq_k >= crate::decode::MIN_SPLIT_KEYS
        && crate::decode::unavailable(features, options).is_none()
}

/// The matrix-unit forward's tile for head dims `D`, `Dv`: two row tiles per plane (128 rows
/// per cube) while the accumulators fit the registers (`Dv ≤ 128`); 64 keys per step up to
/// `D = 64`, 32 beyond, or the forced `block_k` (a multiple of 16 up to 128).
pub fn mma_tile(
    head_dim: usize,
    value_dim: usize,
    block_k: Option<usize>,
) -> Result<Tile, AttentionError> {
    let d = head_dim.next_multiple_of(16) as u32;
    let dv = value_dim.next_multiple_of(16) as u32;
    let row_tiles = if dv <= 128 { 2 } else { 1 };
    let block_k = match block_k {
        None => {
            if d.max(dv) <= 64 {
                64
            } else {
                32
            }
        }
        Some(bk) if bk > 0 && bk.is_multiple_of(16) && bk <= 128 => bk as u32,
        Some(bk) => {
            return Err(AttentionError::InvalidOption {
                reason: format!("block_k {bk} on the matrix units: a multiple of 16 up to 128"),
            });
        }
    };
    Ok(Tile {
        block_q: 64 * row_tiles,
        row_tiles,
        block_k,
        head_dim: d,
        value_dim: dv,
    })
}

/// The cooperative-matrix forward's tile on fragment `f`: [`cmma::WIDE_BLOCK_Q`] rows (eight
/// planes of 16-row fragments share each `K`/`V` block; the plan falls back to
/// [`cmma::BLOCK_Q`] where shared memory is short), [`cmma::BLOCK_K`] keys per step or the
/// forced `block_k` (a multiple of 16 up to 128), `D` and `Dv` rounded up to the fragment.
pub fn cmma_tile(
    head_dim: usize,
    value_dim: usize,
    f: cmma::Fragment,
    block_k: Option<usize>,
) -> Result<Tile, AttentionError> {
    let block_k = match block_k {
        None => cmma::BLOCK_K,
        Some(bk) if bk > 0 && bk.is_multiple_of(16) && bk <= 128 => bk as u32,
        Some(bk) => {
            return Err(AttentionError::InvalidOption {
                reason: format!("block_k {bk} on cooperative matrices: a multiple of 16 up to 128"),
            });
        }
    };
    Ok(Tile {
        block_q: cmma::WIDE_BLOCK_Q,
        row_tiles: 1,
        block_k,
        head_dim: head_dim.next_multiple_of(f.k as usize) as u32,
        value_dim: value_dim.next_multiple_of(f.n as usize) as u32,
    })
}

/// The plain-unit forward's tile: [`units::BLOCK_Q`] rows, [`units::BLOCK_K`] keys per step,
/// `D` and `Dv` rounded up to its chunks.
pub fn units_tile(head_dim: usize, value_dim: usize) -> Tile {
    Tile {
        block_q: units::BLOCK_Q,
        row_tiles: 1,
        block_k: units::BLOCK_K,
        head_dim: head_dim.next_multiple_of(units::D_CHUNK as usize) as u32,
        value_dim: value_dim.next_multiple_of(units::V_CHUNK as usize) as u32,
    }
}

/// A forced `block_k` on a kernel whose keys per step are fixed at `fixed`: only that.
fn fixed_block_k(block_k: Option<usize>, fixed: u32, kernel: &str) -> Result<(), AttentionError> {
    match block_k {
        Some(bk) if bk != fixed as usize => Err(AttentionError::InvalidOption {
            reason: format!("block_k {bk} on {kernel}: it takes {fixed} keys per step"),
        }),
        _ => Ok(()),
    }
}

/// A tensor argument with the given strides.
fn arg<'a, R: Runtime>(t: &TensorRef<'a>, shape: &[usize], strides: &[usize]) -> TensorArg<R> {
    // SAFETY: the shape and strides describe the caller's buffer; zero strides along
    // broadcast dimensions only make every index read the same element.
    unsafe { TensorArg::from_raw_parts(t.handle.clone(), strides.into(), shape.into()) }
}

/// Checks a mask or bias shape against `[B or 1, Hq or 1, Sq or 1, Sk]` and returns its
/// strides with 0 along broadcast dimensions.
fn broadcast_strides(
    name: &'static str,
    t: &TensorRef<'_>,
    full: [usize; 4],
) -> Result<Vec<usize>, AttentionError> {
    let ok = t.shape.len() == 4
        && t.strides.len() == 4
        && t.shape[3] == full[3]
        && (0..3).all(|d| t.shape[d] == full[d] || t.shape[d] == 1);
    if !ok {
        return Err(AttentionError::ShapeMismatch {
            arg: name,
            expected: format!(
                "[{} or 1, {} or 1, {} or 1, {}]",
                full[0], full[1], full[2], full[3]
            ),
            got: t.shape.to_vec(),
        });
    }
    Ok((0..4)
        .map(|d| if t.shape[d] == 1 { 0 } else { t.strides[d] })
        .collect())
}

fn expect_shape(
    name: &'static str,
    t: &TensorRef<'_>,
    expected: &[usize],
) -> Result<(), AttentionError> {
    if t.shape != expected || t.strides.len() != expected.len() {
        return Err(AttentionError::ShapeMismatch {
            arg: name,
            expected: format!("{expected:?}"),
            got: t.shape.to_vec(),
        });
    }
    Ok(())
}

/// Reads the sizes of a call from `q`, `k`, `v` and checks every shape.
pub fn attention_dims(
    q: &TensorRef<'_>,
    k: &TensorRef<'_>,
    v: &TensorRef<'_>,
) -> Result<AttentionDims, AttentionError> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.shape.len() != 4 || t.strides.len() != 4 {
            return Err(AttentionError::ShapeMismatch {
                arg: name,
                expected: "a 4-D tensor".into(),
                got: t.shape.to_vec(),
            });
        }
    }
    let dims = AttentionDims {
        batch: q.shape[0],
        heads_q: q.shape[1],
        heads_kv: k.shape[1],
        seq_q: q.shape[2],
        seq_k: k.shape[2],
        head_dim: q.shape[3],
        value_dim: v.shape[3],
    };
    expect_shape(
        "k",
        k,
        &[dims.batch, dims.heads_kv, dims.seq_k, dims.head_dim],
    )?;
    expect_shape(
        "v",
        v,
        &[dims.batch, dims.heads_kv, dims.seq_k, dims.value_dim],
    )?;
    Ok(dims)
}

/// Checks the sequences of a packed variable-length call (`seqs`: `[2·(n + 1)]`, u32 or i32,
/// the cumulative query lengths then the cumulative key lengths) against its sizes: one
/// batch, `n ≥ 1`. Their values (starting at 0, non-decreasing, ending at `Sq` and `Sk`) are
/// the caller's to check: reading them here would wait for the device.
pub fn check_seqs(seqs: &TensorRef<'_>, dims: AttentionDims) -> Result<(), AttentionError> {
    let n = seqs.shape.first().copied().unwrap_or(0);
    if seqs.shape.len() != 1 || n < 4 || n % 2 != 0 {
        return Err(AttentionError::ShapeMismatch {
            arg: "seqs",
            expected: "[2·(n + 1)] with n ≥ 1 sequences (cu_q then cu_k)".to_string(),
            got: seqs.shape.to_vec(),
        });
    }
    if dims.batch != 1 {
        return Err(AttentionError::ShapeMismatch {
            arg: "q",
            expected: "one batch of packed sequences".to_string(),
            got: vec![dims.batch, dims.heads_q, dims.seq_q, dims.head_dim],
        });
    }
    Ok(())
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
        bias: bias.is_some(),
        alibi: slopes.is_some(),
        sinks: sinks.is_some(),
        varlen: seqs.is_some(),
    };
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
        #[cfg(feature = "cuda")]
        {
            let mask = mask.as_ref().zip(mask_strides.as_deref());
            let bias = bias.as_ref().zip(bias_strides.as_deref());
            // SAFETY: the shapes were checked above and describe the buffers; the plan took
            // the Hopper kernel, so `hopper::unavailable` found nothing against this call, and
            // `aligned` includes the buffers' 16-byte starts.
            let launched = crate::hopper::with_cuda_client!(client, |cuda| unsafe {
                hopper::launch(
                    cuda,
                    &q,
                    &k,
                    &v,
                    mask,
                    bias,
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
            });
            assert!(
                launched.is_some(),
                "the plan takes the Hopper kernel on CUDA clients only"
            );
            return Ok(plan);
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("the plan takes the Hopper kernel on CUDA clients only");
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
    let vector = match cmma::fragment(client, dtype) {
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
