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

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::{
    DType, IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive,
    backend::{AutodiffBackend, Backend},
    ops::{FloatTensor, IntTensor},
};

use super::{FlashAttentionOptions, HeadTerms, OP, check_per_head};
use crate::{AttentionBackend, FlashBackend};

/// A paged cache's block table: for each of `B` sequences its blocks of the pool in order and
/// the keys it holds. Checked when made (every block inside the pool, no block listed twice,
/// every length within its blocks); the device copies the kernels read are made then too.
///
/// A rolling cache (sliding-window attention) gives back a sequence's leading blocks once no
/// later query can see them: [`BlockTable::rolling`] lists each sequence's blocks from its
/// first held one; the attention then checks that its window keeps every query inside the
/// held keys.
#[derive(Debug, Clone)]
pub struct BlockTable<B: Backend> {
    blocks: Vec<Vec<usize>>,
    evicted: Vec<usize>,
    lengths: Vec<usize>,
    block_size: usize,
    pool_blocks: usize,
    table: Tensor<B, 2, Int>,
    lens: Tensor<B, 1, Int>,
}

impl<B: Backend> BlockTable<B> {
    /// The table of sequences `b` holding `lengths[b]` keys in blocks `blocks[b]` of a pool of
    /// `pool_blocks` blocks of `block_size` keys.
    ///
    /// # Panics
    /// When `blocks` and `lengths` differ in length or are empty, `block_size` is 0, a block
    /// index is outside the pool, a block is listed twice, or a sequence holds more keys than
    /// its blocks.
    pub fn new(
        blocks: Vec<Vec<usize>>,
        lengths: Vec<usize>,
        block_size: usize,
        pool_blocks: usize,
        device: &B::Device,
    ) -> Self {
        let evicted = vec![0; blocks.len()];
        Self::rolling(blocks, evicted, lengths, block_size, pool_blocks, device)
    }

    /// As [`BlockTable::new`] for a rolling cache: sequence `b` gave back its first
    /// `evicted[b]` blocks (keys `0 .. evicted[b]·block_size`), and `blocks[b]` lists the
    /// blocks it holds from there.
    ///
    /// # Panics
    /// As [`BlockTable::new`], and when `evicted` has another length or a sequence gave back
    /// keys it does not hold.
    pub fn rolling(
        blocks: Vec<Vec<usize>>,
        evicted: Vec<usize>,
        lengths: Vec<usize>,
        block_size: usize,
        pool_blocks: usize,
        device: &B::Device,
    ) -> Self {
        if blocks.len() != lengths.len() || blocks.len() != evicted.len() || blocks.is_empty() {
            panic!(
                "{OP}: {} block lists, {} evicted counts and {} lengths (one of each per sequence, at least one)",
                blocks.len(),
                evicted.len(),
                lengths.len()
            );
        }
        if block_size == 0 {
            panic!("{OP}: `block_size` must be positive");
        }
        let mut seen = vec![false; pool_blocks];
        for (b, list) in blocks.iter().enumerate() {
            for &block in list {
                if block >= pool_blocks {
                    panic!(
                        "{OP}: sequence {b} lists block {block}, outside the pool of {pool_blocks} blocks"
                    );
                }
                if std::mem::replace(&mut seen[block], true) {
                    panic!("{OP}: block {block} is listed twice (sequence {b})");
                }
            }
            if lengths[b] < evicted[b] * block_size {
                panic!(
                    "{OP}: sequence {b} gave back {} blocks ({} keys) but holds only {} keys",
                    evicted[b],
                    evicted[b] * block_size,
                    lengths[b]
                );
            }
            check_room(b, lengths[b], evicted[b] + list.len(), block_size);
        }
        // Entries of given-back blocks are 0: the attention's window check keeps every read
        // past them.
        let width = blocks
            .iter()
            .zip(&evicted)
            .map(|(list, e)| e + list.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let rows: Vec<i32> = blocks
            .iter()
            .zip(&evicted)
            .flat_map(|(list, &e)| {
                (0..width).map(move |i| {
                    i.checked_sub(e)
                        .and_then(|i| list.get(i))
                        .map_or(0, |&b| b as i32)
                })
            })
            .collect();
        let table = Tensor::from_data(TensorData::new(rows, [blocks.len(), width]), device);
        let lens = upload_lengths(&lengths, device);
        Self {
            blocks,
            evicted,
            lengths,
            block_size,
            pool_blocks,
            table,
            lens,
        }
    }

    /// Each sequence's blocks (from its first held one).
    pub fn blocks(&self) -> &[Vec<usize>] {
        &self.blocks
    }

    /// Leading blocks each sequence gave back ([`BlockTable::rolling`]; 0 otherwise).
    pub fn evicted(&self) -> &[usize] {
        &self.evicted
    }

    /// Keys each sequence holds.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Keys per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn pool_blocks(&self) -> usize {
        self.pool_blocks
    }

    /// The same table with `extra` more keys in every sequence (after [`append_paged`]): the
    /// device table is shared, only the lengths are uploaded again.
    ///
    /// # Panics
    /// When a sequence's blocks cannot hold them.
    pub fn grown(&self, extra: usize) -> Self {
        let lengths: Vec<usize> = self.lengths.iter().map(|l| l + extra).collect();
        for (b, (&len, list)) in lengths.iter().zip(&self.blocks).enumerate() {
            check_room(b, len, self.evicted[b] + list.len(), self.block_size);
        }
        Self {
            blocks: self.blocks.clone(),
            evicted: self.evicted.clone(),
            lens: upload_lengths(&lengths, &self.table.device()),
            lengths,
            block_size: self.block_size,
            pool_blocks: self.pool_blocks,
            table: self.table.clone(),
        }
    }
}

/// Panics unless `blocks` blocks of `block_size` keys hold sequence `b`'s `len` keys.
fn check_room(b: usize, len: usize, blocks: usize, block_size: usize) {
    if len > blocks * block_size {
        panic!(
            "{OP}: sequence {b} holds {len} keys but its {blocks} blocks of {block_size} hold {}",
            blocks * block_size
        );
    }
}

/// The device copy of the sequences' lengths the kernels read.
fn upload_lengths<B: Backend>(lengths: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let host: Vec<i32> = lengths.iter().map(|&l| l as i32).collect();
    Tensor::from_data(TensorData::new(host, [lengths.len()]), device)
}

/// RoPE tables for [`append_paged`]: `cos`, `sin` `[positions, R/2]` (f32) of the rotary dims
/// `R`, and the pairing.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    /// `cos(p·θᵢ)`.
    pub cos: Tensor<B, 2>,
    /// `sin(p·θᵢ)`.
    pub sin: Tensor<B, 2>,
    /// Pairs `(2i, 2i + 1)` (burn-nn's `RotaryEncoding`); halves `(i, i + R/2)` otherwise
    /// (GPT-NeoX, Hugging Face's Llama).
    pub interleaved: bool,
}

impl<B: Backend> Rope<B> {
    /// The tables of `θᵢ = theta^(−2i/R)` for positions `0 .. positions`, computed in f64 on
    /// the host and stored as f32.
    pub fn new(
        theta: f64,
        rotary_dim: usize,
        positions: usize,
        interleaved: bool,
        device: &B::Device,
    ) -> Self {
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || theta <= 0.0 {
            panic!(
                "{OP}: RoPE needs an even, positive `rotary_dim` and a positive `theta`, got {rotary_dim} and {theta}"
            );
        }
        let half = rotary_dim / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let angle = p as f64 * theta.powf(-2.0 * i as f64 / rotary_dim as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| {
            Tensor::from_data(TensorData::new(v, [positions, half]), (device, DType::F32))
        };
        Self {
            cos: table(cos),
            sin: table(sin),
            interleaved,
        }
    }
}

/// The RoPE arguments of [`AttentionBackend::flash_kv_append`].
#[derive(Debug)]
pub struct RopeArgs<B: Backend> {
    /// `[positions, R/2]`, f32.
    pub cos: FloatTensor<B>,
    /// As `cos`.
    pub sin: FloatTensor<B>,
    /// Pairing ([`Rope::interleaved`]).
    pub interleaved: bool,
    /// Queries `[B, Hq, S, D]` to rotate at the new tokens' positions too.
    pub query: Option<FloatTensor<B>>,
}

/// The caches [`AttentionBackend::flash_append_decode`] takes: `key`, `value`, the table where
/// paged, the lengths before the append and after it.
pub(crate) type AppendCaches<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    Option<IntTensor<B>>,
    IntTensor<B>,
    IntTensor<B>,
);

/// The new rows [`AttentionBackend::flash_append_decode`] takes: keys, values, queries and the
/// RoPE tables where given (their `query` unused).
pub(crate) type AppendRows<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<RopeArgs<B>>,
);

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
    let (slopes, sinks) = check_decode(&query, &key, &value, table, heads, options);
    let (out, lse) = B::flash_decode(
        query.into_primitive().tensor(),
        key.into_primitive().tensor(),
        value.into_primitive().tensor(),
        Some(table.table.clone().into_primitive()),
        table.lens.clone().into_primitive(),
        slopes,
        sinks,
        options,
    );
    (float(out), float(lse))
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
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
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
    if let Some(cap) = options.module.softcap
        && !(cap > 0.0 && cap.is_finite())
    {
        panic!("{OP}: `softcap` must be positive and finite, got {cap}");
    }
    if let Some(scale) = options.module.scale
        && !scale.is_finite()
    {
        panic!("{OP}: `scale` must be finite, got {scale}");
    }
    check_window_reach(table, query.dims()[2], options.window);
    let f32_terms =
        |t: Option<Tensor<B, 1>>| t.map(|t| t.cast(DType::F32).into_primitive().tensor());
    (f32_terms(alibi_slopes), f32_terms(sinks))
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
    let out = B::flash_kv_append(
        key.into_primitive().tensor(),
        value.into_primitive().tensor(),
        Some(table.table.clone().into_primitive()),
        table.lens.clone().into_primitive(),
        key_new.into_primitive().tensor(),
        value_new.into_primitive().tensor(),
        rope_args,
    );
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
    let (slopes, sinks) = check_decode(&query, &key, &value, &grown, heads, options);
    let (appended, out, lse) = B::flash_append_decode(
        key.into_primitive().tensor(),
        value.into_primitive().tensor(),
        Some(table.table.clone().into_primitive()),
        table.lens.clone().into_primitive(),
        grown.lens.clone().into_primitive(),
        key_new.into_primitive().tensor(),
        value_new.into_primitive().tensor(),
        query.into_primitive().tensor(),
        rope.map(rope_tables),
        slopes,
        sinks,
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

/// `rope`'s tables as the kernels take them (f32 primitives), no query.
fn rope_tables<B: Backend>(rope: &Rope<B>) -> RopeArgs<B> {
    RopeArgs {
        cos: rope.cos.clone().cast(DType::F32).into_primitive().tensor(),
        sin: rope.sin.clone().cast(DType::F32).into_primitive().tensor(),
        interleaved: rope.interleaved,
        query: None,
    }
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

/// Reads an integer tensor to the host.
fn host_ints<B: Backend, const D: usize>(t: IntTensor<B>) -> Vec<usize> {
    let t = Tensor::<B, D, Int>::from_primitive(t);
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap_or_else(|e| panic!("{OP}: could not read an index tensor: {e:?}"))
        .into_iter()
        .map(|x| x.max(0) as usize)
        .collect()
}

/// The pool rows (`[blocks·block_size]` flattened) of keys `0 .. len` of sequence `b`.
fn slots(table: &[usize], width: usize, b: usize, block_size: usize, len: usize) -> Vec<i64> {
    (0..len)
        .map(|j| (table[b * width + j / block_size] * block_size + j % block_size) as i64)
        .collect()
}

/// The composed decoding: each sequence's keys gathered (lengths and table read to the host),
/// then the composed attention per sequence ([`AttentionBackend::flash_decode`]'s provided
/// body).
#[allow(clippy::too_many_arguments)]
pub(crate) fn composed_decode<B: AttentionBackend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    table: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
    slopes: Option<FloatTensor<B>>,
    sinks: Option<FloatTensor<B>>,
    options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let query = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(query));
    let key = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(key));
    let value = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(value));
    let lengths = host_ints::<B, 1>(lengths);
    let batch = query.dims()[0];
    let device = query.device();
    let gather = |pool: &Tensor<B, 4>,
                  b: usize,
                  len: usize,
                  table: &Option<(Vec<usize>, usize)>| {
        match table {
            Some((entries, width)) => {
                let [blocks, block_size, heads, cols] = pool.dims();
                let idx = slots(entries, *width, b, block_size, len);
                let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [len]), &device);
                pool.clone()
                    .reshape([blocks * block_size, heads, cols])
                    .select(0, idx)
                    .swap_dims(0, 1)
                    .unsqueeze_dim::<4>(0)
            }
            None => pool.clone().slice([b..b + 1, 0..pool.dims()[1], 0..len]),
        }
    };
    let table = table.map(|t| {
        let width = Tensor::<B, 2, Int>::from_primitive(t.clone()).dims()[1];
        (host_ints::<B, 2>(t), width)
    });
    let mut outs = Vec::with_capacity(batch);
    let mut lses = Vec::with_capacity(batch);
    let [_, heads_q, seq_q, _] = query.dims();
    let value_dim = value.dims()[3];
    for (b, &len) in lengths.iter().enumerate().take(batch) {
        if len == 0 {
            // No key: zeros and lse = −inf (gathering nothing is not every backend's op).
            let dtype = query.dtype();
            outs.push(Tensor::zeros(
                [1, heads_q, seq_q, value_dim],
                (&device, dtype),
            ));
            lses.push(Tensor::full(
                [1, heads_q, seq_q],
                f32::NEG_INFINITY,
                (&device, DType::F32),
            ));
            continue;
        }
        let q = query.clone().narrow(0, b, 1);
        let k = gather(&key, b, len, &table);
        let v = gather(&value, b, len, &table);
        let (out, lse) = B::flash_attention(
            q.into_primitive().tensor(),
            k.into_primitive().tensor(),
            v.into_primitive().tensor(),
            None,
            None,
            slopes.clone(),
            sinks.clone(),
            None,
            options,
        );
        outs.push(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out)));
        lses.push(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse)));
    }
    (
        Tensor::cat(outs, 0).into_primitive().tensor(),
        Tensor::cat(lses, 0).into_primitive().tensor(),
    )
}

/// `x` `[B, H, S, D]` rotated by RoPE at positions `positions[b] + s`, in f32, back in `x`'s
/// dtype.
fn rotate<B: Backend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    positions: &[usize],
    interleaved: bool,
) -> Tensor<B, 4> {
    let [batch, heads, new, dim] = x.dims();
    let half = cos.dims()[1];
    let dtype = x.dtype();
    let device = x.device();
    let idx: Vec<i64> = positions
        .iter()
        .flat_map(|&p| (0..new).map(move |s| (p + s) as i64))
        .collect();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [batch * new]), &device);
    let angles = |t: &Tensor<B, 2>| {
        t.clone()
            .select(0, idx.clone())
            .reshape([batch, 1, new, half])
    };
    let (c, s) = (angles(cos), angles(sin));
    let x = x.cast(DType::F32);
    let rot = x.clone().slice([0..batch, 0..heads, 0..new, 0..2 * half]);
    let (x0, x1) = if interleaved {
        let pairs = rot.reshape([batch, heads, new, half, 2]);
        let x0 = pairs
            .clone()
            .slice([0..batch, 0..heads, 0..new, 0..half, 0..1]);
        let x1 = pairs.slice([0..batch, 0..heads, 0..new, 0..half, 1..2]);
        (
            x0.reshape([batch, heads, new, half]),
            x1.reshape([batch, heads, new, half]),
        )
    } else {
        (
            rot.clone().slice([0..batch, 0..heads, 0..new, 0..half]),
            rot.slice([0..batch, 0..heads, 0..new, half..2 * half]),
        )
    };
    let y0 = x0.clone() * c.clone() - x1.clone() * s.clone();
    let y1 = x0 * s + x1 * c;
    let rotated = if interleaved {
        Tensor::stack::<5>(vec![y0, y1], 4).reshape([batch, heads, new, 2 * half])
    } else {
        Tensor::cat(vec![y0, y1], 3)
    };
    let rest = x.slice([0..batch, 0..heads, 0..new, 2 * half..dim]);
    Tensor::cat(vec![rotated, rest], 3).cast(dtype)
}

/// The composed append: the lengths (and table) read to the host, RoPE from stock ops, the rows
/// written with `select_assign` (pools) or `slice_assign` (contiguous caches)
/// ([`AttentionBackend::flash_kv_append`]'s provided body).
pub(crate) fn composed_append<B: Backend>(
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    table: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
    key_new: FloatTensor<B>,
    value_new: FloatTensor<B>,
    rope: Option<RopeArgs<B>>,
) -> Appended<B> {
    let float4 = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (key, value) = (float4(key), float4(value));
    let (mut key_new, value_new) = (float4(key_new), float4(value_new));
    let lengths = host_ints::<B, 1>(lengths);
    let mut query = None;
    if let Some(r) = rope {
        let float2 = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
        let (cos, sin) = (float2(r.cos), float2(r.sin));
        key_new = rotate(key_new, &cos, &sin, &lengths, r.interleaved);
        query = r
            .query
            .map(|q| rotate(float4(q), &cos, &sin, &lengths, r.interleaved));
    }
    let [batch, heads, new, _] = key_new.dims();
    let device = key.device();
    let write = |cache: Tensor<B, 4>, rows: Tensor<B, 4>| -> Tensor<B, 4> {
        let cols = rows.dims()[3];
        match &table {
            Some(t) => {
                let width = Tensor::<B, 2, Int>::from_primitive(t.clone()).dims()[1];
                let entries = host_ints::<B, 2>(t.clone());
                let [blocks, block_size, _, _] = cache.dims();
                let idx: Vec<i64> = (0..batch)
                    .flat_map(|b| {
                        let all = slots(&entries, width, b, block_size, lengths[b] + new);
                        all[lengths[b]..].to_vec()
                    })
                    .collect();
                let idx =
                    Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [batch * new]), &device);
                let rows = rows.swap_dims(1, 2).reshape([batch * new, heads, cols]);
                // Added to the rows' negation: exactly the new values (`x + (−x) = 0`), with
                // the `Add` update every backend implements.
                let flat = cache.reshape([blocks * block_size, heads, cols]);
                let old = flat.clone().select(0, idx.clone()).neg();
                flat.select_assign(0, idx.clone(), old, IndexingUpdateOp::Add)
                    .select_assign(0, idx, rows, IndexingUpdateOp::Add)
                    .reshape([blocks, block_size, heads, cols])
            }
            None => {
                let mut cache = cache;
                for (b, &len) in lengths.iter().enumerate().take(batch) {
                    let row = rows.clone().narrow(0, b, 1);
                    cache = cache.slice_assign([b..b + 1, 0..heads, len..len + new, 0..cols], row);
                }
                cache
            }
        }
    };
    Appended {
        key: write(key, key_new).into_primitive().tensor(),
        value: write(value, value_new).into_primitive().tensor(),
        query: query.map(|q| q.into_primitive().tensor()),
    }
}

/// The decoding and append ops on `Autodiff<B>`: `B`'s, on the untracked values (inference
/// ops: no gradient flows through them).
pub(crate) mod autodiff {
    use super::*;

    /// The output and the log-sum-exp.
    type Pair<A> = (FloatTensor<A>, FloatTensor<A>);

    fn inner<B: FlashBackend, C: CheckpointStrategy>(
        t: FloatTensor<Autodiff<B, C>>,
    ) -> FloatTensor<B> {
        Autodiff::<B, C>::inner(t)
    }

    fn untracked<B: FlashBackend, C: CheckpointStrategy>(
        t: FloatTensor<B>,
    ) -> FloatTensor<Autodiff<B, C>> {
        Autodiff::<B, C>::from_inner(t)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode<B: FlashBackend, C: CheckpointStrategy>(
        query: FloatTensor<Autodiff<B, C>>,
        key: FloatTensor<Autodiff<B, C>>,
        value: FloatTensor<Autodiff<B, C>>,
        table: Option<IntTensor<B>>,
        lengths: IntTensor<B>,
        slopes: Option<FloatTensor<Autodiff<B, C>>>,
        sinks: Option<FloatTensor<Autodiff<B, C>>>,
        options: FlashAttentionOptions,
    ) -> Pair<Autodiff<B, C>> {
        let (out, lse) = B::flash_decode(
            inner::<B, C>(query),
            inner::<B, C>(key),
            inner::<B, C>(value),
            table,
            lengths,
            slopes.map(inner::<B, C>),
            sinks.map(inner::<B, C>),
            options,
        );
        (untracked::<B, C>(out), untracked::<B, C>(lse))
    }

    pub(crate) fn append<B: FlashBackend, C: CheckpointStrategy>(
        key: FloatTensor<Autodiff<B, C>>,
        value: FloatTensor<Autodiff<B, C>>,
        table: Option<IntTensor<B>>,
        lengths: IntTensor<B>,
        key_new: FloatTensor<Autodiff<B, C>>,
        value_new: FloatTensor<Autodiff<B, C>>,
        rope: Option<RopeArgs<Autodiff<B, C>>>,
    ) -> Appended<Autodiff<B, C>> {
        let rope = rope.map(|r| RopeArgs {
            cos: inner::<B, C>(r.cos),
            sin: inner::<B, C>(r.sin),
            interleaved: r.interleaved,
            query: r.query.map(inner::<B, C>),
        });
        let out = B::flash_kv_append(
            inner::<B, C>(key),
            inner::<B, C>(value),
            table,
            lengths,
            inner::<B, C>(key_new),
            inner::<B, C>(value_new),
            rope,
        );
        Appended {
            key: untracked::<B, C>(out.key),
            value: untracked::<B, C>(out.value),
            query: out.query.map(untracked::<B, C>),
        }
    }

    pub(crate) fn append_decode<B: FlashBackend, C: CheckpointStrategy>(
        (key, value, table, lengths, lengths_after): AppendCaches<Autodiff<B, C>>,
        (key_new, value_new, query, rope): AppendRows<Autodiff<B, C>>,
        slopes: Option<FloatTensor<Autodiff<B, C>>>,
        sinks: Option<FloatTensor<Autodiff<B, C>>>,
        options: FlashAttentionOptions,
    ) -> AppendDecoded<Autodiff<B, C>> {
        let rope = rope.map(|r| RopeArgs {
            cos: inner::<B, C>(r.cos),
            sin: inner::<B, C>(r.sin),
            interleaved: r.interleaved,
            query: None,
        });
        let (appended, out, lse) = B::flash_append_decode(
            inner::<B, C>(key),
            inner::<B, C>(value),
            table,
            lengths,
            lengths_after,
            inner::<B, C>(key_new),
            inner::<B, C>(value_new),
            inner::<B, C>(query),
            rope,
            slopes.map(inner::<B, C>),
            sinks.map(inner::<B, C>),
            options,
        );
        let appended = Appended {
            key: untracked::<B, C>(appended.key),
            value: untracked::<B, C>(appended.value),
            query: appended.query.map(untracked::<B, C>),
        };
        (appended, untracked::<B, C>(out), untracked::<B, C>(lse))
    }
}
