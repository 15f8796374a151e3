//! Drop-in replacements for burn-nn 0.21's attention modules, on the fused kernels.
//!
//! [`MultiHeadAttention`], [`CrossAttention`], [`TransformerEncoder`] and [`TransformerDecoder`]
//! have the configs, fields, `init`, inputs and records of their namesakes in `burn::nn`: a model
//! swaps `use burn::nn::attention::…` / `use burn::nn::transformer::…` for `use burn_flash::nn::…`
//! and loads the record it saved. What changes:
//!
//! - **Nothing `S × S` is written.** The scores, weights and masks are made on chip by
//!   [`crate::attention()`] (forward and backward). Attention's activation memory is the inputs,
//!   the output and one f32 per query row, O(S), where burn-nn keeps the scores and weights,
//!   O(S²) per head.
//! - **burn-nn's numbers.** Masked scores take `min_float` and stay in the softmax, so a fully
//!   masked row is uniform as in burn-nn, and `quiet_softmax` adds 1 to the denominator; both are
//!   options of the kernels ([`FlashAttentionOptions::masked_score`],
//!   [`FlashAttentionOptions::quiet`]), in the forward and the backward.
//! - **[`MhaOutput`] has no `weights`.** burn-nn returns the `[B, H, Sq, Sk]` weights with every
//!   call; avoiding them is the point. [`MultiHeadAttention::attention_weights`] computes them
//!   on request (from stock ops, as burn-nn does).
//! - **Causal attention without a mask tensor.** [`MhaInput::causal`] (and
//!   [`TransformerEncoderInput::causal`], [`TransformerDecoderInput::target_causal`]) is
//!   `mask_attn(generate_autoregressive_mask(..))` without the `[B, S, S]` mask: nothing is read
//!   and the blocks above the diagonal are skipped. A mask tensor still works, at the cost of
//!   reading it.
//! - **Dropout on the weights.** burn-nn's `MultiHeadAttention` drops raw scores before the mask
//!   (a dropped score becomes 0, not −inf); its `CrossAttention`, PyTorch and FlashAttention drop
//!   the softmax weights (`P ⊙ keep / (1 − p)`). Here both modules drop the weights, inside the
//!   kernel, with the module's `dropout` probability, only when autodiff is enabled (as Burn's
//!   `Dropout`). Each call draws a new seed ([`seed`] makes a run reproducible).
//! - **KV cache that grows in place.** [`MhaCache`] keeps the projected keys and values in
//!   buffers with spare capacity, written in place step by step (burn-nn concatenates the whole
//!   cache anew each step) and attends only the new query rows to the cache (burn-nn recomputes
//!   every row's scores each step). The calling convention is burn-nn's: each call passes the
//!   whole sequence so far and gets the context of every position back.
//! - **A paged KV cache for serving.** [`PagedKvCache`] holds the keys and values of many
//!   sequences of a stack of layers in block pools, with one block allocator for all layers;
//!   appends write in place, attention reads through the block table (no gather).
//! - **Serving a decoder-only stack.** [`TransformerEncoder::serving`] arranges a causal stack
//!   for inference ([`ServingEncoder`]): prompts of many sequences prefilled as one packed
//!   (varlen) batch, then decoding steps for a batch of sequences of any lengths through a
//!   [`PagedKvCache`], each layer's step in the fewest Burn ops (one fused query/key/value
//!   projection, append and attention as one op).
//! - **Grouped-query cross-attention without repeats.** [`CrossAttention`] with
//!   `n_heads_kv < n_heads` hands the `n_heads_kv` key/value heads to the kernel, which reads
//!   each for its group of query heads; burn-nn repeats them in memory first.

mod cache;
mod cross_attention;
mod mha;
mod paged;
mod serving;
mod transformer;

pub use cache::{KvCache, RowCache};
pub use cross_attention::{CrossAttention, CrossAttentionCache, CrossAttentionConfig};
pub use mha::{MhaCache, MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use paged::{PagedKvCache, PagedStep};
pub use serving::ServingEncoder;
pub use transformer::{
    TransformerDecoder, TransformerDecoderAutoregressiveCache, TransformerDecoderConfig,
    TransformerDecoderInput, TransformerDecoderLayer, TransformerEncoder,
    TransformerEncoderAutoregressiveCache, TransformerEncoderConfig, TransformerEncoderInput,
    TransformerEncoderLayer,
};

use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::DisplaySettings;
use burn::nn::Linear;
use burn::tensor::{Bool, Tensor, backend::Backend};

use crate::{AttentionDropout, FlashAttentionOptions};

/// The state of the attention-dropout seed sequence ([`seed`]).
static SEED: AtomicU64 = AtomicU64::new(0x5EED_F1A5_4A77_E471);

/// Restarts the sequence of dropout seeds the modules of this module draw (one per call that
/// drops): the same `seed` and the same calls give the same dropout masks, on every backend.
pub fn seed(seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
}

/// The next seed of the sequence: SplitMix64 over a Weyl sequence.
fn next_seed() -> u64 {
    let mut z = SEED
        .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Dropout of a module's attention weights with probability `prob`: active only when autodiff
/// is enabled on `device` (training), as Burn's `Dropout`, with a fresh seed per call.
fn weight_dropout<B: Backend>(prob: f64, device: &B::Device) -> Option<AttentionDropout> {
    (prob > 0.0 && B::ad_enabled(device)).then(|| AttentionDropout {
        prob,
        seed: next_seed(),
    })
}

/// The options of a module's attention call: burn-nn's scale `1/√d_head`, masked keys filled
/// with `min_float`, quiet softmax, causal, dropout on the weights.
fn module_options<B: Backend>(
    d_head: usize,
    min_float: f64,
    quiet: bool,
    causal: bool,
    dropout: f64,
    device: &B::Device,
) -> FlashAttentionOptions {
    FlashAttentionOptions {
        module: burn::tensor::ops::AttentionModuleOptions {
            scale: Some(1.0 / (d_head as f64).sqrt()),
            is_causal: causal,
            ..Default::default()
        },
        masked_score: Some(min_float),
        quiet,
        dropout: weight_dropout::<B>(dropout, device),
        ..Default::default()
    }
}

/// burn-nn's two masks as one broadcast mask of `attention` (`true` = masked):
/// `mask_pad` `[B, Sk]` → `[B, 1, 1, Sk]`, `mask_attn` `[B, Sq, Sk]` → `[B, 1, Sq, Sk]`, both: their
/// union. `rows` picks the query rows of `mask_attn` the call computes (a KV-cache step computes
/// the last ones). Panics with the expected shapes when a mask does not fit.
fn attention_mask<B: Backend>(
    who: &str,
    mask_pad: Option<Tensor<B, 2, Bool>>,
    mask_attn: Option<Tensor<B, 3, Bool>>,
    batch: usize,
    rows: std::ops::Range<usize>,
    seq_q: usize,
    seq_k: usize,
) -> Option<Tensor<B, 4, Bool>> {
    if let Some(pad) = &mask_pad
        && pad.dims() != [batch, seq_k]
    {
        panic!(
            "{who}: `mask_pad` has shape {:?}, expected [batch {batch}, keys {seq_k}]",
            pad.dims()
        );
    }
    if let Some(attn) = &mask_attn
        && attn.dims() != [batch, seq_q, seq_k]
    {
        panic!(
            "{who}: `mask_attn` has shape {:?}, expected [batch {batch}, queries {seq_q}, keys {seq_k}]",
            attn.dims()
        );
    }
    let n = rows.len();
    let pad = mask_pad.map(|m| m.reshape([batch, 1, 1, seq_k]));
    let attn = mask_attn.map(|m| {
        let m = if rows.start == 0 && rows.end == seq_q {
            m
        } else {
            m.slice([0..batch, rows, 0..seq_k])
        };
        m.reshape([batch, 1, n, seq_k])
    });
    match (pad, attn) {
        (Some(pad), Some(attn)) => Some(pad.expand([batch, 1, n, seq_k]).bool_or(attn)),
        (pad, attn) => pad.or(attn),
    }
}

/// The display settings of this module's modules: burn-nn's (each attribute on one line).
fn display_settings() -> Option<DisplaySettings> {
    DisplaySettings::new()
        .with_new_line_after_attribute(false)
        .optional()
}

/// Panics (naming `who`) unless `n` is positive and divides `m` (each with its name).
fn check_divides(who: &str, (n_name, n): (&str, usize), (m_name, m): (&str, usize)) {
    assert!(
        n > 0 && m.is_multiple_of(n),
        "{who}: `{n_name}` {n} must divide `{m_name}` {m}"
    );
}

/// Rows `range` of `x` `[B, S, D]` (`x` itself for all of them).
fn rows<B: Backend>(x: Tensor<B, 3>, range: std::ops::Range<usize>) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    if range == (0..seq) {
        x
    } else {
        x.slice([0..batch, range, 0..width])
    }
}

/// `x` `[B, S, d]` through `linear` to `[B, S, H·D]`, split into `heads` heads: `[B, H, S, D]`
/// (a view: the kernels read any strides).
fn project_heads<B: Backend>(linear: &Linear<B>, x: Tensor<B, 3>, heads: usize) -> Tensor<B, 4> {
    let x = linear.forward(x);
    let [batch, seq, width] = x.dims();
    x.reshape([batch, seq, heads, width / heads])
        .swap_dims(1, 2)
}

/// `[B, H, S, D]` → `[B, S, H·D]`.
fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [batch, heads, seq, d] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * d])
}
