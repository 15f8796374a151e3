//! Which part of the problem a cube owns (FlashAttention-2's `block_info.h`): the grid layout
//! of both directions and, on the device, the batch, heads, rows and keys of the cube.
//!
//! Forward grids are `(column tiles of Dv, row blocks of G·Sq, B·Hkv)`, backward grids
//! `(blocks, y, z)` with `y·z ≥ B·Hkv`: in both, the (batch, key/value head) pairs are folded
//! over two axes so that any `B·Hkv` runs.

use cubecl::prelude::*;

use crate::flash::args::ScoreArgs;
use crate::flash::config::FlashConfig;
use crate::flash::keys::{KeyRange, key_range};

/// The grid of a forward launch: `x` cubes along the output's column tiles, and `row_blocks`
/// row blocks for each of `pairs` (batch, key/value head) pairs, the pairs folded over y and z
/// (`y = fold·row_blocks`, `z = ⌈pairs / fold⌉`, with `fold` the fewest copies that keep `z`
/// within `max.2`), so that any `B·Hkv` runs. `None` when even that exceeds the device's
/// limits `max`.
pub fn fold_grid(
    x: usize,
    row_blocks: usize,
    pairs: usize,
    max: (u32, u32, u32),
) -> Option<(usize, usize, usize)> {
    let (x, row_blocks, pairs) = (x.max(1), row_blocks.max(1), pairs.max(1));
    let fold = pairs.div_ceil(max.2 as usize);
    let cubes = (x, row_blocks * fold, pairs.div_ceil(fold));
    (cubes.0 <= max.0 as usize && cubes.1 <= max.1 as usize).then_some(cubes)
}

/// The part of the problem one cube of a flash kernel owns, read from the grid position
/// `(x, y, z)` = (output column tile, block of query rows, batch × key/value head; the last two
/// folded as [`fold_grid`] lays them out, and cubes past the last pair exit): query rows
/// `row0 .. row0 + block_q` of key/value head `hkv` of batch `batch` (rows run over the `G`
/// query heads of the group, `Sq` positions each: row `r` is head `head0 + r / Sq`, position
/// `r % Sq`) and output columns `col0 .. col0 + value_dim`. The column tiles of a row block are
/// adjacent in the grid, so they run together and read the block's scores from L2 (given
/// scores: `X` is read once per column tile).
#[derive(CubeType)]
pub struct CubeBlock {
    /// `Sq`.
    pub seq_q: usize,
    /// `Sk`.
    pub seq_k: usize,
    /// Query rows of a key/value head: `G·Sq`.
    pub rows: usize,
    /// The batch.
    pub batch: usize,
    /// The key/value head.
    pub hkv: usize,
    /// The group's first query head.
    pub head0: usize,
    /// The first row.
    pub row0: usize,
    /// The first output column.
    pub col0: usize,
    /// Whether this is the first column tile (the one that writes the log-sum-exp).
    pub first_tile: bool,
    /// The keys any of the rows sees: `kv_start .. kv_end` (all of them but under a causal mask
    /// or a window), `kv_start` a multiple of `c.block_k` and `kv_end ≥ kv_start`.
    pub kv_start: usize,
    /// See `kv_start`.
    pub kv_end: usize,
    /// The keys every row sees: `full_start .. full_end` (possibly empty).
    pub full_start: usize,
    /// See `full_start`.
    pub full_end: usize,
}

#[cube]
impl CubeBlock {
    /// Key steps of `c.block_k` keys from `kv_start` to `kv_end`.
    pub fn steps(&self, #[comptime] c: FlashConfig) -> usize {
        (self.kv_end - self.kv_start).div_ceil(comptime!(c.block_k as usize))
    }

    /// The first key of step `st`.
    pub fn step_key(&self, st: usize, #[comptime] c: FlashConfig) -> usize {
        self.kv_start + st * comptime!(c.block_k as usize)
    }

    /// Whether every row sees every key of step `st` (no bound, causal or window test).
    pub fn full_step(&self, st: usize, #[comptime] c: FlashConfig) -> bool {
        let j0 = self.step_key(st, c);
        j0 >= self.full_start && j0 + comptime!(c.block_k as usize) <= self.full_end
    }
}

/// The keys some of the query positions `pos_lo ..= pos_hi` see (`any`) and the keys all of
/// them see (`all`), under the causal mask, the window and packed sequences ([`key_range()`]:
/// both ends grow with the position).
#[derive(CubeType)]
pub struct SpanKeys {
    /// Keys some position sees.
    pub any: KeyRange,
    /// Keys every position sees.
    pub all: KeyRange,
}

/// [`SpanKeys`] of the positions `pos_lo ..= pos_hi`.
#[cube]
pub fn span_keys(
    seqs: &Tensor<u32>,
    pos_lo: usize,
    pos_hi: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> SpanKeys {
    let lo = key_range(seqs, pos_lo, seq_q, seq_k, args, c);
    let hi = key_range(seqs, pos_hi, seq_q, seq_k, args, c);
    SpanKeys {
        any: KeyRange {
            start: lo.start,
            end: usize::max(hi.end, lo.start),
        },
        all: KeyRange {
            start: hi.start,
            end: lo.end,
        },
    }
}

/// The smallest and largest query position among rows `r0 ..= last` of a group of `Sq`
/// positions per head (all of them when the rows span heads).
#[cube]
pub fn span_positions(r0: usize, last: usize, seq_q: usize) -> KeyRange {
    let one_head = r0 / seq_q == last / seq_q;
    KeyRange {
        start: select(one_head, r0 % seq_q, 0),
        end: select(one_head, last % seq_q, seq_q - 1),
    }
}

/// The [`CubeBlock`] of this cube for queries `q` (the scores `X` when they are given) and
/// keys `k`, under the call's window `args` and packed sequences `seqs`.
#[cube]
pub fn cube_block<Q: CubePrimitive, K: CubePrimitive>(
    q: &Tensor<Q>,
    k: &Tensor<K>,
    seqs: &Tensor<u32>,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> CubeBlock {
    let seq_q = q.shape(2);
    let mut seq_k = k.shape(2);
    let mut heads_kv = k.shape(1);
    if comptime!(c.given()) {
        seq_k = q.shape(3);
        heads_kv = q.shape(1);
    }
    let group = q.shape(1) / heads_kv;
    let rows = group * seq_q;
    // `B·Hkv` folded over y and z ([`fold_grid`]): y runs over `fold` copies of the row blocks.
    let row_blocks = rows.div_ceil(comptime!(c.block_q as usize));
    let fold = CUBE_COUNT_Y as usize / row_blocks;
    let pair = CUBE_POS_Z as usize * fold + CUBE_POS_Y as usize / row_blocks;
    if pair >= q.shape(0) * heads_kv {
        terminate!();
    }
    let hkv = pair % heads_kv;
    let row0 = (CUBE_POS_Y as usize % row_blocks) * comptime!(c.block_q as usize);
    // With a causal mask, a window or packed sequences: from the first row's first key to the
    // last row's last, and all keys between the last row's first and the first row's last.
    let last = usize::min(row0 + comptime!(c.block_q as usize), rows) - 1;
    let mut kv_start = 0usize;
    let mut kv_end = seq_k;
    let mut full_start = 0usize;
    let mut full_end = seq_k;
    if comptime!(c.ranged()) {
        let pos = span_positions(row0, last, seq_q);
        let keys = span_keys(seqs, pos.start, pos.end, seq_q, seq_k, args, c);
        let bk = comptime!(c.block_k as usize);
        kv_start = (keys.any.start / bk) * bk;
        kv_end = keys.any.end;
        full_start = keys.all.start;
        full_end = keys.all.end;
    }
    CubeBlock {
        seq_q,
        seq_k,
        rows,
        batch: pair / heads_kv,
        hkv,
        head0: hkv * group,
        row0,
        col0: (CUBE_POS_X * c.value_dim) as usize,
        first_tile: CUBE_POS_X == 0,
        kv_start,
        kv_end,
        full_start,
        full_end,
    }
}

/// The query rows of one (batch, key/value head) pair: the `rows = G·Sq` rows of the group's
/// query heads, `Sq` positions each, so that row `r` is head `head0 + r / Sq`, position
/// `r % Sq`. Rows past the end are clamped to the last row (computed, never stored).
#[derive(CubeType)]
pub struct QueryGroup {
    /// The batch.
    pub batch: usize,
    /// The group's first query head.
    pub head0: usize,
    /// `G·Sq`.
    pub rows: usize,
    /// `Sq`.
    pub seq_q: usize,
}

#[cube]
impl QueryGroup {
    /// The query head of row `row` (clamped).
    pub fn head(&self, row: usize) -> usize {
        self.head0 + usize::min(row, self.rows - 1) / self.seq_q
    }

    /// The query position of row `row` (clamped).
    pub fn pos(&self, row: usize) -> usize {
        usize::min(row, self.rows - 1) % self.seq_q
    }

    /// The element offset of row `row` (clamped) of `t` (`[B, H, S, ·]`, column 0).
    pub fn offset<T: CubePrimitive>(&self, t: &Tensor<T>, row: usize) -> usize {
        self.batch * t.stride(0) + self.head(row) * t.stride(1) + self.pos(row) * t.stride(2)
    }
}

/// The [`QueryGroup`] of a forward cube.
#[cube]
pub fn cube_group(blk: &CubeBlock) -> QueryGroup {
    QueryGroup {
        batch: blk.batch,
        head0: blk.head0,
        rows: blk.rows,
        seq_q: blk.seq_q,
    }
}

/// The [`QueryGroup`] of a backward cube.
#[cube]
pub fn pair_group(blk: &PairBlock) -> QueryGroup {
    QueryGroup {
        batch: blk.batch,
        head0: blk.head0,
        rows: blk.rows,
        seq_q: blk.seq_q,
    }
}

/// The sizes a backward cube reads from its tensors, and the (batch, key/value head) pair it
/// owns (grid axes y and z, [`fold_pairs`]).
#[derive(CubeType)]
pub struct PairBlock {
    /// `Sq`.
    pub seq_q: usize,
    /// `Sk`.
    pub seq_k: usize,
    /// `D` (the columns of the given scores `X` with [`crate::flash::ScoreSource::Given`]).
    pub head_dim: usize,
    /// `Dv`.
    pub value_dim: usize,
    /// `Hkv`.
    pub heads_kv: usize,
    /// Query heads per key/value head, `G = Hq / Hkv`.
    pub group: usize,
    /// Query rows of a key/value head: `G·Sq`.
    pub rows: usize,
    /// The batch.
    pub batch: usize,
    /// The key/value head.
    pub hkv: usize,
    /// The group's first query head.
    pub head0: usize,
}

/// The [`PairBlock`] of this backward cube for queries `q` (the scores `X` when they are
/// given: `[B, H, Sq, Sk]`, `Hkv = H`), keys `k` and values `v`. Cubes past the last pair exit.
#[cube]
pub fn pair_block<Q: CubePrimitive, K: CubePrimitive, V: CubePrimitive>(
    q: &Tensor<Q>,
    k: &Tensor<K>,
    v: &Tensor<V>,
    #[comptime] c: FlashConfig,
) -> PairBlock {
    let mut heads_kv = k.shape(1);
    let mut seq_k = k.shape(2);
    if comptime!(c.given()) {
        heads_kv = v.shape(1);
        seq_k = q.shape(3);
    }
    let seq_q = q.shape(2);
    let group = q.shape(1) / heads_kv;
    let pair = pair_index();
    if pair >= q.shape(0) * heads_kv {
        terminate!();
    }
    let hkv = pair % heads_kv;
    PairBlock {
        seq_q,
        seq_k,
        head_dim: q.shape(3),
        value_dim: v.shape(3),
        heads_kv,
        group,
        rows: group * seq_q,
        batch: pair / heads_kv,
        hkv,
        head0: hkv * group,
    }
}

/// The keys some of the rows `r0 .. r0 + n` of a [`PairBlock`] see: all of them but under a
/// causal mask, a window or packed sequences `seqs` ([`span_keys()`]), the start rounded down
/// to a multiple of `step`.
#[cube]
pub fn rows_keys(
    blk: &PairBlock,
    seqs: &Tensor<u32>,
    r0: usize,
    n: usize,
    args: &ScoreArgs,
    #[comptime] step: usize,
    #[comptime] c: FlashConfig,
) -> KeyRange {
    let mut start = 0usize;
    let mut end = blk.seq_k;
    if comptime!(c.ranged()) {
        let last = usize::min(r0 + n, blk.rows) - 1;
        let pos = span_positions(r0, last, blk.seq_q);
        let keys = span_keys(seqs, pos.start, pos.end, blk.seq_q, blk.seq_k, args, c);
        start = (keys.any.start / step) * step;
        end = keys.any.end;
    }
    KeyRange { start, end }
}

/// The (batch, key/value head) pair of this backward cube, from the grid's `(y, z)` axes.
#[cube]
pub fn pair_index() -> usize {
    (CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y) as usize
}

/// `B·Hkv` (`pairs`) over a backward grid's y and z axes, as [`pair_index()`] reads it
/// (`z·count_y + y`).
pub fn fold_pairs(pairs: usize, max_y: u32) -> (usize, usize) {
    let y = pairs.clamp(1, max_y as usize);
    (y, pairs.div_ceil(y).max(1))
}

/// Rows of a row-per-32-units kernel per cube ([`row_of_group()`]).
pub const GROUP_ROWS: u32 = 8;

/// The row of this group of 32 units in a row-per-32-units kernel ([`GROUP_ROWS`] rows per
/// cube, cubes along x then y).
#[cube]
pub fn row_of_group() -> usize {
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    cube * GROUP_ROWS as usize + (UNIT_POS / 32) as usize
}

/// Grid of a row-per-32-units kernel over `rows` rows ([`row_of_group()`]): `(x, y, 1)`.
pub fn row_groups_grid(rows: usize) -> (usize, usize, usize) {
    let cubes = rows.div_ceil(GROUP_ROWS as usize).max(1);
    let x = cubes.min(65535);
    (x, cubes.div_ceil(x), 1)
}

/// A grid `(x, y, z)` as a launch's cube count.
pub fn cube_count(cubes: (usize, usize, usize)) -> cubecl::CubeCount {
    cubecl::CubeCount::Static(cubes.0 as u32, cubes.1 as u32, cubes.2 as u32)
}
