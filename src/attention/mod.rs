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
//! **What runs today.** The scores are composed from stock Burn ops (one batched matmul per
//! key/value head group, the softcap, masks and bias as element-wise ops), and `softmax(S)·V`
//! is burn-flash's fused [`softmax_matmul`](fn@crate::softmax_matmul) (the probabilities are never
//! written; fully masked rows give zeros; fused backward under `Autodiff`). So memory is one
//! `B·Hq·Sq·Sk` score tensor, not the `O(B·H·Sq)` of a flash kernel: the fused attention
//! kernels that never write the scores are not in this release yet.

use burn::tensor::{Bool, DType, Int, Tensor, backend::Backend, ops::AttentionModuleOptions};

use crate::{FlashBackend, softmax_matmul};

const OP: &str = "burn_flash::attention";

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Head dim of values (and of the output).
    pub value_dim: usize,
}

/// Attention as `burn::tensor::module::attention`, with grouped-query heads and broadcast masks
/// and biases (module docs).
///
/// Shapes: `query` `[B, Hq, Sq, D]`, `key` `[B, Hkv, Sk, D]`, `value` `[B, Hkv, Sk, Dv]`, `mask`
/// and `attn_bias` `[B or 1, Hq or 1, Sq or 1, Sk]`, output `[B, Hq, Sq, Dv]`. Any strides: the
/// `[B, S, H, D].swap_dims(1, 2)` tensors of an attention layer are taken as they are.
///
/// # Panics
/// Before anything runs, with a message naming the argument: head dims of `query` and `key`
/// differ; `key` and `value` disagree on batch, heads or positions; `query`'s batch differs;
/// `Hq` is not a multiple of `Hkv`; a mask or bias shape that does not broadcast; dtypes that
/// differ; tensors on different devices; a softcap that is not positive or a scale that is not
/// finite.
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
    let dims = check_attention(
        &query,
        &key,
        &value,
        mask.as_ref(),
        attn_bias.as_ref(),
        options,
    );
    let AttentionDims {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
    } = dims;
    let group = heads_q / heads_kv;
    let scale = options
        .scale
        .unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt());
    // The query heads of a group share one key/value head: [B, Hkv, G·Sq, D] · [B, Hkv, D, Sk].
    let q = query.reshape([batch, heads_kv, group * seq_q, head_dim]);
    let mut scores = q
        .matmul(key.swap_dims(2, 3))
        .mul_scalar(scale)
        .reshape([batch, heads_q, seq_q, seq_k]);
    if let Some(cap) = options.softcap {
        // Before any −inf: tanh would map −inf to a finite value.
        scores = scores.div_scalar(cap).tanh().mul_scalar(cap);
    }
    let full = [batch, heads_q, seq_q, seq_k];
    if let Some(mask) = mask {
        scores = scores.mask_fill(mask.expand(full), f32::NEG_INFINITY);
    }
    if options.is_causal {
        let causal = causal_mask::<B>(&dims, &scores.device());
        scores = scores.mask_fill(causal, f32::NEG_INFINITY);
    }
    if let Some(bias) = attn_bias {
        scores = scores + bias.expand(full);
    }
    let scores = scores.reshape([batch, heads_kv, group * seq_q, seq_k]);
    softmax_matmul(scores, value).reshape([batch, heads_q, seq_q, value_dim])
}

/// `true` where key `j` is after query `i` in the bottom-right aligned causal order
/// (`j > i + Sk − Sq`), expanded to `[B, Hq, Sq, Sk]`.
fn causal_mask<B: Backend>(dims: &AttentionDims, device: &B::Device) -> Tensor<B, 4, Bool> {
    let (seq_q, seq_k) = (dims.seq_q, dims.seq_k);
    let offset = seq_k as i64 - seq_q as i64;
    let rows = Tensor::<B, 1, Int>::arange(0..seq_q as i64, device)
        .add_scalar(offset)
        .reshape([seq_q, 1])
        .expand([seq_q, seq_k]);
    let cols = Tensor::<B, 1, Int>::arange(0..seq_k as i64, device)
        .reshape([1, seq_k])
        .expand([seq_q, seq_k]);
    cols.greater(rows).reshape([1, 1, seq_q, seq_k]).expand([
        dims.batch,
        dims.heads_q,
        seq_q,
        seq_k,
    ])
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
    if let Some(cap) = options.softcap
        && !(cap > 0.0 && cap.is_finite())
    {
        panic!("{OP}: `softcap` must be positive and finite, got {cap}");
    }
    if let Some(scale) = options.scale
        && !scale.is_finite()
    {
        panic!("{OP}: `scale` must be finite, got {scale}");
    }
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
