//! Serving a decoder-only language model built on [`TransformerEncoder`] (causal
//! self-attention) to many sequences at once: [`TransformerEncoder::serving`] gives the stack's
//! [`ServingEncoder`], whose weights are arranged once for inference, and which runs
//!
//! - **prefill** ([`ServingEncoder::prefill`]): the prompts of several new sequences packed end
//!   to end (`[T, d_model]`, no padding), one varlen attention call per layer
//!   ([`crate::attention_varlen`], causal per sequence), every layer's keys and values written
//!   into a [`PagedKvCache`];
//! - **decoding steps** ([`ServingEncoder::decode`]): `S` new tokens for each of a batch of
//!   sequences of any lengths, attending through the paged cache's block table.
//!
//! A decoding step has few rows and pays for each launch, so it is written in the fewest ops
//! and its projections read their weights once: per layer the query, key and value
//! projections are one product (their weights concatenated once, `[d_model, 3·d_model]`, heads
//! split by views), the append of the new keys and values and the attention are one op
//! ([`PagedKvCache::append_attend`]: one Fusion operation, two launches), each layer norm is
//! one kernel ([`crate::layer_norm`]; Burn's is about five launches), and every projection
//! runs [`crate::linear`] (one kernel for up to 16 rows; Burn's matmul tiles one row as if it
//! had many and read the weight at ~11 GB/s on an H200). Dropout is off
//! (inference) and the attention options are the modules' (`1/√d_k`, `min_float`, quiet
//! softmax). Only causal (decoder-only) stacks are served: every call is causal.

use burn::nn::{LayerNorm, Linear};
use burn::tensor::Tensor;

use super::PagedKvCache;
use super::merge_heads;
use super::transformer::{TransformerEncoder, TransformerEncoderLayer};
use crate::{
    FlashAttentionOptions, FlashBackend, HeadTerms, VarlenBatch, attention_varlen, layer_norm,
    linear,
};

const WHO: &str = "burn_flash::nn::ServingEncoder";

/// One layer arranged for inference: the layer and its fused query/key/value projection.
#[derive(Debug, Clone)]
struct ServingLayer<B: FlashBackend> {
    layer: TransformerEncoderLayer<B>,
    /// `[d_model, 3·d_model]`: the query, key and value weights side by side (each head's
    /// columns together, as `project_heads` splits them).
    qkv_weight: Tensor<B, 2>,
    /// `[3·d_model]`, zeros where a projection has no bias.
    qkv_bias: Tensor<B, 1>,
}

/// A [`TransformerEncoder`] arranged for serving (module docs): made by
/// [`TransformerEncoder::serving`], it shares the stack's parameter tensors but the fused
/// projection, which is a copy made then (make a new one after the weights change).
#[derive(Debug, Clone)]
pub struct ServingEncoder<B: FlashBackend> {
    layers: Vec<ServingLayer<B>>,
    d_model: usize,
    heads: usize,
    d_k: usize,
}

impl<B: FlashBackend> TransformerEncoder<B> {
    /// The stack arranged for serving with a [`PagedKvCache`] ([`ServingEncoder`]).
    pub fn serving(&self) -> ServingEncoder<B> {
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let mha = &layer.mha;
                let parts = [&mha.query, &mha.key, &mha.value];
                let weight = Tensor::cat(parts.iter().map(|l| l.weight.val()).collect(), 1);
                let bias = parts
                    .iter()
                    .map(|l| bias_or_zeros(l, mha.d_model))
                    .collect();
                ServingLayer {
                    layer: layer.clone(),
                    qkv_weight: weight,
                    qkv_bias: Tensor::cat(bias, 0),
                }
            })
            .collect();
        ServingEncoder {
            layers,
            d_model: self.d_model,
            heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
        }
    }
}

/// `l`'s bias, or zeros of its `width` outputs.
fn bias_or_zeros<B: FlashBackend>(l: &Linear<B>, width: usize) -> Tensor<B, 1> {
    match &l.bias {
        Some(b) => b.val(),
        None => {
            let w = l.weight.val();
            Tensor::zeros([width], (&w.device(), w.dtype()))
        }
    }
}

impl<B: FlashBackend> ServingEncoder<B> {
    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// A paged cache for this stack: `blocks` blocks of `block_size` positions per layer, in
    /// the weights' dtype.
    pub fn new_paged_cache(
        &self,
        blocks: usize,
        block_size: usize,
        device: &B::Device,
    ) -> PagedKvCache<B> {
        let dtype = self
            .layers
            .first()
            .map_or(burn::tensor::DType::F32, |l| l.qkv_weight.dtype());
        PagedKvCache::new(
            self.layers.len(),
            blocks,
            block_size,
            self.heads,
            self.d_k,
            dtype,
            device,
        )
    }

    /// The prompts of the new sequences `ids` (`lengths[i]` tokens of sequence `ids[i]`, packed
    /// end to end in `x` `[Σ lengths, d_model]`) through the stack as one packed batch, each
    /// attending causally to its own tokens; every layer's keys and values are written into
    /// `cache` and the sequences' lengths committed. Returns the last layer's output
    /// `[Σ lengths, d_model]` (a model reads each sequence's last row).
    ///
    /// # Panics
    /// When `x` is not `[Σ lengths, d_model]`, `ids` and `lengths` differ in length or are
    /// empty, a prompt is empty, a sequence already holds positions or is not live, or the
    /// pool runs out of blocks.
    pub fn prefill(
        &self,
        x: Tensor<B, 2>,
        ids: &[usize],
        lengths: &[usize],
        cache: &mut PagedKvCache<B>,
    ) -> Tensor<B, 2> {
        let device = x.device();
        let total: usize = lengths.iter().sum();
        if ids.len() != lengths.len() || ids.is_empty() {
            panic!(
                "{WHO}: {} sequences for {} prompt lengths (one of each, at least one)",
                ids.len(),
                lengths.len()
            );
        }
        if x.dims() != [total, self.d_model] {
            panic!(
                "{WHO}: the prompts are {:?}, expected [{total} tokens, d_model {}]",
                x.dims(),
                self.d_model
            );
        }
        for (&id, &len) in ids.iter().zip(lengths) {
            if len == 0 {
                panic!("{WHO}: sequence {id} has an empty prompt");
            }
            if !cache.is_empty(id) {
                panic!(
                    "{WHO}: sequence {id} already holds {} positions: prefill starts new sequences (continue one with `decode`)",
                    cache.len(id)
                );
            }
        }
        let steps: Vec<_> = ids
            .iter()
            .zip(lengths)
            .map(|(&id, &len)| cache.reserve(&[id], len, &device))
            .collect();
        let batch = VarlenBatch::self_attention(lengths, &device);
        let (heads, d_k) = (self.heads, self.d_k);
        let mut x = x;
        for (index, l) in self.layers.iter().enumerate() {
            let attend = |h: Tensor<B, 2>| {
                let qkv = l.qkv(h).reshape([total, 3 * heads, d_k]);
                let [q, k, v] = [0, 1, 2].map(|i| qkv.clone().narrow(1, i * heads, heads));
                let mut start = 0;
                for (step, &len) in steps.iter().zip(lengths) {
                    // `[len, H, d_k]` rows as `[1, H, len, d_k]`: views.
                    let rows =
                        |t: &Tensor<B, 3>| t.clone().narrow(0, start, len).unsqueeze_dim::<4>(0);
                    let (k_seq, v_seq) = (rows(&k).swap_dims(1, 2), rows(&v).swap_dims(1, 2));
                    cache.append(index, step, k_seq, v_seq, None);
                    start += len;
                }
                let options = l.options();
                let (context, _) =
                    attention_varlen(q, k, v, &batch, None, None, HeadTerms::default(), options);
                let context = context.reshape([total, heads * d_k]);
                dense(&l.layer.mha.output, context)
            };
            x = l
                .layer
                .sublayers_normed(x, fused_norm, attend, |h| l.ffn(h));
        }
        for step in steps {
            cache.commit(step);
        }
        x
    }

    /// One step of the sequences `ids` with `S` new tokens each, `x` `[n, S, d_model]` (row
    /// `i` the tokens of `ids[i]`, at the positions after those it holds): each layer's new keys
    /// and values are appended to `cache` and its queries attend causally to every position of
    /// their sequence. Commits the step; returns the last layer's output `[n, S, d_model]`.
    ///
    /// # Panics
    /// When `x` is not `[ids.len(), S, d_model]`, a sequence is not live or listed twice, or
    /// the pool runs out of blocks.
    pub fn decode(
        &self,
        x: Tensor<B, 3>,
        ids: &[usize],
        cache: &mut PagedKvCache<B>,
    ) -> Tensor<B, 3> {
        let [n, new, width] = x.dims();
        if n != ids.len() || width != self.d_model || new == 0 {
            panic!(
                "{WHO}: the step's tokens are {:?}, expected [{} sequences, S ≥ 1, d_model {}]",
                x.dims(),
                ids.len(),
                self.d_model
            );
        }
        let step = cache.reserve(ids, new, &x.device());
        let (heads, d_k) = (self.heads, self.d_k);
        let mut x = x;
        for (index, l) in self.layers.iter().enumerate() {
            let attend = |h: Tensor<B, 3>| {
                let qkv = l.qkv(h).reshape([n, new, 3 * heads, d_k]).swap_dims(1, 2);
                let [q, k, v] = [0, 1, 2].map(|i| qkv.clone().narrow(1, i * heads, heads));
                let context = cache.append_attend(index, &step, k, v, q, None, l.options());
                // `[n, H, 1, d_k]` is `[n, 1, H·d_k]` in memory: one token needs no copy.
                let context = match new {
                    1 => context.reshape([n, 1, heads * d_k]),
                    _ => merge_heads(context),
                };
                dense(&l.layer.mha.output, context)
            };
            x = l
                .layer
                .sublayers_normed(x, fused_norm, attend, |h| l.ffn(h));
        }
        cache.commit(step);
        x
    }
}

/// The layer norms of the stacks' layers (burn-nn's transformers make them with
/// `LayerNormConfig`'s default `epsilon`, which burn-nn's `LayerNorm` does not expose).
const NORM_EPSILON: f64 = 1e-5;

/// `norm` on `x` as one op ([`crate::layer_norm`]).
fn fused_norm<B: FlashBackend, const D: usize>(
    norm: &LayerNorm<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    let beta = norm.beta.as_ref().map(|b| b.val());
    layer_norm(x, norm.gamma.val(), beta, NORM_EPSILON)
}

/// `l` on `x` through [`crate::linear`] (one kernel for a decoding step's few rows).
fn dense<B: FlashBackend, const D: usize>(l: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    linear(x, l.weight.val(), l.bias.as_ref().map(|b| b.val()))
}

impl<B: FlashBackend> ServingLayer<B> {
    /// The fused projection of the sub-layer's input `h` (`[…, d_model]` → `[…, 3·d_model]`).
    fn qkv<const D: usize>(&self, h: Tensor<B, D>) -> Tensor<B, D> {
        linear(h, self.qkv_weight.clone(), Some(self.qkv_bias.clone()))
    }

    /// The position-wise feed-forward for inference (no dropout): burn-nn's
    /// `PositionWiseFeedForward` with its two projections through [`crate::linear`].
    fn ffn<const D: usize>(&self, h: Tensor<B, D>) -> Tensor<B, D> {
        let pwff = &self.layer.pwff;
        let inner = pwff.activation.forward(dense(&pwff.linear_inner, h));
        dense(&pwff.linear_outer, inner)
    }

    /// The layer's attention options for inference: causal, no dropout.
    fn options(&self) -> FlashAttentionOptions {
        let mha = &self.layer.mha;
        let module = burn::tensor::ops::AttentionModuleOptions {
            scale: Some(1.0 / (mha.d_k as f64).sqrt()),
            is_causal: true,
            ..Default::default()
        };
        FlashAttentionOptions {
            module,
            masked_score: Some(mha.min_float),
            quiet: mha.quiet_softmax,
            ..Default::default()
        }
    }
}
