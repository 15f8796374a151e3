//! Attention with the arguments and semantics of `burn::tensor::module::attention` (burn
//! 0.21): [`attention`].
//!
//! `out = softmax(S)·V` with `S = scale·Q·Kᵀ`, then, in this order (Burn's fallback's): softcap
//! `c·tanh(S/c)`, the bool mask (`true` = masked out, −inf), the causal mask (bottom-right
//! aligned when `Sq ≠ Sk`: query `i` sees keys `j ≤ i + Sk − Sq`), the additive bias. A row with
//! no visible key gives zeros, never NaN.
//!
//! Beyond Burn's op: grouped-query attention (`key`/`value` with `Hkv` heads, `Hkv` dividing
//! `Hq`; query head `h` reads key/value head `h / (Hq / Hkv)`, nothing is repeated in memory),
//! masks and biases broadcast over batch, heads and query positions (dims of size 1), and
//! `Sq ≠ Sk`, `Dv ≠ D`.
//!
//! **What runs.** On CubeCL backends (CUDA, wgpu, and `Fusion` over them) one fused kernel
//! computes the scores on chip and never writes them
//! ([`burn_flash_kernels::attention`]): FlashAttention-2's schedule on the matrix units for
//! f16/bf16 on CUDA, a plain-unit kernel for f32 and on wgpu. Memory is the inputs, the output
//! and one f32 log-sum-exp per query row. A bool mask is converted to the query's float type
//! first (one element per mask element, at the mask's own broadcast shape).
//!
//! **Gradients.** Under `Autodiff<B>` the forward runs `B`'s kernel and keeps its inputs, output
//! and log-sum-exp (nothing `Sq × Sk`); the backward is
//! [`AttentionBackend::flash_attention_backward`](crate::AttentionBackend::flash_attention_backward):
//! FlashAttention-2's schedule on CubeCL backends ([`burn_flash_kernels::flash::backward`]: plain
//! units, and the matrix units for f16/bf16 on CUDA), the gradient composed from stock ops on NdArray (`composed::backward`). A tracked
//! bias gets `dS` summed over its broadcast dimensions. Dropout on the weights:
//! [`FlashAttentionOptions::dropout`].

pub(crate) mod autodiff;
pub(crate) mod backend;
pub mod composed;
pub(crate) mod cube;
pub(crate) mod fusion;
mod operands;
mod paged;
mod varlen;

pub use operands::{AttentionInputs, HeadOperands, KvCache, NewKeys, ScoreOperands};
pub use paged::{
    AppendDecoded, Appended, BlockTable, PagedAppend, Rope, RopeArgs, append_attention_paged,
    append_paged, attention_paged,
};
pub use varlen::{VarlenBatch, attention_varlen};

use burn::tensor::{
    Bool, DType, Int, Tensor, TensorPrimitive,
    backend::Backend,
    ops::{AttentionModuleOptions, FloatTensor},
};

pub use burn_flash_kernels::dropout::DropoutParams;

pub use burn_flash_kernels::attention::{
    AmpereTile, AmpereUse, AttentionBackwardKernel, AttentionBackwardPlan, AttentionDims,
    AttentionError, AttentionKernel, AttentionPlan, BackwardLaunch, BackwardOverlap,
    DecodeSchedule, HopperUse, MAX_HEAD_DIM, TileSchedule, recent_backward_launches,
};

/// The gradients of one attention call
/// ([`AttentionBackend::flash_attention_backward`](crate::AttentionBackend::flash_attention_backward)).
#[derive(Debug)]
pub struct AttentionGrads<B: Backend> {
    /// Of the queries, `[B, Hq, Sq, D]`.
    pub dq: FloatTensor<B>,
    /// Of the keys, `[B, Hkv, Sk, D]` (summed over each group's query heads).
    pub dk: FloatTensor<B>,
    /// Of the values, `[B, Hkv, Sk, Dv]`.
    pub dv: FloatTensor<B>,
    /// Of every score, `[B, Hq, Sq, Sk]`, where asked for: a bias's gradient is its sum over
    /// the bias's broadcast dimensions.
    pub ds: Option<FloatTensor<B>>,
}

use crate::FlashBackend;

const OP: &str = "burn_flash::attention";

/// Per-head inputs of an attention call beyond Burn's arguments
/// ([`attention_with_heads`]), each `[Hq]`, any float dtype (read as f32).
#[derive(Debug, Clone)]
pub struct HeadTerms<B: Backend> {
    /// ALiBi slopes: head `h`'s scores gain `−slopes[h]·|i + Sk − Sq − j|`
    /// ([`attention_with_alibi`]). No gradient flows to them.
    pub alibi_slopes: Option<Tensor<B, 1>>,
    /// Attention sinks (gpt-oss): head `h`'s rows divide by `e^sinks[h] + Σ e^s`, a learned
    /// logit with no value (a row may put weight on "nothing"); the returned log-sum-exp
    /// includes it. Tracked under `Autodiff`: `dSinks[h] = −Σ_rows e^(sinks[h] − lse)·δ`,
    /// `δ = rowsum(dO ⊙ O)`.
    pub sinks: Option<Tensor<B, 1>>,
}

impl<B: Backend> Default for HeadTerms<B> {
    fn default() -> Self {
        Self {
            alibi_slopes: None,
            sinks: None,
        }
    }
}

/// Burn's attention options plus burn-flash's overrides.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FlashAttentionOptions {
    /// Scale, softcap, causal: Burn's own options type.
    pub module: AttentionModuleOptions,
    /// Force a kernel (the default is the heuristic's); a kernel the device or call cannot
    /// run panics with the reason before any launch.
    pub kernel: Option<AttentionKernel>,
    /// Force the keys per online-softmax step (see
    /// [`burn_flash_kernels::attention::AttentionOptions::block_k`]).
    pub block_k: Option<usize>,
    /// Dropout on the attention weights, `P̃ = P ⊙ keep / (1 − p)` (PyTorch's and
    /// FlashAttention's semantics), in the forward and, with the same mask, the backward.
    /// `None` or a probability of 0: no dropout (bit-identical results).
    pub dropout: Option<AttentionDropout>,
    /// The score a key masked by the bool mask takes, instead of leaving the softmax: burn-nn's
    /// `mask_fill(mask, min_float)` (its `MultiHeadAttention` fills with −1e4). The key stays in
    /// the softmax, so a fully masked row gets uniform weights (the mean of the values) where
    /// `None` gives zeros; its score is a constant, so no gradient reaches `Q`, `K` or a bias
    /// through it. It replaces the finished score (after scale, softcap and bias); the causal
    /// mask still removes keys. Finite.
    pub masked_score: Option<f64>,
    /// Quiet softmax, `e^s / (1 + Σ e^s)` (burn's `quiet_softmax`, burn-nn's `quiet_softmax`
    /// option): a row may attend to nothing. The log-sum-exp returned is then `ln(1 + Σ e^s)`.
    pub quiet: bool,
    /// Sliding-window (local) attention `(left, right)`: query `i` sees keys `i + Sk − Sq −
    /// left ..= i + Sk − Sq + right` (bottom-right aligned like the causal mask; with
    /// `is_causal` the right side is 0, so `(w − 1, 0)` is Mistral's window of `w` keys). The
    /// kernels skip key blocks outside every row's window (forward and backward) rather than
    /// mask them. A side wider than the sequence sees every key on that side.
    pub window: Option<(usize, usize)>,
    /// How the plan uses the Hopper kernels (`None`: [`crate::plan_defaults`]'s).
    pub hopper: Option<HopperUse>,
    /// How the Hopper forward's blocks take its tiles, and whether the Hopper backward's are
    /// persistent ([`TileSchedule`]; `None`: [`crate::plan_defaults`]'s).
    pub schedule: Option<TileSchedule>,
    /// The decoding kernel's schedule (`None`: [`crate::plan_defaults`]'s).
    pub decode: Option<DecodeSchedule>,
    /// The backward returns the same bits on every run (`None`: [`crate::plan_defaults`]'s):
    /// on Hopper its `dQ` adds run in a fixed order, at a cost (RESULTS.md); every other
    /// backward is deterministic anyway
    /// ([`burn_flash_kernels::attention::AttentionOptions::deterministic`]).
    pub deterministic: Option<bool>,
    /// How the Hopper backward's consumers meet over a step's `dSᵀ` (`None`:
    /// [`crate::plan_defaults`]'s).
    pub backward_overlap: Option<BackwardOverlap>,
    /// How the plan uses the Ampere backward (FlashAttention-2's data flow, hand-written for
    /// CUDA sm_80+; `None`: [`crate::plan_defaults`]'s, where the Hopper backward does not take
    /// the call) ([`burn_flash_kernels::attention::AttentionOptions::ampere_backward`]).
    pub ampere_backward: Option<AmpereUse>,
    /// The Ampere backward's block shape (`None`: [`crate::plan_defaults`]'s, the measured
    /// best) ([`burn_flash_kernels::attention::AttentionOptions::ampere_tile`]).
    pub ampere_tile: Option<AmpereTile>,
    /// f32 attention may run its products on the tensor cores as TF32 (10 mantissa bits, f32
    /// accumulators; torch's `allow_tf32`), forward and backward, on CUDA sm_80+ (`None`:
    /// [`crate::plan_defaults`]'s, off: exact f32) — a permission: other devices stay exact
    /// ([`burn_flash_kernels::attention::AttentionOptions::tf32`]; the error it costs: docs/usage.md).
    pub tf32: Option<bool>,
}

/// Dropout of [`FlashAttentionOptions`]: each weight is kept with probability `1 − prob`,
/// drawn by a counter-based generator keyed by `seed` and the weight's (batch, query head,
/// query position, key) ([`burn_flash_kernels::dropout`]). The same seed draws the same mask
/// on every backend and in every kernel; nothing of size `Sq × Sk` is stored. A training loop
/// passes a new seed for every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionDropout {
    /// Probability of dropping a weight, in `[0, 1)`.
    pub prob: f64,
    /// The generator's seed.
    pub seed: u64,
}

impl AttentionDropout {
    /// The kernels' parameters, `None` when `prob` is 0.
    pub fn params(&self) -> Option<DropoutParams> {
        (self.prob > 0.0).then(|| DropoutParams::new(self.prob, self.seed))
    }
}

impl From<AttentionModuleOptions> for FlashAttentionOptions {
    fn from(module: AttentionModuleOptions) -> Self {
        Self {
            module,
            ..Default::default()
        }
    }
}

/// Attention as `burn::tensor::module::attention`, with grouped-query heads and broadcast masks
/// and biases (module docs).
///
/// Shapes: `query` `[B, Hq, Sq, D]`, `key` `[B, Hkv, Sk, D]`, `value` `[B, Hkv, Sk, Dv]`, `mask`
/// and `attn_bias` `[B or 1, Hq or 1, Sq or 1, Sk]`, output `[B, Hq, Sq, Dv]`. Any strides: the
/// `[B, S, H, D].swap_dims(1, 2)` tensors of an attention layer are taken as they are.
/// Head dims up to [`MAX_HEAD_DIM`].
///
/// # Panics
/// Before anything runs, with a message naming the argument: head dims of `query` and `key`
/// differ; `key` and `value` disagree on batch, heads or positions; `query`'s batch differs;
/// `Hq` is not a multiple of `Hkv`; a mask or bias shape that does not broadcast; dtypes that
/// differ; tensors on different devices; a softcap that is not positive or a scale that is not
/// finite; a head dim above [`MAX_HEAD_DIM`] on a backend with the fused kernels.
///
/// ```no_run
/// use burn::backend::Wgpu;
/// use burn::tensor::{Distribution, Tensor, ops::AttentionModuleOptions};
///
/// let device = Default::default();
/// let q = Tensor::<Wgpu, 4>::random([2, 8, 128, 64], Distribution::Default, &device);
/// let k = Tensor::<Wgpu, 4>::random([2, 2, 128, 64], Distribution::Default, &device);
/// let v = Tensor::<Wgpu, 4>::random([2, 2, 128, 64], Distribution::Default, &device);
/// let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
/// let out = burn_flash::attention(q, k, v, None, None, options); // [2, 8, 128, 64]
/// ```
pub fn attention<B: FlashBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    options: AttentionModuleOptions,
) -> Tensor<B, 4> {
    attention_with_lse(query, key, value, mask, attn_bias, options.into()).0
}

/// [`attention`] with burn-flash's overrides, returning the output and the row log-sum-exp of
/// the scores (`[B, Hq, Sq]`, f32; −inf for a row without a visible key).
pub fn attention_with_lse<B: FlashBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    options: FlashAttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    attention_with_alibi(query, key, value, mask, attn_bias, None, options)
}

/// [`attention_with_lse`] with ALiBi computed in the kernel from per-head slopes
/// `alibi_slopes` (`[Hq]`, any float dtype, read as f32): the score of query `i` and key `j` of
/// head `h` gains `−slopes[h]·|i + Sk − Sq − j|` after the bias (FlashAttention's and BLOOM's
/// ALiBi; under a causal mask, `slope·(j − i)` for the keys a row sees). No `[B, H, Sq, Sk]`
/// tensor is made and no gradient flows to the slopes.
///
/// # Panics
/// As [`attention`], and when `alibi_slopes` is not `[Hq]` or on another device.
pub fn attention_with_alibi<B: FlashBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    alibi_slopes: Option<Tensor<B, 1>>,
    options: FlashAttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let heads = HeadTerms {
        alibi_slopes,
        sinks: None,
    };
    attention_with_heads(query, key, value, mask, attn_bias, heads, options)
}

/// [`attention_with_lse`] with per-head terms: ALiBi slopes and attention sinks
/// ([`HeadTerms`]).
///
/// # Panics
/// As [`attention`], and when a per-head tensor is not `[Hq]`, not a float, or on another
/// device.
pub fn attention_with_heads<B: FlashBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    heads: HeadTerms<B>,
    options: FlashAttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    attention_checked(query, key, value, mask, attn_bias, heads, None, options)
}

/// [`attention_with_heads`] of a call whose one batch may be packed sequences `seqs`
/// ([`VarlenBatch`], whose values the caller checked).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_checked<B: FlashBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    heads: HeadTerms<B>,
    seqs: Option<Tensor<B, 1, Int>>,
    options: FlashAttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let HeadTerms {
        alibi_slopes,
        sinks,
    } = heads;
    let dims = check_attention(
        &query,
        &key,
        &value,
        mask.as_ref(),
        attn_bias.as_ref(),
        options.module,
    );
    if let Some(slopes) = &alibi_slopes {
        check_per_head("alibi_slopes", slopes, dims.heads_q, &query.device());
    }
    if let Some(sinks) = &sinks {
        check_per_head("sinks", sinks, dims.heads_q, &query.device());
    }
    if let Some(dropout) = options.dropout
        && !(0.0..1.0).contains(&dropout.prob)
    {
        panic!(
            "{OP}: dropout probability must be in [0, 1), got {}",
            dropout.prob
        );
    }
    if let Some(fill) = options.masked_score
        && !fill.is_finite()
    {
        panic!("{OP}: `masked_score` must be finite, got {fill}");
    }
    let (device, dtype) = (query.device(), query.dtype());
    let f32_head = |t: Tensor<B, 1>| t.cast(DType::F32).into_primitive().tensor();
    let inputs = AttentionInputs {
        query: query.into_primitive().tensor(),
        key: key.into_primitive().tensor(),
        value: value.into_primitive().tensor(),
        scores: ScoreOperands {
            mask: mask.map(|m| m.into_primitive()),
            bias: attn_bias.map(|b| b.into_primitive().tensor()),
            heads: HeadOperands {
                slopes: alibi_slopes.map(f32_head),
                sinks: sinks.map(f32_head),
            },
            seqs: seqs.map(|s| s.into_primitive()),
        },
    };
    let terms = inputs.scores.terms();
    if let Some(planner) = B::flash_planner(&device)
        && let Err(err) = planner.attention(dims, dtype, options, terms)
    {
        panic!("{OP}: {err}");
    }
    let (out, lse) = B::flash_attention(inputs, options);
    (
        Tensor::from_primitive(TensorPrimitive::Float(out)),
        Tensor::from_primitive(TensorPrimitive::Float(lse)),
    )
}

/// Checks a per-head tensor `name` against `Hq` heads on `device`; panics with a message
/// naming it.
pub(crate) fn check_per_head<B: Backend>(
    name: &str,
    t: &Tensor<B, 1>,
    heads_q: usize,
    device: &B::Device,
) {
    let [n] = t.dims();
    if n != heads_q {
        panic!("{OP}: `{name}` has shape [{n}], expected [{heads_q}] (one per query head)");
    }
    if !matches!(
        t.dtype(),
        DType::F32 | DType::F16 | DType::BF16 | DType::F64
    ) {
        panic!(
            "{OP}: `{name}` has dtype {:?}; a float type is expected",
            t.dtype()
        );
    }
    let other = t.device();
    if &other != device {
        panic!("{OP}: `{name}` is on {other:?}, `query` on {device:?}");
    }
}

/// The score terms a call passes, which the plans depend on: a mask, a bias, and whether the
/// bias is tracked (its gradient then sums a written `dS`, which only some backward kernels
/// write).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScoreTerms {
    /// A bool mask is given.
    pub mask: bool,
    /// A bias is given.
    pub bias: bool,
    /// The bias is tracked (meaningless without one).
    pub bias_tracked: bool,
    /// The bias is broadcast along the query rows (`[·, ·, 1, Sk]`; meaningless without one);
    /// otherwise it has rows of its own.
    pub bias_rows_broadcast: bool,
    /// ALiBi slopes are given.
    pub alibi: bool,
    /// Attention sinks are given.
    pub sinks: bool,
    /// The call is a packed variable-length batch ([`attention_varlen`]).
    pub varlen: bool,
}

/// The launch the fused attention would make on `device` for contiguous tensors of `dims`
/// without a mask or bias: the kernel ([`AttentionKernel`]), its tiles and grid (`None`: the
/// backend uses the composed fallback, e.g. NdArray; under `Autodiff<B>`, `B`'s plan).
pub fn attention_plan<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
) -> Option<Result<AttentionPlan, AttentionError>> {
    attention_plan_with::<B>(device, dims, dtype, options, ScoreTerms::default())
}

/// [`attention_plan`] for a call with the score terms `terms` (the plan may pick another
/// kernel for a mask or a bias).
pub fn attention_plan_with<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
    terms: ScoreTerms,
) -> Option<Result<AttentionPlan, AttentionError>> {
    B::flash_planner(device).map(|p| p.attention(dims, dtype, options, terms))
}

/// The launch the fused attention backward would make on `device` for contiguous tensors of
/// `dims`, with or without a `mask` and a (tracked) `bias` (`None`: the backend computes
/// gradients with the composed fallback, e.g. NdArray). Under `Autodiff<B>` this is `B`'s
/// plan: the backward `Autodiff<B>` runs.
pub fn attention_backward_plan<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
    mask: bool,
    bias: bool,
) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
    let terms = ScoreTerms {
        mask,
        bias,
        bias_tracked: bias,
        bias_rows_broadcast: false,
        alibi: false,
        sinks: false,
        varlen: false,
    };
    attention_backward_plan_with::<B>(device, dims, dtype, options, terms)
}

/// [`attention_backward_plan`] for a call with the score terms `terms`, the bias tracked or
/// not.
pub fn attention_backward_plan_with<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
    terms: ScoreTerms,
) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
    B::flash_planner(device).map(|p| p.attention_backward(dims, dtype, options, terms))
}

/// The scale of the scores: the option, or `1/√D`.
pub(crate) fn scale_of(options: &AttentionModuleOptions, head_dim: usize) -> f64 {
    options
        .scale
        .unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt())
}

/// Checks the score scalars of `options` (the scale finite, the softcap positive and finite);
/// panics naming `op` and the option otherwise.
pub(crate) fn check_scalars(op: &str, options: &AttentionModuleOptions) {
    if let Some(cap) = options.softcap
        && !(cap > 0.0 && cap.is_finite())
    {
        panic!("{op}: `softcap` must be positive and finite, got {cap}");
    }
    if let Some(scale) = options.scale
        && !scale.is_finite()
    {
        panic!("{op}: `scale` must be finite, got {scale}");
    }
}

/// Checks every argument of [`attention`] and returns the call's sizes; panics with a message
/// naming the argument otherwise.
pub fn check_attention<B: Backend>(
    query: &Tensor<B, 4>,
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    mask: Option<&Tensor<B, 4, Bool>>,
    attn_bias: Option<&Tensor<B, 4>>,
    options: AttentionModuleOptions,
) -> AttentionDims {
    let [batch, heads_q, seq_q, head_dim] = query.dims();
    let [kb, heads_kv, seq_k, kd] = key.dims();
    let [vb, vh, vs, value_dim] = value.dims();
    if kd != head_dim {
        panic!(
            "{OP}: `key` has head dim {kd}, `query` has {head_dim} (query {:?}, key {:?})",
            query.dims(),
            key.dims()
        );
    }
    if kb != batch {
        panic!("{OP}: `key` has batch {kb}, `query` has {batch}");
    }
    if [vb, vh, vs] != [kb, heads_kv, seq_k] {
        panic!(
            "{OP}: `value` {:?} must have the batch, heads and positions of `key` {:?}",
            value.dims(),
            key.dims()
        );
    }
    if heads_kv == 0 || heads_q % heads_kv != 0 {
        panic!(
            "{OP}: `query` has {heads_q} heads, not a multiple of the {heads_kv} heads of `key`/`value`"
        );
    }
    let full = [batch, heads_q, seq_q, seq_k];
    let broadcasts = |shape: [usize; 4]| {
        shape[3] == seq_k && (0..3).all(|d| shape[d] == full[d] || shape[d] == 1)
    };
    if let Some(mask) = mask
        && !broadcasts(mask.dims())
    {
        panic!(
            "{OP}: `mask` has shape {:?}, expected [{batch} or 1, {heads_q} or 1, {seq_q} or 1, {seq_k}]",
            mask.dims()
        );
    }
    if let Some(bias) = attn_bias
        && !broadcasts(bias.dims())
    {
        panic!(
            "{OP}: `attn_bias` has shape {:?}, expected [{batch} or 1, {heads_q} or 1, {seq_q} or 1, {seq_k}]",
            bias.dims()
        );
    }
    let dtype = query.dtype();
    let float_ok = matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
    if !float_ok {
        panic!("{OP}: `query` has dtype {dtype:?}; supported: F32, F16, BF16");
    }
    for (name, other) in [("key", key.dtype()), ("value", value.dtype())]
        .into_iter()
        .chain(attn_bias.map(|b| ("attn_bias", b.dtype())))
    {
        if other != dtype {
            panic!("{OP}: `{name}` has dtype {other:?}, `query` has {dtype:?}");
        }
    }
    let device = query.device();
    let devices = [("key", key.device()), ("value", value.device())]
        .into_iter()
        .chain(mask.map(|m| ("mask", m.device())))
        .chain(attn_bias.map(|b| ("attn_bias", b.device())));
    for (name, other) in devices {
        if other != device {
            panic!("{OP}: `{name}` is on {other:?}, `query` on {device:?}");
        }
    }
    check_scalars(OP, &options);
    AttentionDims {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
    }
}
