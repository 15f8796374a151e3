//! The composed attention: the scores from stock Burn ops, then burn-flash's fused
//! `softmax(S)·V` (which never writes the probabilities and gives fully masked rows zeros).
//! The provided bodies of [`crate::AttentionBackend::flash_attention`] (`forward`) and of
//! its backward (`backward`): what NdArray (and any backend without the kernels) runs, also
//! under `Autodiff`. It materialises the `B·Hq·Sq·Sk` scores (with dropout, the weights and the
//! mask drawn on the host by the kernels' generator).

use burn::tensor::{
    Bool, Int, Tensor, TensorPrimitive,
    backend::Backend,
    ops::{AttentionModuleOptions, BoolTensor, FloatTensor, IntTensor},
};

use super::operands::AttentionInputs;
use super::{FlashAttentionOptions, scale_of};
use crate::SoftmaxMatmulBackend;
use burn_flash_kernels::dropout::{DropoutParams, keep};

/// `(out, lse)` of attention from stock ops and the fused `softmax(S)·V`; arguments checked by
/// the caller.
pub(crate) fn forward<B: SoftmaxMatmulBackend>(
    mut inputs: AttentionInputs<B>,
    flash_options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let sinks = inputs.scores.heads.sinks.take();
    let (out, lse) = forward_without_sinks::<B>(inputs, flash_options);
    match sinks {
        Some(sinks) => sink_outputs::<B>(out, lse, sinks),
        None => (out, lse),
    }
}

/// [`forward`] without attention sinks (its `sinks` are not read).
fn forward_without_sinks<B: SoftmaxMatmulBackend>(
    inputs: AttentionInputs<B>,
    flash_options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (query, key, value, scores) = (inputs.query, inputs.key, inputs.value, inputs.scores);
    let (mask, slopes) = (scores.mask, scores.heads.slopes);
    let options = flash_options.module;
    let packed = Packed::read::<B>(scores.seqs);
    let bias = with_alibi::<B>(&query, &key, scores.bias, slopes, packed.as_ref());
    let query = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(query));
    let key = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(key));
    let value = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(value));
    let [batch, heads_q, seq_q, head_dim] = query.dims();
    let [_, heads_kv, seq_k, _] = key.dims();
    let value_dim = value.dims()[3];
    if batch * heads_q * seq_q * value_dim == 0 || seq_k == 0 {
        // Nothing to multiply (some backends' matmuls cannot take empty dims): no key is
        // visible, so zeros and lse = −inf.
        let device = query.device();
        let dtype = query.dtype();
        let out = Tensor::<B, 4>::zeros([batch, heads_q, seq_q, value_dim], (&device, dtype));
        let lse = Tensor::<B, 3>::full(
            [batch, heads_q, seq_q],
            f32::NEG_INFINITY,
            (&device, burn::tensor::DType::F32),
        );
        return (out.into_primitive().tensor(), lse.into_primitive().tensor());
    }
    if let Some(dropout) = flash_options.dropout.and_then(|d| d.params()) {
        let (q, k, v) = (
            query.into_primitive().tensor(),
            key.into_primitive().tensor(),
            value,
        );
        let v = v.into_primitive().tensor();
        let terms = (mask, bias, packed.as_ref());
        let (out, lse) = forward_with_dropout::<B>(q, k, v, terms, flash_options, dropout);
        return quiet_outputs::<B>(out, lse, flash_options.quiet);
    }
    let group = heads_q / heads_kv;
    let scale = scale_of(&options, head_dim);
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
    if let Some(bias) = bias {
        let bias = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(bias));
        scores = scores + bias.expand(full);
    }
    if let Some(mask) = mask {
        // The finished score of a masked key: the fill score, or −inf (out of the softmax).
        let mask = Tensor::<B, 4, Bool>::from_primitive(mask);
        let fill = flash_options.masked_score.unwrap_or(f64::NEG_INFINITY);
        scores = scores.mask_fill(mask.expand(full), fill);
    }
    if let Some(hidden) = range_mask::<B>(full, &flash_options, packed.as_ref(), &scores.device()) {
        scores = scores.mask_fill(hidden, f32::NEG_INFINITY);
    }
    let scores = scores.reshape([batch * heads_kv, group * seq_q, seq_k]);
    let value = value.reshape([batch * heads_kv, seq_k, value_dim]);
    let (out, lse) = B::flash_softmax_matmul(
        scores.into_primitive().tensor(),
        value.into_primitive().tensor(),
        Default::default(),
    );
    let out = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
        .reshape([batch, heads_q, seq_q, value_dim]);
    let lse = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(lse))
        .reshape([batch, heads_q, seq_q]);
    quiet_outputs::<B>(
        out.into_primitive().tensor(),
        lse.into_primitive().tensor(),
        flash_options.quiet,
    )
}

/// The quiet softmax's `(out, lse)` from the softmax's (`quiet`; the pair itself otherwise):
/// with `L = ln Σ e^s`, the output times `σ(L) = Σ e^s / (1 + Σ e^s)` and `ln(1 + Σ e^s) =
/// softplus(L)`, both written so that a row without a visible key (`L = −inf`) gives 0 and 0.
fn quiet_outputs<B: Backend>(
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    quiet: bool,
) -> (FloatTensor<B>, FloatTensor<B>) {
    if !quiet {
        return (out, lse);
    }
    let out = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out));
    let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse));
    let sigma = lse.clone().neg().exp().add_scalar(1.0).recip();
    let sigma = sigma.cast(out.dtype()).unsqueeze_dim::<4>(3);
    let out = out * sigma;
    let lse = lse.clone().clamp_min(0.0) + lse.abs().neg().exp().add_scalar(1.0).log();
    (out.into_primitive().tensor(), lse.into_primitive().tensor())
}

/// The outputs with attention sinks `sinks` (`[Hq]`, f32) from those without, `(out, L)`: the
/// sink joins each row's denominator, so the output is scaled by `σ(L − sink)` and the
/// log-sum-exp becomes `ln(e^L + e^sink)` (a row without a visible key: 0 and `sink`).
fn sink_outputs<B: Backend>(
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    sinks: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let out = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out));
    let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse));
    let heads = out.dims()[1];
    let sinks = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sinks))
        .cast(burn::tensor::DType::F32)
        .reshape([1, heads, 1]);
    // σ(L − s) = 1 / (1 + e^(s − L)): 0 for L = −inf.
    let scale = (sinks.clone() - lse.clone()).exp().add_scalar(1.0).recip();
    let dtype = out.dtype();
    let out = out * scale.cast(dtype).unsqueeze_dim::<4>(3);
    let hi = lse.clone().max_pair(sinks.clone().expand(lse.dims()));
    let lo = lse.min_pair(sinks.expand(hi.dims()));
    let lse = hi.clone() + (lo - hi).exp().add_scalar(1.0).log();
    (out.into_primitive().tensor(), lse.into_primitive().tensor())
}

/// A packed variable-length batch's cumulative lengths ([`crate::VarlenBatch`]), read to the
/// host.
pub(crate) struct Packed {
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
}

impl Packed {
    /// The sequences of `seqs` (`[2·(n + 1)]`: `cu_q`, then `cu_k`), read (a device sync).
    fn read<B: Backend>(seqs: Option<IntTensor<B>>) -> Option<Self> {
        let seqs = Tensor::<B, 1, Int>::from_primitive(seqs?);
        let all: Vec<i64> = seqs
            .into_data()
            .convert::<i64>()
            .to_vec()
            .expect("integer sequences");
        let n = all.len() / 2;
        let cu = |s: &[i64]| s.iter().map(|&x| x as usize).collect();
        Some(Self {
            cu_q: cu(&all[..n]),
            cu_k: cu(&all[n..]),
        })
    }

    /// For query position `i`: its sequence's keys `k0 .. k1` and its diagonal key `i + k1 −
    /// q1` (bottom-right aligned within the sequence).
    fn row(&self, i: usize) -> (usize, usize, i64) {
        let b = self.cu_q.partition_point(|&q| q <= i).saturating_sub(1);
        let b = b.min(self.cu_q.len() - 2);
        let (k0, k1) = (self.cu_k[b], self.cu_k[b + 1]);
        (k0, k1, i as i64 + k1 as i64 - self.cu_q[b + 1] as i64)
    }
}

/// `true` where key `j` is after query `i` in the bottom-right aligned causal order
/// (`j > i + Sk − Sq`), expanded to `full` = `[B, Hq, Sq, Sk]`.
pub fn causal_mask<B: Backend>(full: [usize; 4], device: &B::Device) -> Tensor<B, 4, Bool> {
    diagonal_offsets::<B>(full, None, device)
        .greater_elem(0)
        .reshape([1, 1, full[2], full[3]])
        .expand(full)
}

/// `j − (i + Sk − Sq)` for query `i` and key `j`: each key's offset from the row's
/// bottom-right aligned diagonal, `[Sq, Sk]` (packed sequences: from the diagonal within the
/// row's sequence, [`Packed::row`]).
fn diagonal_offsets<B: Backend>(
    full: [usize; 4],
    packed: Option<&Packed>,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let (seq_q, seq_k) = (full[2], full[3]);
    if let Some(p) = packed {
        let values: Vec<i64> = (0..seq_q)
            .flat_map(|i| {
                let a = p.row(i).2;
                (0..seq_k).map(move |j| j as i64 - a)
            })
            .collect();
        let data = burn::tensor::TensorData::new(values, [seq_q, seq_k]);
        return Tensor::<B, 2, Int>::from_data(data, device);
    }
    let offset = seq_k as i64 - seq_q as i64;
    let rows = Tensor::<B, 1, Int>::arange(0..seq_q as i64, device)
        .add_scalar(offset)
        .reshape([seq_q, 1])
        .expand([seq_q, seq_k]);
    let cols = Tensor::<B, 1, Int>::arange(0..seq_k as i64, device)
        .reshape([1, seq_k])
        .expand([seq_q, seq_k]);
    cols - rows
}

/// `true` where the causal mask, the sliding window of `options` or packed sequences hide key
/// `j` from query `i` (`None`: none is asked for), expanded to `full` = `[B, Hq, Sq, Sk]`.
pub(crate) fn range_mask<B: Backend>(
    full: [usize; 4],
    options: &FlashAttentionOptions,
    packed: Option<&Packed>,
    device: &B::Device,
) -> Option<Tensor<B, 4, Bool>> {
    let causal = options.module.is_causal;
    if !causal && options.window.is_none() && packed.is_none() {
        return None;
    }
    let d = diagonal_offsets::<B>(full, packed, device);
    let limit = |w: usize| w.min(full[2] + full[3]) as i64;
    let mut right = i64::MAX;
    let mut hidden = match packed {
        // Keys of other sequences.
        Some(p) => {
            let (seq_q, seq_k) = (full[2], full[3]);
            let outside: Vec<bool> = (0..seq_q)
                .flat_map(|i| {
                    let (k0, k1, _) = p.row(i);
                    (0..seq_k).map(move |j| j < k0 || j >= k1)
                })
                .collect();
            let data = burn::tensor::TensorData::new(outside, [seq_q, seq_k]);
            Tensor::<B, 2, Bool>::from_data(data, device)
        }
        None => d.clone().lower_elem(i64::MIN + 1),
    };
    if let Some((l, r)) = options.window {
        right = limit(r);
        hidden = hidden.bool_or(d.clone().lower_elem(-limit(l)));
    }
    if causal {
        right = 0;
    }
    if right < i64::MAX {
        hidden = hidden.bool_or(d.greater_elem(right));
    }
    Some(hidden.reshape([1, 1, full[2], full[3]]).expand(full))
}

/// The bias with the ALiBi term of `slopes` (`[Hq]`) added, `−slopes[h]·|j − (i + Sk − Sq)|`,
/// in the queries' dtype (`bias` itself without slopes; the term alone without a bias). Of
/// shape `[B or 1, Hq, Sq, Sk]`.
fn with_alibi<B: Backend>(
    query: &FloatTensor<B>,
    key: &FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    slopes: Option<FloatTensor<B>>,
    packed: Option<&Packed>,
) -> Option<FloatTensor<B>> {
    let Some(slopes) = slopes else {
        return bias;
    };
    let q = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(query.clone()));
    let [batch, heads_q, seq_q, _] = q.dims();
    let seq_k = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(key.clone())).dims()[2];
    let device = q.device();
    let full = [batch, heads_q, seq_q, seq_k];
    let distance = diagonal_offsets::<B>(full, packed, &device)
        .abs()
        .float()
        .cast(burn::tensor::DType::F32)
        .reshape([1, 1, seq_q, seq_k]);
    let slopes = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(slopes))
        .cast(burn::tensor::DType::F32)
        .reshape([1, heads_q, 1, 1]);
    let mut term = (distance * slopes).neg().cast(q.dtype());
    if let Some(bias) = bias {
        let bias = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(bias));
        let shape = [bias.dims()[0], heads_q, seq_q, seq_k];
        term = term.expand(shape) + bias.expand(shape);
    }
    Some(term.into_primitive().tensor())
}

/// The gradients of [`forward`] (and of the fused attention, which computes the same
/// function) from stock ops: `(dq, dk, dv, ds)`, `ds` (`[B, Hq, Sq, Sk]`, the gradient of each
/// score, what a bias's gradient sums) only when `want_ds`. The provided body of
/// [`crate::AttentionBackend::flash_attention_backward`]. It materialises the scores, `P` and
/// `dS` (`B·Hq·Sq·Sk` each), as any composed attention backward does.
pub(crate) fn backward<B: Backend>(
    inputs: AttentionInputs<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
    flash_options: FlashAttentionOptions,
    want_ds: bool,
) -> super::AttentionGrads<B> {
    let (query, key, value, operands) = (inputs.query, inputs.key, inputs.value, inputs.scores);
    // The sinks are in `lse`: the weights `e^(s − lse)` of the keys are the ones the forward
    // used, and their gradient is the usual one (the sinks' own is the caller's).
    let (mask, bias, seqs) = (operands.mask, operands.bias, operands.seqs);
    let slopes = operands.heads.slopes;
    let options = flash_options.module;
    let packed = Packed::read::<B>(seqs);
    let bias = with_alibi::<B>(&query, &key, bias, slopes, packed.as_ref());
    let float = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (query, key, value, out, d_out) = (
        float(query),
        float(key),
        float(value),
        float(out),
        float(d_out),
    );
    let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse));
    let [batch, heads_q, seq_q, head_dim] = query.dims();
    let [_, heads_kv, seq_k, _] = key.dims();
    let value_dim = value.dims()[3];
    let device = query.device();
    let dtype = query.dtype();
    let full = [batch, heads_q, seq_q, seq_k];
    let zeros = |dims: [usize; 4]| Tensor::<B, 4>::zeros(dims, (&device, dtype));
    if batch * heads_q * seq_q * seq_k == 0 || head_dim * value_dim == 0 {
        // No score: every gradient is zero.
        let grads = super::AttentionGrads {
            dq: zeros(query.dims()).into_primitive().tensor(),
            dk: zeros(key.dims()).into_primitive().tensor(),
            dv: zeros(value.dims()).into_primitive().tensor(),
            ds: want_ds.then(|| zeros(full).into_primitive().tensor()),
        };
        return grads;
    }
    let group = heads_q / heads_kv;
    let rows = group * seq_q;
    let scale = scale_of(&options, head_dim);
    let grouped = |t: Tensor<B, 4>, last: usize| t.reshape([batch, heads_kv, rows, last]);
    let q = grouped(query, head_dim);
    let d_o = grouped(d_out.clone(), value_dim);
    let Scores {
        scores: s,
        hidden,
        filled,
        cap_grad,
    } = scores::<B>(
        q.clone(),
        key.clone(),
        (mask, bias, packed.as_ref()),
        flash_options,
        full,
    );
    // P = e^(s − lse); a row without a visible key has lse = −inf and P = 0 (the clamp keeps
    // e^(−inf − lse) at 0 there instead of NaN).
    let lse = lse
        .clamp_min(-60000.0)
        .cast(dtype)
        .reshape([batch, heads_q, seq_q, 1]);
    let mut p = (s - lse).exp();
    if let Some(hidden) = hidden {
        p = p.mask_fill(hidden, 0.0);
    }
    // Dropout: `dV` takes the kept weights, scaled, and `dP` flows back through the same mask.
    let keep = flash_options
        .dropout
        .and_then(|d| d.params())
        .map(|d| keep_factors::<B>(&d, full, &device, dtype));
    let p_dropped = match &keep {
        Some(z) => p.clone() * z.clone(),
        None => p.clone(),
    };
    let p_rows = p_dropped.reshape([batch, heads_kv, rows, seq_k]);
    let dv = p_rows.swap_dims(2, 3).matmul(d_o.clone());
    let mut dp = d_o.matmul(value.swap_dims(2, 3)).reshape(full);
    if let Some(z) = keep {
        dp = dp * z;
    }
    let delta = (d_out * out).sum_dim(3);
    let mut ds = p * (dp - delta);
    if let Some(filled) = filled {
        // A masked key's fill score is a constant.
        ds = ds.mask_fill(filled, 0.0);
    }
    let mut dr = ds.clone().mul_scalar(scale);
    if let Some(g) = cap_grad {
        dr = dr * g;
    }
    let dr = dr.reshape([batch, heads_kv, rows, seq_k]);
    let dq = dr
        .clone()
        .matmul(key)
        .reshape([batch, heads_q, seq_q, head_dim]);
    let dk = dr.swap_dims(2, 3).matmul(q);
    super::AttentionGrads {
        dq: dq.into_primitive().tensor(),
        dk: dk.into_primitive().tensor(),
        dv: dv.into_primitive().tensor(),
        ds: want_ds.then(|| ds.into_primitive().tensor()),
    }
}

/// The finished scores of a call, `[B, Hq, Sq, Sk]` (scaled, softcapped, plus the bias; the
/// fill score where the mask masks a key and the options fill), which keys each row cannot see
/// (mask without fill, and causal), which took the fill score, and the softcap's derivative
/// `1 − tanh²(s/c)`.
struct Scores<B: Backend> {
    scores: Tensor<B, 4>,
    hidden: Option<Tensor<B, 4, Bool>>,
    filled: Option<Tensor<B, 4, Bool>>,
    cap_grad: Option<Tensor<B, 4>>,
}

/// A call's score terms: the mask, the bias (ALiBi included) and packed sequences.
type Terms<'a, B> = (
    Option<BoolTensor<B>>,
    Option<FloatTensor<B>>,
    Option<&'a Packed>,
);

/// [`Scores`] of `q` (grouped: `[B, Hkv, G·Sq, D]`) and `key`.
fn scores<B: Backend>(
    q: Tensor<B, 4>,
    key: Tensor<B, 4>,
    (mask, bias, packed): Terms<'_, B>,
    flash_options: FlashAttentionOptions,
    full: [usize; 4],
) -> Scores<B> {
    let options: AttentionModuleOptions = flash_options.module;
    let device = q.device();
    let scale = scale_of(&options, key.dims()[3]);
    let mut s = q
        .matmul(key.swap_dims(2, 3))
        .mul_scalar(scale)
        .reshape(full);
    // d(c·tanh(s/c))/ds = 1 − tanh²(s/c).
    let mut cap_grad = None;
    if let Some(cap) = options.softcap {
        let t = s.div_scalar(cap).tanh();
        cap_grad = Some(t.clone().powi_scalar(2).neg().add_scalar(1.0));
        s = t.mul_scalar(cap);
    }
    if let Some(bias) = bias {
        let bias = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(bias));
        s = s + bias.expand(full);
    }
    let mask = mask.map(|m| Tensor::<B, 4, Bool>::from_primitive(m).expand(full));
    let (mut hidden, filled) = match flash_options.masked_score {
        Some(fill) => {
            if let Some(mask) = &mask {
                s = s.mask_fill(mask.clone(), fill);
            }
            (None, mask)
        }
        None => (mask, None),
    };
    if let Some(range) = range_mask::<B>(full, &flash_options, packed, &device) {
        hidden = Some(match hidden {
            Some(h) => h.bool_or(range),
            None => range,
        });
    }
    Scores {
        scores: s,
        hidden,
        filled,
        cap_grad,
    }
}

/// The dropout factors `keep / (1 − p)` of every weight, `[B, Hq, Sq, Sk]`, from the kernels'
/// generator ([`keep`]).
fn keep_factors<B: Backend>(
    params: &DropoutParams,
    full: [usize; 4],
    device: &B::Device,
    dtype: burn::tensor::DType,
) -> Tensor<B, 4> {
    let [nb, hq, sq, sk] = full;
    let scale = params.inv_keep();
    let mut values = Vec::with_capacity(nb * hq * sq * sk);
    for pair in 0..nb * hq {
        for i in 0..sq {
            for j in 0..sk {
                values.push(if keep(params, pair, i, j) { scale } else { 0.0 });
            }
        }
    }
    Tensor::<B, 4>::from_data(burn::tensor::TensorData::new(values, full), device).cast(dtype)
}

/// The composed forward with dropout: `P` written out (f32), dropped, then `·V`.
fn forward_with_dropout<B: Backend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    terms: Terms<'_, B>,
    options: FlashAttentionOptions,
    dropout: DropoutParams,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let float = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (query, key, value) = (float(query), float(key), float(value));
    let [batch, heads_q, seq_q, head_dim] = query.dims();
    let [_, heads_kv, seq_k, _] = key.dims();
    let value_dim = value.dims()[3];
    let device = query.device();
    let dtype = query.dtype();
    let full = [batch, heads_q, seq_q, seq_k];
    let rows = heads_q / heads_kv * seq_q;
    let q = query.reshape([batch, heads_kv, rows, head_dim]);
    let Scores { scores, hidden, .. } = scores::<B>(q, key, terms, options, full);
    let mut s = scores.cast(burn::tensor::DType::F32);
    if let Some(hidden) = hidden {
        s = s.mask_fill(hidden, f32::NEG_INFINITY);
    }
    // A row without a visible key: max −inf, every e = 0, l = 0, lse = −inf, P = 0.
    let m = s.clone().max_dim(3);
    let e = (s - m.clone().clamp_min(-1e30)).exp();
    let l = e.clone().sum_dim(3);
    let lse = m.clamp_min(-1e30) + l.clone().log();
    let p = e / l.clamp_min(1e-30);
    let z = keep_factors::<B>(&dropout, full, &device, burn::tensor::DType::F32);
    let p = (p * z).cast(dtype).reshape([batch, heads_kv, rows, seq_k]);
    let out = p.matmul(value).reshape([batch, heads_q, seq_q, value_dim]);
    let lse = lse.reshape([batch, heads_q, seq_q]);
    (out.into_primitive().tensor(), lse.into_primitive().tensor())
}
