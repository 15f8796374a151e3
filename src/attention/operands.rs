//! The tensors the attention ops take, as backends take them (primitives), in named bundles:
//! the backend trait ([`crate::AttentionBackend`]), the `Fusion` records and `Autodiff` pass one
//! value on instead of a positional list, so a new optional operand is a field here and a line
//! in each place that reads it.

use burn::tensor::{
    TensorMetadata,
    backend::Backend,
    ops::{BoolTensor, FloatTensor, IntTensor},
};

use super::ScoreTerms;

/// The per-head operands of a call, each `[Hq]` f32 ([`super::HeadTerms`] as primitives).
#[derive(Debug, Clone)]
pub struct HeadOperands<B: Backend> {
    /// ALiBi slopes.
    pub slopes: Option<FloatTensor<B>>,
    /// Attention-sink logits.
    pub sinks: Option<FloatTensor<B>>,
}

impl<B: Backend> Default for HeadOperands<B> {
    fn default() -> Self {
        Self {
            slopes: None,
            sinks: None,
        }
    }
}

/// The optional operands of a call's scores, each `None` where the call has none.
#[derive(Debug, Clone)]
pub struct ScoreOperands<B: Backend> {
    /// The bool mask (`true`: masked out), broadcasting to `[B, Hq, Sq, Sk]`.
    pub mask: Option<BoolTensor<B>>,
    /// The additive bias, broadcasting to `[B, Hq, Sq, Sk]`.
    pub bias: Option<FloatTensor<B>>,
    /// ALiBi slopes and attention sinks.
    pub heads: HeadOperands<B>,
    /// A packed batch's sequences (`[2·(n + 1)]`: cumulative query lengths, then key lengths;
    /// [`super::VarlenBatch`]).
    pub seqs: Option<IntTensor<B>>,
}

impl<B: Backend> Default for ScoreOperands<B> {
    fn default() -> Self {
        Self {
            mask: None,
            bias: None,
            heads: HeadOperands::default(),
            seqs: None,
        }
    }
}

impl<B: Backend> ScoreOperands<B> {
    /// Which operands are given (the bias untracked).
    pub fn terms(&self) -> ScoreTerms {
        ScoreTerms {
            mask: self.mask.is_some(),
            bias: self.bias.is_some(),
            bias_tracked: false,
            bias_rows_broadcast: self.bias.as_ref().is_some_and(|b| b.shape()[2] == 1),
            alibi: self.heads.slopes.is_some(),
            sinks: self.heads.sinks.is_some(),
            varlen: self.seqs.is_some(),
        }
    }
}

/// One attention call's tensors: `query` `[B, Hq, Sq, D]`, `key` `[B, Hkv, Sk, D]`, `value`
/// `[B, Hkv, Sk, Dv]` and the scores' optional operands.
#[derive(Debug, Clone)]
pub struct AttentionInputs<B: Backend> {
    /// The queries.
    pub query: FloatTensor<B>,
    /// The keys.
    pub key: FloatTensor<B>,
    /// The values.
    pub value: FloatTensor<B>,
    /// The mask, the bias, the per-head terms, the sequences.
    pub scores: ScoreOperands<B>,
}

/// A KV cache as decoding and appending take it: contiguous `[B, Hkv, S_max, ·]`, or with a
/// block `table` (`[B, max_blocks]`) pools `[blocks, block_size, Hkv, ·]`; `lengths` (`[B]`)
/// the keys each batch holds.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// The key cache.
    pub key: FloatTensor<B>,
    /// The value cache.
    pub value: FloatTensor<B>,
    /// The block table where paged.
    pub table: Option<IntTensor<B>>,
    /// The lengths.
    pub lengths: IntTensor<B>,
}

/// The keys and values an append writes, `[B, Hkv, S, D]` and `[B, Hkv, S, Dv]`.
#[derive(Debug, Clone)]
pub struct NewKeys<B: Backend> {
    /// The new keys.
    pub key: FloatTensor<B>,
    /// The new values.
    pub value: FloatTensor<B>,
}
