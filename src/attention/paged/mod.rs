//! Paged KV caches (vLLM's PagedAttention, FlashAttention's `block_table`): keys and values
//! live in a pool of fixed-size blocks `[blocks, block_size, Hkv, D]`, and each sequence lists
//! its blocks in a [`BlockTable`]. Attention reads the keys through the table
//! ([`attention_paged`]: no gather copy), and appending writes new keys and values into their
//! blocks in place, optionally rotating keys and queries with RoPE on the way
//! ([`append_paged`], one launch: FlashAttention's `flash_attn_with_kvcache`).
//!
//! Both are inference ops: their results carry no gradient under `Autodiff`.
//!
//! On CubeCL backends the split-KV decoding kernel ([`burn_flash_kernels::decode`]) reads the
//! blocks; elsewhere (NdArray) the composed fallback gathers each sequence's keys (reading the
//! lengths and the table to the host) and runs the composed attention.
//!
//! Files: [`table`] (the block table), [`rope`] (the rotation tables), [`composed`] (the
//! fallback), [`autodiff`] (the ops under `Autodiff`); the API and its checks here.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::{
    DType, IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive,
    backend::{AutodiffBackend, Backend},
    ops::{FloatTensor, IntTensor},
};

use super::operands::{AttentionInputs, HeadOperands, KvCache, NewKeys, ScoreOperands};
use super::{FlashAttentionOptions, HeadTerms, OP, check_per_head};
use crate::{AttentionBackend, FlashBackend};

pub(crate) mod autodiff;
pub(crate) mod composed;
pub mod rope;
pub mod table;

use rope::rope_tables;
pub use rope::{Rope, RopeArgs};
pub use table::BlockTable;

/// What [`AttentionBackend::flash_append_decode`] returns: the caches (and the rotated query),
/// the output and the log-sum-exp.
pub type AppendDecoded<B> = (Appended<B>, FloatTensor<B>, FloatTensor<B>);

/// What [`AttentionBackend::flash_kv_append`] returns: the caches with the new keys and values
/// (the same buffers where the caller held the only reference), and the rotated queries.
#[derive(Debug)]
pub struct Appended<B: Backend> {
    /// The key cache.
    pub key: FloatTensor<B>,
    /// The value cache.
    pub value: FloatTensor<B>,
    /// The rotated queries, where asked.
    pub query: Option<FloatTensor<B>>,
}

/// What [`append_paged`] returns.
#[derive(Debug, Clone)]
pub struct PagedAppend<B: Backend> {
    /// The key pool with the new keys.
    pub key: Tensor<B, 4>,
    /// The value pool with the new values.
    pub value: Tensor<B, 4>,
    /// The table with the new lengths.
    pub table: BlockTable<B>,
    /// The queries rotated at the new tokens' positions (when given with RoPE).
    pub query: Option<Tensor<B, 4>>,
}

/// Checks a pool `[blocks, block_size, Hkv, ·]` against the table; returns `Hkv`.
fn check_pool<B: Backend>(name: &str, pool: &Tensor<B, 4>, table: &BlockTable<B>) -> usize {
    let [blocks, block_size, heads, _] = pool.dims();
    if blocks != table.pool_blocks || block_size != table.block_size {
        panic!(
            "{OP}: `{name}` has shape {:?}, expected [{}, {}, Hkv, D] (the table's pool)",
            pool.dims(),
            table.pool_blocks,
            table.block_size
        );
    }
    heads
}

/// Checks the pools, their dtype and device against `like` (`[B, H, S, D]`) and the table;
/// returns `Hkv`.
fn check_pools<B: Backend>(
    like: (&str, &Tensor<B, 4>),
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    table: &BlockTable<B>,
) -> usize {
    let (like_name, like) = like;
    let heads_kv = check_pool("key", key, table);
    check_pool("value", value, table);
    if value.dims()[2] != heads_kv {
        panic!(
            "{OP}: `value` has {} heads, `key` {heads_kv}",
            value.dims()[2]
        );
    }
    let [batch, _, _, head_dim] = like.dims();
    if batch != table.lengths.len() {
        panic!(
            "{OP}: `{like_name}` has batch {batch}, the table {} sequences",
            table.lengths.len()
        );
    }
    if key.dims()[3] != head_dim {
        panic!(
            "{OP}: `key` has head dim {}, `{like_name}` has {head_dim}",
            key.dims()[3]
        );
    }
    let dtype = like.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        panic!("{OP}: `{like_name}` has dtype {dtype:?}; supported: F32, F16, BF16");
    }
    for (name, t) in [("key", key), ("value", value)] {
        if t.dtype() != dtype {
            panic!(
                "{OP}: `{name}` has dtype {:?}, `{like_name}` has {dtype:?}",
                t.dtype()
            );
        }
        if t.device() != like.device() {
            panic!(
                "{OP}: `{name}` is on {:?}, `{like_name}` on {:?}",
                t.device(),
                like.device()
            );
        }
    }
    heads_kv
}

/// Attention of `query` `[B, Hq, Sq, D]` against each sequence's keys in the paged pools
/// `key` `[blocks, block_size, Hkv, D]`, `value` `[…, Dv]` through `table`: sequence `b`'s
/// queries are its last `Sq` positions of `table.lengths()[b]` keys (bottom-right, as the
/// causal mask and window of [`crate::attention()`]). Returns `[B, Hq, Sq, Dv]` and the row
/// log-sum-exp `[B, Hq, Sq]`. A sequence without keys gets zeros.
///
/// Options: scale, softcap, causal, window, quiet, ALiBi and sinks (`heads`); no mask, bias or
/// dropout.
///
/// # Panics
/// Before anything runs: pools that do not match the table or each other, a batch other than
/// the table's, head dims that differ, `Hq` not a multiple of `Hkv`, dtypes or devices that
/// differ, per-head terms of the wrong size, a mask-like option (dropout) or an invalid
/// scale or softcap.
pub fn attention_paged<B: FlashBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    table: &BlockTable<B>,
    heads: HeadTerms<B>,
    options: FlashAttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let heads = check_decode(&query, &key, &value, table, heads, options);
    let cache = pool_cache(key, value, table);
    let (out, lse) = B::flash_decode(query.into_primitive().tensor(), cache, heads, options);
    (float(out), float(lse))
}

/// The pools `key`, `value` read through `table`, as the backends take them.
fn pool_cache<B: Backend>(
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    table: &BlockTable<B>,
) -> KvCache<B> {
    KvCache {
        key: key.into_primitive().tensor(),
        value: value.into_primitive().tensor(),
        table: Some(table.table.clone().into_primitive()),
        lengths: table.lens.clone().into_primitive(),
    }
}

/// A float tensor of the backend's primitive.
fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// [`attention_paged`]'s checks of `query` against the pools and `table`; returns the per-head
/// terms as the kernels take them (f32 primitives).
fn check_decode<B: FlashBackend>(
    query: &Tensor<B, 4>,
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    table: &BlockTable<B>,
    heads: HeadTerms<B>,
    options: FlashAttentionOptions,
) -> HeadOperands<B> {
    let heads_kv = check_pools(("query", query), key, value, table);
    let [_, heads_q, _, _] = query.dims();
    if heads_kv == 0 || !heads_q.is_multiple_of(heads_kv) {
        panic!("{OP}: `query` has {heads_q} heads, not a multiple of the {heads_kv} of the pools");
    }
    let device = query.device();
    let HeadTerms {
        alibi_slopes,
        sinks,
    } = heads;
    for (name, t) in [("alibi_slopes", &alibi_slopes), ("sinks", &sinks)] {
        if let Some(t) = t {
            check_per_head(name, t, heads_q, &device);
        }
    }
    if options.dropout.is_some_and(|d| d.prob > 0.0) {
        panic!("{OP}: paged attention applies no dropout (an inference op)");
    }
    super::check_scalars(OP, &options.module);
    check_window_reach(table, query.dims()[2], options.window);
    let f32_terms =
        |t: Option<Tensor<B, 1>>| t.map(|t| t.cast(DType::F32).into_primitive().tensor());
    HeadOperands {
        slopes: f32_terms(alibi_slopes),
        sinks: f32_terms(sinks),
    }
}

/// Panics unless the window keeps each sequence's `seq_q` queries (its last positions) inside
/// the keys it still holds (a rolling table's given-back blocks are never read).
fn check_window_reach<B: Backend>(
    table: &BlockTable<B>,
    seq_q: usize,
    window: Option<(usize, usize)>,
) {
    for (b, (&evicted, &len)) in table.evicted.iter().zip(&table.lengths).enumerate() {
        let held_from = evicted * table.block_size;
        if held_from == 0 {
            continue;
        }
        // The first query is at position `len − Sq` (bottom-right) and sees from `left` before.
        let first = len.saturating_sub(seq_q);
        let reach = window.map(|(left, _)| first.saturating_sub(left));
        if reach.is_none_or(|from| from < held_from) {
            panic!(
                "{OP}: sequence {b} holds keys from {held_from} on (a rolling cache gave back its first {evicted} blocks), but its query at {first} would see keys from {} on: attend with a window whose left side is at most {}",
                reach.unwrap_or(0),
                first.saturating_sub(held_from)
            );
        }
    }
}

/// Appends `key_new` `[B, Hkv, S, D]` and `value_new` `[B, Hkv, S, Dv]` to each sequence of the
/// paged pools at positions `table.lengths()[b] ..`, in place where the pools' buffers are not
/// shared (otherwise into a copy), rotating the keys with `rope` and, when given, `query`
/// `[B, Hq, S, D]` at the same positions. Returns the pools, the grown table and the rotated
/// queries.
///
/// # Panics
/// Before anything runs: shapes that do not match the pools or the table, a sequence whose
/// blocks cannot hold `S` more keys, positions past the RoPE tables, rotary dims above `D`,
/// a query without RoPE, dtypes or devices that differ.
pub fn append_paged<B: FlashBackend>(
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    table: &BlockTable<B>,
    key_new: Tensor<B, 4>,
    value_new: Tensor<B, 4>,
    rope: Option<&Rope<B>>,
    query: Option<Tensor<B, 4>>,
) -> PagedAppend<B> {
    if query.is_some() && rope.is_none() {
        panic!("{OP}: `query` is only taken to be rotated: pass RoPE tables");
    }
    let grown = check_append(
        &key,
        &value,
        table,
        &key_new,
        &value_new,
        rope,
        query.as_ref(),
    );
    let rope_args = rope.map(|r| RopeArgs {
        query: query.map(|q| q.into_primitive().tensor()),
        ..rope_tables(r)
    });
    let cache = pool_cache(key, value, table);
    let new = NewKeys {
        key: key_new.into_primitive().tensor(),
        value: value_new.into_primitive().tensor(),
    };
    let out = B::flash_kv_append(cache, new, rope_args);
    PagedAppend {
        key: float(out.key),
        value: float(out.value),
        table: grown,
        query: out.query.map(float),
    }
}

/// [`append_paged`] and then [`attention_paged`] of `query` `[B, Hq, S, D]` (the new tokens'
/// queries, rotated with the keys where `rope` is given) as one op: one launch of the append and
/// one of the decoding kernel, recorded as one operation on `Fusion` (a serving step's
/// attention per layer). Returns the append's pools, grown table and rotated queries (where
/// rotated), the output `[B, Hq, S, Dv]` and the log-sum-exp `[B, Hq, S]`. Options as
/// [`attention_paged`]'s.
///
/// # Panics
/// Before anything runs: as [`append_paged`] and [`attention_paged`].
#[allow(clippy::too_many_arguments)]
pub fn append_attention_paged<B: FlashBackend>(
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    table: &BlockTable<B>,
    key_new: Tensor<B, 4>,
    value_new: Tensor<B, 4>,
    query: Tensor<B, 4>,
    rope: Option<&Rope<B>>,
    heads: HeadTerms<B>,
    options: FlashAttentionOptions,
) -> (PagedAppend<B>, Tensor<B, 4>, Tensor<B, 3>) {
    let grown = check_append(
        &key,
        &value,
        table,
        &key_new,
        &value_new,
        rope,
        Some(&query),
    );
    let heads = check_decode(&query, &key, &value, &grown, heads, options);
    let cache = pool_cache(key, value, table);
    let new = NewKeys {
        key: key_new.into_primitive().tensor(),
        value: value_new.into_primitive().tensor(),
    };
    let (appended, out, lse) = B::flash_append_decode(
        cache,
        grown.lens.clone().into_primitive(),
        new,
        query.into_primitive().tensor(),
        rope.map(rope_tables),
        heads,
        options,
    );
    let pools = PagedAppend {
        key: float(appended.key),
        value: float(appended.value),
        table: grown,
        query: appended.query.map(float),
    };
    (pools, float(out), float(lse))
}

/// [`append_paged`]'s checks (a `query` only with `rope` there); returns the grown table.
fn check_append<B: FlashBackend>(
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    table: &BlockTable<B>,
    key_new: &Tensor<B, 4>,
    value_new: &Tensor<B, 4>,
    rope: Option<&Rope<B>>,
    query: Option<&Tensor<B, 4>>,
) -> BlockTable<B> {
    let heads_kv = check_pools(("key_new", key_new), key, value, table);
    let [batch, new_heads, new, head_dim] = key_new.dims();
    let [vb, vh, vs, value_dim] = value_new.dims();
    if new_heads != heads_kv || [vb, vh, vs] != [batch, new_heads, new] {
        panic!(
            "{OP}: `key_new` {:?} and `value_new` {:?} must be [B, {heads_kv}, S, ·] alike",
            key_new.dims(),
            value_new.dims()
        );
    }
    if value.dims()[3] != value_dim {
        panic!(
            "{OP}: `value_new` has {value_dim} columns, the value pool {}",
            value.dims()[3]
        );
    }
    let grown = table.grown(new);
    if let Some(rope) = rope {
        let [positions, half] = rope.cos.dims();
        if 2 * half > head_dim || rope.sin.dims() != [positions, half] {
            panic!(
                "{OP}: RoPE tables {:?} / {:?}: [positions, R/2] alike with R ≤ D = {head_dim}",
                rope.cos.dims(),
                rope.sin.dims()
            );
        }
        let last = grown.lengths.iter().copied().max().unwrap_or(0);
        if last > positions {
            panic!("{OP}: positions up to {last} but the RoPE tables hold {positions}");
        }
    }
    if let Some(q) = query {
        let [qb, _, qs, qd] = q.dims();
        if [qb, qs, qd] != [batch, new, head_dim] {
            panic!(
                "{OP}: `query` has shape {:?}, expected [{batch}, Hq, {new}, {head_dim}]",
                q.dims()
            );
        }
    }
    grown
}
