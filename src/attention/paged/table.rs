//! The block table of a paged cache: which pool blocks each sequence's positions live in,
//! and its checks.

use super::*;

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
    pub(super) blocks: Vec<Vec<usize>>,
    pub(super) evicted: Vec<usize>,
    pub(super) lengths: Vec<usize>,
    pub(super) block_size: usize,
    pub(super) pool_blocks: usize,
    pub(super) table: Tensor<B, 2, Int>,
    pub(super) lens: Tensor<B, 1, Int>,
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
pub(super) fn check_room(b: usize, len: usize, blocks: usize, block_size: usize) {
    if len > blocks * block_size {
        panic!(
            "{OP}: sequence {b} holds {len} keys but its {blocks} blocks of {block_size} hold {}",
            blocks * block_size
        );
    }
}

/// The device copy of the sequences' lengths the kernels read.
pub(super) fn upload_lengths<B: Backend>(
    lengths: &[usize],
    device: &B::Device,
) -> Tensor<B, 1, Int> {
    let host: Vec<i32> = lengths.iter().map(|&l| l as i32).collect();
    Tensor::from_data(TensorData::new(host, [lengths.len()]), device)
}
