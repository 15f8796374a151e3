//! A paged KV cache for a stack of attention layers serving many sequences at once (vLLM's
//! block manager in miniature): one block pool per layer, one block allocator and one set of
//! block lists shared by every layer (each layer holds the same positions of each sequence).
//!
//! A step for sequences `ids` with `S` new tokens each: [`PagedKvCache::reserve`] takes blocks
//! from the free list where a sequence's blocks are full and returns the step's
//! [`PagedStep`]; per layer, [`PagedKvCache::append`] writes the projected keys and values
//! into their blocks in place (optionally rotating keys and queries with RoPE) and
//! [`PagedKvCache::attend`] runs the decoding kernel through the block table; then
//! [`PagedKvCache::commit`] records the new lengths. [`PagedKvCache::release`] returns a
//! finished sequence's blocks to the free list. The table and lengths are uploaded once per
//! step for all layers.
//!
//! For sliding-window attention, [`PagedKvCache::with_window`] makes the cache rolling: at each
//! commit a sequence gives back the blocks whose keys no later query can see, so that after each
//! step it holds at most `left / block_size + 2` blocks however long it runs (Mistral's rolling
//! buffer).

use burn::tensor::{DType, Tensor};

use crate::attention::{BlockTable, HeadTerms, Rope};
use crate::{
    FlashAttentionOptions, FlashBackend, append_attention_paged, append_paged, attention_paged,
};

/// A sequence's blocks (from its first held one) and the keys it holds.
#[derive(Debug, Clone)]
struct Sequence {
    blocks: Vec<usize>,
    /// Leading blocks given back by a rolling cache.
    evicted: usize,
    len: usize,
}

/// The tables of one step ([`PagedKvCache::reserve`]): before the append (for
/// [`PagedKvCache::append`]) and after it (for [`PagedKvCache::attend`]).
#[derive(Debug, Clone)]
pub struct PagedStep<B: FlashBackend> {
    ids: Vec<usize>,
    new: usize,
    before: BlockTable<B>,
    after: BlockTable<B>,
}

impl<B: FlashBackend> PagedStep<B> {
    /// The sequences of the step, in batch order.
    pub fn ids(&self) -> &[usize] {
        &self.ids
    }

    /// The table after the step's append (lengths included).
    pub fn table(&self) -> &BlockTable<B> {
        &self.after
    }
}

/// Paged keys and values of `layers` attention layers (module docs).
#[derive(Debug)]
pub struct PagedKvCache<B: FlashBackend> {
    keys: Vec<Option<Tensor<B, 4>>>,
    values: Vec<Option<Tensor<B, 4>>>,
    block_size: usize,
    blocks: usize,
    free: Vec<usize>,
    sequences: Vec<Option<Sequence>>,
    /// A rolling cache's window: keys a query sees before its own position.
    window: Option<usize>,
    /// The sequences of the last committed step and its table after the append: the next
    /// step's table before its append when it runs the same sequences in the same blocks
    /// (decoding between block boundaries), so that nothing is checked or uploaded again.
    last: Option<(Vec<usize>, BlockTable<B>)>,
}

impl<B: FlashBackend> PagedKvCache<B> {
    /// Pools of `blocks` blocks of `block_size` positions for `layers` layers of `heads_kv`
    /// key/value heads of `head_dim` columns, in `dtype`, zero-filled.
    pub fn new(
        layers: usize,
        blocks: usize,
        block_size: usize,
        heads_kv: usize,
        head_dim: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Self {
        if block_size == 0 || blocks == 0 {
            panic!("PagedKvCache: `blocks` and `block_size` must be positive");
        }
        let pool = || {
            Some(Tensor::zeros(
                [blocks, block_size, heads_kv, head_dim],
                (device, dtype),
            ))
        };
        Self {
            keys: (0..layers).map(|_| pool()).collect(),
            values: (0..layers).map(|_| pool()).collect(),
            block_size,
            blocks,
            free: (0..blocks).rev().collect(),
            sequences: Vec::new(),
            window: None,
            last: None,
        }
    }

    /// The cache made rolling for attention with a window of `left` keys before each query
    /// (`FlashAttentionOptions::window` `(left, 0)`, causal): after each step a sequence gives
    /// back the blocks that lie wholly before its next query's window. Attention through the
    /// cache with a wider window is refused.
    pub fn with_window(mut self, left: usize) -> Self {
        self.window = Some(left);
        self
    }

    /// Blocks sequence `id` holds.
    ///
    /// # Panics
    /// When `id` is not a live sequence.
    pub fn held_blocks(&self, id: usize) -> usize {
        self.live(id).blocks.len()
    }

    /// A new, empty sequence; its id.
    pub fn add_sequence(&mut self) -> usize {
        let seq = Sequence {
            blocks: Vec::new(),
            evicted: 0,
            len: 0,
        };
        match self.sequences.iter().position(Option::is_none) {
            Some(id) => {
                self.sequences[id] = Some(seq);
                id
            }
            None => {
                self.sequences.push(Some(seq));
                self.sequences.len() - 1
            }
        }
    }

    /// Returns sequence `id`'s blocks to the free list; the id may be given out again.
    ///
    /// # Panics
    /// When `id` is not a live sequence.
    pub fn release(&mut self, id: usize) {
        let seq = self.take_live(id);
        self.free.extend(seq.blocks.into_iter().rev());
        self.last = None;
    }

    /// Positions sequence `id` holds.
    ///
    /// # Panics
    /// When `id` is not a live sequence.
    pub fn len(&self, id: usize) -> usize {
        self.live(id).len
    }

    /// Whether sequence `id` holds no position.
    ///
    /// # Panics
    /// When `id` is not a live sequence.
    pub fn is_empty(&self, id: usize) -> bool {
        self.len(id) == 0
    }

    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    fn live(&self, id: usize) -> &Sequence {
        self.sequences
            .get(id)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("PagedKvCache: sequence {id} is not live"))
    }

    fn take_live(&mut self, id: usize) -> Sequence {
        self.sequences
            .get_mut(id)
            .and_then(Option::take)
            .unwrap_or_else(|| panic!("PagedKvCache: sequence {id} is not live"))
    }

    /// Makes room for `new` more positions in each sequence of `ids` (taking blocks from the
    /// free list) and returns the step's tables.
    ///
    /// # Panics
    /// When a sequence is not live or listed twice, or the pool runs out of blocks.
    pub fn reserve(&mut self, ids: &[usize], new: usize, device: &B::Device) -> PagedStep<B> {
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                panic!("PagedKvCache: sequence {id} is listed twice in one step");
            }
        }
        let mut taken = false;
        for &id in ids {
            let bs = self.block_size;
            let seq = self.live(id).clone();
            let needed = (seq.len + new).div_ceil(bs);
            let mut blocks = seq.blocks;
            while seq.evicted + blocks.len() < needed {
                taken = true;
                let block = self.free.pop().unwrap_or_else(|| {
                    panic!(
                        "PagedKvCache: the pool of {} blocks is exhausted (sequence {id} needs {needed})",
                        self.blocks
                    )
                });
                blocks.push(block);
            }
            self.sequences[id] = Some(Sequence { blocks, ..seq });
        }
        let before = match self.last.take() {
            Some((last_ids, table)) if !taken && last_ids == ids => table,
            _ => {
                let lists = ids.iter().map(|&id| self.live(id).blocks.clone()).collect();
                let evicted = ids.iter().map(|&id| self.live(id).evicted).collect();
                let lengths = ids.iter().map(|&id| self.live(id).len).collect();
                BlockTable::rolling(
                    lists,
                    evicted,
                    lengths,
                    self.block_size,
                    self.blocks,
                    device,
                )
            }
        };
        let after = before.grown(new);
        PagedStep {
            ids: ids.to_vec(),
            new,
            before,
            after,
        }
    }

    /// Writes layer `layer`'s new keys and values `[n, Hkv, S, D]` of the step's sequences
    /// into their blocks in place; with `rope`, rotates the keys and returns the queries
    /// `[n, Hq, S, D]` rotated at the same positions.
    pub fn append(
        &mut self,
        layer: usize,
        step: &PagedStep<B>,
        key: Tensor<B, 4>,
        value: Tensor<B, 4>,
        rope: Option<(&Rope<B>, Tensor<B, 4>)>,
    ) -> Option<Tensor<B, 4>> {
        let k_pool = self.keys[layer].take().expect("the key pool");
        let v_pool = self.values[layer].take().expect("the value pool");
        let (rope, query) = match rope {
            Some((r, q)) => (Some(r), Some(q)),
            None => (None, None),
        };
        let out = append_paged(k_pool, v_pool, &step.before, key, value, rope, query);
        self.keys[layer] = Some(out.key);
        self.values[layer] = Some(out.value);
        out.query
    }

    /// Attention of layer `layer`'s queries `[n, Hq, Sq, D]` (each sequence's last `Sq`
    /// positions after the step) against the step's sequences.
    pub fn attend(
        &self,
        layer: usize,
        step: &PagedStep<B>,
        query: Tensor<B, 4>,
        options: FlashAttentionOptions,
    ) -> Tensor<B, 4> {
        let k = self.keys[layer].clone().expect("the key pool");
        let v = self.values[layer].clone().expect("the value pool");
        attention_paged(query, k, v, &step.after, HeadTerms::default(), options).0
    }

    /// [`PagedKvCache::append`] then [`PagedKvCache::attend`] as one op
    /// ([`append_attention_paged`]): layer `layer`'s new keys and values `[n, Hkv, S, D]` written
    /// in place, then its queries `[n, Hq, S, D]` (rotated with the keys where `rope` is given)
    /// attend to the step's sequences. Returns the output `[n, Hq, S, Dv]`.
    pub fn append_attend(
        &mut self,
        layer: usize,
        step: &PagedStep<B>,
        key: Tensor<B, 4>,
        value: Tensor<B, 4>,
        query: Tensor<B, 4>,
        rope: Option<&Rope<B>>,
        options: FlashAttentionOptions,
    ) -> Tensor<B, 4> {
        let k_pool = self.keys[layer].take().expect("the key pool");
        let v_pool = self.values[layer].take().expect("the value pool");
        let heads = HeadTerms::default();
        let (pools, out, _) = append_attention_paged(
            k_pool,
            v_pool,
            &step.before,
            key,
            value,
            query,
            rope,
            heads,
            options,
        );
        self.keys[layer] = Some(pools.key);
        self.values[layer] = Some(pools.value);
        out
    }

    /// Records the step's new positions (after every layer appended); a rolling cache then
    /// gives back the blocks before the next queries' window.
    pub fn commit(&mut self, step: PagedStep<B>) {
        let mut evicted = false;
        for &id in &step.ids {
            let seq = self.sequences[id].as_mut().expect("a live sequence");
            seq.len += step.new;
            if let Some(left) = self.window {
                // The next query sits at `len` and sees keys from `len − left` on.
                let unseen = seq.len.saturating_sub(left) / self.block_size;
                let give = unseen.saturating_sub(seq.evicted).min(seq.blocks.len());
                if give > 0 {
                    self.free.extend(seq.blocks.drain(..give).rev());
                    seq.evicted += give;
                    evicted = true;
                }
            }
        }
        self.last = (!evicted).then_some((step.ids, step.after));
    }
}
