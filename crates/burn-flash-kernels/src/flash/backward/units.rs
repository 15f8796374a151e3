//! The flash backward on plain units (every runtime, every float type; f32 arithmetic):
//! FlashAttention-2's schedule, nothing of size `Sq × Sk` kept.
//!
//! The math is [`crate::flash::backward`]'s (`δ` comes from its
//! [`crate::flash::backward::flash_delta()`] prepass).
//!
//! Two kernels, each owning its output so that nothing is accumulated across cubes:
//! - [`flash_backward_dkv()`]: one cube per block of [`BLOCK_KEYS`] keys (and per tile of
//!   [`COL_TILE`] columns of `dK`/`dV`) of one (batch, key/value head), looping over every
//!   query row of the head's group in steps of [`STEP_ROWS`] (`G·Sq` rows, the query heads of
//!   a group summed in the kernel, nothing repeated), steps above a causal diagonal skipped;
//! - [`flash_backward_dq()`]: one cube per block of [`BLOCK_ROWS`] query rows, looping over
//!   the keys the rows see (up to the causal diagonal) in steps of [`STEP_KEYS`]; it also
//!   writes `dS` where the bias needs a gradient.
//!
//! **Register tiling.** Operands are staged in shared memory as f32 4-vectors, [`CHUNK`]
//! columns at a time, the 4-vector index XOR-swizzled by the row (a quarter-plane reading 8
//! consecutive rows at one column hits every bank once; 32 KiB in all, WebGPU's limit). Unit `(ty, tx)` of the 16 × 16 grid holds the scores of
//! rows `ty + 16·i` and keys `tx + 16·j`: a score product (`Q·Kᵀ`, `dO·Vᵀ`) reads one 4-vector
//! per row and per key for 4 FMAs per pair. The weights (`P`, then `dS`) go to a shared tile
//! `W` whose 4-vector `s` of a row holds columns `s, s + 16, s + 32, s + 48` — the four a unit
//! holds, stored at once — and the gradient products (`Pᵀ·dO`, `dSᵀ·Q`, `dS·K`) read one `W`
//! 4-vector (a broadcast over the quarter-plane) and one operand 4-vector for 16 FMAs, into
//! accumulators of outputs `ty + 16·a` (a < 4) by columns `4·tx ..`.
//!
//! The grid is `(blocks, y, z)` with `y·z ≥ B·Hkv` (`B·Hkv` folded over two axes: any number
//! of heads runs).

use cubecl::prelude::*;

use crate::dropout::keep_weight;
use crate::flash::args::{BackwardLaunch, GradInputs, Scalars, ScoreArgs, ScoreInputs};
use crate::flash::block::{
    PairBlock, cube_count, pair_block, pair_group, rows_keys, span_positions,
};
use crate::flash::config::FlashConfig;
use crate::flash::keys::row_range;
use crate::flash::scores::{
    RowRefs, add_bias, capped, filled, live_score, new_refs, set_row, visible,
};

/// An f32 4-vector, the unit of the shared tiles.
type V4 = Vector<f32, Const<4>>;

/// Units per cube.
pub const UNITS: u32 = 256;
/// Units across the grid of a cube (and down it).
pub const GRID: u32 = 16;
/// Keys per cube of [`flash_backward_dkv()`].
pub const BLOCK_KEYS: u32 = 64;
/// Query rows per step of [`flash_backward_dkv()`].
pub const STEP_ROWS: u32 = 32;
/// Query rows per cube of [`flash_backward_dq()`].
pub const BLOCK_ROWS: u32 = 64;
/// Keys per step of [`flash_backward_dq()`].
pub const STEP_KEYS: u32 = 32;
/// Columns (head dims, value dims) per staged chunk.
pub const CHUNK: u32 = 64;
/// Columns of `dK` and of `dV` one cube of [`flash_backward_dkv()`] accumulates (its
/// registers); wider heads take the grid's x axis in tiles of this.
pub const COL_TILE: u32 = 128;
/// Chunks per column tile.
const TILE_CHUNKS: u32 = COL_TILE / CHUNK;
/// 4-vectors per row of a shared tile (a chunk).
const PITCH: u32 = CHUNK / 4;
/// Rows of the shared tiles of either kernel: operand `A` (query rows), operand `B` (keys) and
/// the weights `W` (32 rows each of the step's kind; 128 in all).
const SHARED_ROWS: u32 = 128;
/// Shared memory of either kernel, in bytes.
pub const SHARED_BYTES: usize = (SHARED_ROWS * PITCH * 16) as usize;

/// Where 4-vector `qv` of row `r` of a shared tile lies: rows of [`PITCH`] 4-vectors, the
/// 4-vector index XOR-swizzled by `r mod 8`, so that 8 consecutive rows at one `qv` (a score
/// product's `B` reads) and 8 consecutive `qv` of one row (stages, gradient products) each
/// hit every bank once.
#[cube]
fn slot(r: u32, qv: u32) -> usize {
    (r * PITCH + (qv ^ (r & 7))) as usize
}

/// Cubes along x of [`flash_backward_dkv()`] for `seq_k` keys: key blocks × column tiles
/// (`D` and `Dv` for computed scores, `Dv` for given ones).
pub fn dkv_blocks(seq_k: usize, head_dim: usize, value_dim: usize, given: bool) -> usize {
    let cols = if given {
        value_dim
    } else {
        head_dim.max(value_dim)
    };
    seq_k.div_ceil(BLOCK_KEYS as usize) * cols.div_ceil(COL_TILE as usize).max(1)
}

/// The query head of index `g` in the group of key/value head `hkv` (`G = Hq / Hkv` heads).
#[cube]
fn group_head(hkv: usize, g: usize, group: usize, heads_kv: usize) -> usize {
    let mut head = hkv * group + g;
    if comptime!(crate::mutation::gqa_modulo()) {
        head = hkv + heads_kv * g;
    }
    head
}

/// Offset of `t[b, h, p, 0]`.
#[cube]
fn row_at<F: CubePrimitive>(t: &Tensor<F>, b: usize, h: usize, p: usize) -> usize {
    b * t.stride(0) + h * t.stride(1) + p * t.stride(2)
}

/// Columns `c0 + 4·qv ..` of the tensor row at `base` as an f32 4-vector (0 where `ok` is
/// false or past `cols`).
#[cube]
fn load4<F: Float>(t: &Tensor<F>, ok: bool, base: usize, c0: usize, qv: u32, cols: usize) -> V4 {
    let mut vec = V4::empty();
    #[unroll]
    for e in 0..4u32 {
        let col = c0 + (4 * qv + e) as usize;
        let mut val = 0.0f32;
        if ok && col < cols {
            val = f32::cast_from(t[base + col * t.stride(3)]);
        }
        vec[e as usize] = val;
    }
    vec
}

/// Stages `n` rows × [`CHUNK`] columns (from `c0`) into the tile at `at`: row `r` is the
/// tensor row at `base + r·pitch` (positions of one head), zeros past `valid` rows and `cols`
/// columns.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<V4>,
    at: usize,
    base: usize,
    pitch: usize,
    valid: usize,
    c0: usize,
    cols: usize,
    #[comptime] n: u32,
) {
    #[unroll]
    for e in 0..comptime!(n * (CHUNK / 4) / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (r, qv) = (idx / (CHUNK / 4), idx % (CHUNK / 4));
        let ok = (r as usize) < valid;
        let row = select(ok, base + r as usize * pitch, 0);
        sh[at + slot(r, qv)] = load4::<F>(t, ok, row, c0, qv, cols);
    }
}

/// Stages `n` query rows `r0..` of the key/value head's group of `blk` (row `r` is head
/// `group_head(r / Sq)`, position `r % Sq`) × [`CHUNK`] columns into the tile at `at`, zeros
/// past the rows.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<V4>,
    at: usize,
    blk: &PairBlock,
    r0: usize,
    c0: usize,
    cols: usize,
    #[comptime] n: u32,
) {
    let (rows, seq_q) = (blk.rows, blk.seq_q);
    #[unroll]
    for e in 0..comptime!(n * (CHUNK / 4) / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (r, qv) = (idx / (CHUNK / 4), idx % (CHUNK / 4));
        let row = r0 + r as usize;
        let ok = row < rows;
        let rr = usize::min(row, rows - 1);
        let head = group_head(blk.hkv, rr / seq_q, blk.group, blk.heads_kv);
        let base = row_at(t, blk.batch, head, rr % seq_q);
        sh[at + slot(r, qv)] = load4::<F>(t, ok, base, c0, qv, cols);
    }
}

/// The given scores of the unit's `ri × rj` elements (rows `r0 + ty + 16·i`, keys
/// `j0 + tx + 16·j`) from `x` (`[B, H, Sq, Sk]`, rows over the group as in [`stage_rows()`]);
/// 0 past the edges.
#[cube]
#[allow(clippy::too_many_arguments)]
fn read_scores<F: Float>(
    x: &Tensor<F>,
    raw: &mut Array<f32>,
    blk: &PairBlock,
    r0: usize,
    j0: usize,
    ty: u32,
    tx: u32,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    let (rows, seq_q) = (blk.rows, blk.seq_q);
    #[unroll]
    for i in 0..ri {
        let row = r0 + (ty + GRID * i) as usize;
        #[unroll]
        for j in 0..rj {
            let key = j0 + (tx + GRID * j) as usize;
            if row < rows && key < blk.seq_k {
                let head = group_head(blk.hkv, row / seq_q, blk.group, blk.heads_kv);
                let at = row_at(x, blk.batch, head, row % seq_q) + key * x.stride(3);
                raw[(i * rj + j) as usize] = f32::cast_from(x[at]);
            }
        }
    }
}

/// `acc[i·rj + j] += Σ_c A[ty + 16·i][c] · B[tx + 16·j][c]` over one chunk: the unit's
/// scores of `A·Bᵀ` (`A`, `B` tiles at `a_at`, `b_at`, rows along the reduction).
#[cube]
fn product_abt(
    sh: &SharedMemory<V4>,
    a_at: usize,
    b_at: usize,
    acc: &mut Array<f32>,
    ty: u32,
    tx: u32,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    #[unroll]
    for qv in 0..comptime!(CHUNK / 4) {
        let mut a = Array::<V4>::new(comptime!(ri as usize));
        let mut b = Array::<V4>::new(comptime!(rj as usize));
        #[unroll]
        for i in 0..ri {
            a[i as usize] = sh[a_at + slot(ty + GRID * i, qv)];
        }
        #[unroll]
        for j in 0..rj {
            b[j as usize] = sh[b_at + slot(tx + GRID * j, qv)];
        }
        #[unroll]
        for i in 0..ri {
            #[unroll]
            for j in 0..rj {
                let at = (i * rj + j) as usize;
                let (x, y) = (a[i as usize], b[j as usize]);
                acc[at] += x[0usize] * y[0usize];
                acc[at] += x[1usize] * y[1usize];
                acc[at] += x[2usize] * y[2usize];
                acc[at] += x[3usize] * y[3usize];
            }
        }
    }
}

/// `acc[at + a] += W[r][ty][a] · B[r][tx]` over the tiles' first `n` rows: the unit's outputs
/// `ty + 16·a` (the columns of `W`'s 4-vector `ty`) by columns `4·tx ..` of `Wᵀ·B`.
#[cube]
fn product_wb(
    sh: &SharedMemory<V4>,
    w_at: usize,
    b_at: usize,
    acc: &mut Array<V4>,
    ty: u32,
    tx: u32,
    #[comptime] at: u32,
    #[comptime] n: u32,
) {
    #[unroll]
    for r in 0..n {
        let w = sh[w_at + slot(r, ty)];
        let b = sh[b_at + slot(r, tx)];
        #[unroll]
        for a in 0..4u32 {
            acc[(at + a) as usize] += V4::new(w[a as usize]) * b;
        }
    }
}

/// The unit's `ri × rj` (at most 8) score terms: the raw products `raw` (`Q·Kᵀ` before the
/// scale, or the given scores), `dP` (`dp`), and what [`rebuild()`] makes of `raw`.
#[derive(CubeType)]
struct Weights {
    raw: Array<f32>,
    dp: Array<f32>,
    p: Array<f32>,
    dfac: Array<f32>,
    gate: Array<f32>,
    z: Array<f32>,
}

#[cube]
fn new_weights() -> Weights {
    Weights {
        raw: Array::new(8usize),
        dp: Array::new(8usize),
        p: Array::new(8usize),
        dfac: Array::new(8usize),
        gate: Array::new(8usize),
        z: Array::new(8usize),
    }
}

/// The unit's raw scores of rows `r0 + ty + 16·i` and keys `j0 + tx + 16·j` into `w.raw`,
/// with `w.dp` zeroed: the given scores read from `X`, or `Q·Kᵀ` over the chunks of `D`,
/// staging `n_rows` query rows at `a_at` and `n_keys` keys (`keys` valid, from `k_base`) at
/// `b_at`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn raw_scores<F: Float>(
    inputs: &ScoreInputs<F, F>,
    sh: &mut SharedMemory<V4>,
    w: &mut Weights,
    blk: &PairBlock,
    r0: usize,
    j0: usize,
    k_base: usize,
    keys: usize,
    a_at: usize,
    b_at: usize,
    ty: u32,
    tx: u32,
    #[comptime] c: FlashConfig,
    #[comptime] n_rows: u32,
    #[comptime] n_keys: u32,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    let (q, k) = (&inputs.q, &inputs.k);
    #[unroll]
    for n in 0..8usize {
        w.raw[n] = 0.0f32;
        w.dp[n] = 0.0f32;
    }
    if comptime!(c.given()) {
        read_scores::<F>(q, &mut w.raw, blk, r0, j0, ty, tx, ri, rj);
    }
    for dc in 0..comptime!(c.head_dim / CHUNK) {
        let c0 = (dc * CHUNK) as usize;
        stage_rows::<F>(q, sh, a_at, blk, r0, c0, blk.head_dim, n_rows);
        stage::<F>(
            k,
            sh,
            b_at,
            k_base,
            k.stride(2),
            keys,
            c0,
            blk.head_dim,
            n_keys,
        );
        sync_cube();
        product_abt(sh, a_at, b_at, &mut w.raw, ty, tx, ri, rj);
        sync_cube();
    }
}

/// The weights of the unit's `ri × rj` scores of rows `rw`, rebuilt from their raw products
/// `w.raw`: `P` (`w.p`, before dropout), the softcap's derivative (`w.dfac`), whether `dS`
/// flows (`w.gate`: 0 where a masked key took the fill score,
/// [`crate::flash::scores::live_score()`]) and the dropout factor `w.z` (`keep / (1 − p)`, 1
/// without dropout), the forward's own mask drawn again. Keys are `j0 + tx + 16·j`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn rebuild<F: Float>(
    inputs: &ScoreInputs<F, F>,
    rw: &Rows,
    w: &mut Weights,
    blk: &PairBlock,
    j0: usize,
    tx: u32,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    let (mask, bias, refs) = (&inputs.mask, &inputs.bias, &rw.refs);
    let (seq_q, seq_k) = (blk.seq_q, blk.seq_k);
    let (softcap, drop) = (args.softcap, &args.dropout);
    #[unroll]
    for i in 0..ri {
        let slot = i as usize;
        #[unroll]
        for j in 0..rj {
            let at = (i * rj + j) as usize;
            let key = j0 + (tx + GRID * j) as usize;
            let sc = capped(w.raw[at], args.scale, softcap, c);
            let mut fac = 1.0f32;
            if comptime!(c.rules.softcap) {
                let t = sc / softcap;
                fac = 1.0f32 - t * t;
            }
            let s = add_bias::<F>(bias, refs, slot, sc, key, seq_k, c);
            let s = filled::<F>(mask, refs, slot, s, key, seq_k, c);
            let ok = rw.ok[slot] && visible::<F>(mask, refs, slot, key, seq_q, seq_k, c, true);
            // A row without a visible key has lse = −inf (and every P = 0).
            let live = ok && rw.lse[slot] > f32::min_value();
            w.p[at] = select(live, f32::exp(s - rw.lse[slot]), 0.0f32);
            w.dfac[at] = fac;
            if comptime!(c.fills()) {
                w.gate[at] = select(
                    live_score::<F>(mask, refs, slot, key, seq_k, c),
                    1.0f32,
                    0.0f32,
                );
            }
            w.z[at] = 1.0f32;
            if comptime!(c.rules.dropout) {
                w.z[at] = keep_weight(
                    drop.seed_lo,
                    drop.seed_hi,
                    drop.threshold,
                    drop.inv_keep,
                    rw.pair[slot],
                    refs.pos[slot],
                    key,
                    true,
                );
            }
        }
    }
}

/// The per-row state of the unit's `ri` query rows `r0 + ty + 16·i`: mask/bias references,
/// whether the row exists, its `lse`, `δ` and (batch, head) pair index, and (`ds_rows`) the
/// offset of its `dS` row.
#[derive(CubeType)]
struct Rows {
    refs: RowRefs,
    ok: Array<bool>,
    lse: Array<f32>,
    delta: Array<f32>,
    pair: Array<usize>,
    ds: Array<usize>,
}

/// Fills [`Rows`] for rows `r0 + ty + 16·i` (i < `ri`) of the group of `blk`'s key/value head.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_rows<F: Float>(
    inputs: &ScoreInputs<F, F>,
    grads: &GradInputs<F>,
    ds: &Tensor<F>,
    blk: &PairBlock,
    r0: usize,
    ty: u32,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] ri: u32,
    #[comptime] ds_rows: bool,
) -> Rows {
    let (lse, delta) = (&grads.lse, &grads.delta);
    let (batch, hkv, group, heads_kv) = (blk.batch, blk.hkv, blk.group, blk.heads_kv);
    let (rows, seq_q) = (blk.rows, blk.seq_q);
    let heads_q = inputs.q.shape(1);
    let n = comptime!(ri as usize);
    let mut out = Rows {
        refs: new_refs(n),
        ok: Array::new(n),
        lse: Array::new(n),
        delta: Array::new(n),
        pair: Array::new(n),
        ds: Array::new(n),
    };
    let q_group = pair_group(blk);
    #[unroll]
    for i in 0..ri {
        let slot = i as usize;
        let row = r0 + (ty + GRID * i) as usize;
        set_row(
            &mut out.refs,
            slot,
            inputs,
            &q_group,
            row,
            blk.seq_k,
            args,
            c,
        );
        let rr = usize::min(row, rows - 1);
        let head = group_head(hkv, rr / seq_q, group, heads_kv);
        let pos = rr % seq_q;
        out.ok[slot] = row < rows;
        out.lse[slot] = lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
        out.delta[slot] = delta[(batch * heads_q + head) * seq_q + pos];
        out.pair[slot] = batch * heads_q + head;
        out.ds[slot] = 0usize;
        if comptime!(ds_rows) {
            out.ds[slot] = row_at(ds, batch, head, pos);
        }
    }
    out
}

/// 256 threads, f32: one cube per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DKV_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

/// `dK` and `dV` of one block of [`BLOCK_KEYS`] keys and one tile of [`COL_TILE`] columns
/// (module docs); given scores (`softmax(X)·V`): `dV` alone. `c.head_dim` is `D` rounded up
/// to [`CHUNK`] (0 for given scores). Grid: `(key blocks × column tiles, y, z)` (x as
/// [`dkv_blocks`] counts it), `y·z ≥ B·Hkv`; [`UNITS`] units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it (joined, the runtime test would be
// expanded for given scores too).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dkv<F: Float>(
    inputs: &ScoreInputs<F, F>,
    grads: &GradInputs<F>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, d_out) = (&inputs.q, &inputs.k, &inputs.v, &grads.d_out);
    let (a_at, b_at, w_at) = (
        0usize,
        comptime!((STEP_ROWS * PITCH) as usize),
        comptime!(((STEP_ROWS + BLOCK_KEYS) * PITCH) as usize),
    );
    let given = comptime!(c.given());
    let blk = pair_block(q, k, v, c);
    let (seq_q, seq_k, head_dim, value_dim) = (blk.seq_q, blk.seq_k, blk.head_dim, blk.value_dim);
    let (rows, batch, hkv) = (blk.rows, blk.batch, blk.hkv);
    // `D` and `Dv` (given scores: `Dv`) in column tiles.
    let mut cols = usize::max(head_dim, value_dim);
    if comptime!(given) {
        cols = value_dim;
    }
    let tiles = usize::max(cols.div_ceil(COL_TILE as usize), 1);
    let tile = CUBE_POS_X as usize % tiles;
    let j0 = (CUBE_POS_X as usize / tiles) * BLOCK_KEYS as usize;
    let keys = usize::min(seq_k - j0, BLOCK_KEYS as usize);
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;
    let k_base = row_at(k, batch, hkv, j0);
    let v_base = row_at(v, batch, hkv, j0);
    let chunk0 = tile * TILE_CHUNKS as usize;
    let v_chunks = value_dim.div_ceil(CHUNK as usize);
    let d_total = head_dim.div_ceil(CHUNK as usize);
    // dP needs every chunk of `dO` and `V`; given scores only the tile's (for `dV`).
    let mut vc_lo = 0usize;
    let mut vc_hi = v_chunks;
    if comptime!(given) {
        vc_lo = chunk0;
        vc_hi = usize::min(chunk0 + TILE_CHUNKS as usize, v_chunks);
    }

    let mut sh = SharedMemory::<V4>::new(comptime!((SHARED_ROWS * PITCH) as usize));
    let acc_n = comptime!((TILE_CHUNKS * 4) as usize);
    let mut acc_dk = Array::<V4>::new(acc_n);
    let mut acc_dv = Array::<V4>::new(acc_n);
    #[unroll]
    for n in 0..acc_n {
        acc_dk[n] = V4::new(0.0f32);
        acc_dv[n] = V4::new(0.0f32);
    }
    let mut w = new_weights();

    let blocks = rows.div_ceil(STEP_ROWS as usize);
    // The positions that see one of the block's keys (causal, window, packed sequences).
    let seen_by = row_range(&inputs.seqs, j0, j0 + keys - 1, seq_q, seq_k, &args, c);
    for qb in 0..blocks {
        let r0 = qb * STEP_ROWS as usize;
        let last = usize::min(r0 + STEP_ROWS as usize, rows) - 1;
        let mut live = true;
        if comptime!(c.ranged()) {
            let span = span_positions(r0, last, seq_q);
            live = span.start < seen_by.end && span.end >= seen_by.start;
        }
        if live {
            let rw = load_rows::<F>(inputs, grads, dk, &blk, r0, ty, &args, c, 2u32, false);
            raw_scores::<F>(
                inputs, &mut sh, &mut w, &blk, r0, j0, k_base, keys, a_at, b_at, ty, tx, c,
                STEP_ROWS, BLOCK_KEYS, 2u32, 4u32,
            );
            rebuild::<F>(inputs, &rw, &mut w, &blk, j0, tx, &args, c, 2u32, 4u32);
            // dV takes the weights the forward's `P·V` took: kept and scaled.
            #[unroll]
            for i in 0..2u32 {
                let mut vec = V4::empty();
                #[unroll]
                for j in 0..4u32 {
                    let at = (i * 4 + j) as usize;
                    vec[j as usize] = w.p[at] * w.z[at];
                }
                sh[w_at + slot(ty + GRID * i, tx)] = vec;
            }
            // dP = dO·Vᵀ and dV += Pᵀ·dO, one chunk of dO for both.
            for vc in vc_lo..vc_hi {
                let c0 = vc * CHUNK as usize;
                stage_rows::<F>(d_out, &mut sh, a_at, &blk, r0, c0, value_dim, STEP_ROWS);
                stage::<F>(
                    v,
                    &mut sh,
                    b_at,
                    v_base,
                    v.stride(2),
                    keys,
                    c0,
                    value_dim,
                    BLOCK_KEYS,
                );
                sync_cube();
                if comptime!(!given) {
                    product_abt(&sh, a_at, b_at, &mut w.dp, ty, tx, 2u32, 4u32);
                }
                #[unroll]
                for t in 0..TILE_CHUNKS {
                    if vc == chunk0 + t as usize {
                        product_wb(&sh, w_at, a_at, &mut acc_dv, ty, tx, t * 4, STEP_ROWS);
                    }
                }
                sync_cube();
            }
            // dR = P ⊙ (dP ⊙ Z − δ) ⊙ softcap', then dK += dRᵀ·Q (given scores: no dK)
            if comptime!(!given) {
                #[unroll]
                for i in 0..2u32 {
                    let mut vec = V4::empty();
                    #[unroll]
                    for j in 0..4u32 {
                        let at = (i * 4 + j) as usize;
                        let mut g =
                            w.p[at] * (w.dp[at] * w.z[at] - rw.delta[i as usize]) * w.dfac[at];
                        if comptime!(c.fills() && !crate::mutation::fill_grad()) {
                            g *= w.gate[at];
                        }
                        vec[j as usize] = g;
                    }
                    sh[w_at + slot(ty + GRID * i, tx)] = vec;
                }
                #[unroll]
                for t in 0..TILE_CHUNKS {
                    let dc = chunk0 + t as usize;
                    if dc < d_total {
                        let c0 = dc * CHUNK as usize;
                        stage_rows::<F>(q, &mut sh, a_at, &blk, r0, c0, head_dim, STEP_ROWS);
                        sync_cube();
                        product_wb(&sh, w_at, a_at, &mut acc_dk, ty, tx, t * 4, STEP_ROWS);
                        sync_cube();
                    }
                }
            }
        }
    }

    // Unit (ty, tx) owns keys j0 + ty + 16·a, columns 4·tx .. of each chunk of its tile.
    #[unroll]
    for a in 0..4u32 {
        let key = j0 + (ty + GRID * a) as usize;
        if key < seq_k {
            let dk_base = row_at(dk, batch, hkv, key);
            let dv_base = row_at(dv, batch, hkv, key);
            #[unroll]
            for t in 0..TILE_CHUNKS {
                let vec_k = acc_dk[(t * 4 + a) as usize];
                let vec_v = acc_dv[(t * 4 + a) as usize];
                #[unroll]
                for e in 0..4u32 {
                    let col = (chunk0 + t as usize) * CHUNK as usize + (4 * tx + e) as usize;
                    if comptime!(!given) {
                        if col < head_dim {
                            let val = args.scale * vec_k[e as usize];
                            dk[dk_base + col * dk.stride(3)] = F::cast_from(val);
                        }
                    }
                    if col < value_dim {
                        dv[dv_base + col * dv.stride(3)] = F::cast_from(vec_v[e as usize]);
                    }
                }
            }
        }
    }
}

/// 256 threads, f32: one cube per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DQ_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

/// `dQ` of one block of [`BLOCK_ROWS`] query rows (module docs), and with `write_ds` the
/// score gradient `dS` of every (row, key) into `ds` (`[B, Hq, Sq, Sk]`: what a bias's
/// gradient is made of; with given scores, `dX`, and no `dQ`). Grid: `(row blocks of G·Sq,
/// y, z)`, `y·z ≥ B·Hkv`; [`UNITS`] units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it: joined, the branch would be
// expanded when `write_ds` is off too.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dq<F: Float>(
    inputs: &ScoreInputs<F, F>,
    grads: &GradInputs<F>,
    dq: &mut Tensor<F>,
    ds: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] write_ds: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, d_out) = (&inputs.q, &inputs.k, &inputs.v, &grads.d_out);
    let d_chunks = comptime!(c.head_dim / CHUNK);
    let (a_at, b_at, w_at) = (
        0usize,
        comptime!((BLOCK_ROWS * PITCH) as usize),
        comptime!(((BLOCK_ROWS + STEP_KEYS) * PITCH) as usize),
    );
    let given = comptime!(c.given());
    let blk = pair_block(q, k, v, c);
    let (seq_q, seq_k, head_dim, value_dim) = (blk.seq_q, blk.seq_k, blk.head_dim, blk.value_dim);
    let (heads_kv, group, rows) = (blk.heads_kv, blk.group, blk.rows);
    let (batch, hkv) = (blk.batch, blk.hkv);
    let r0 = (CUBE_POS_X * BLOCK_ROWS) as usize;
    let key_span = rows_keys(
        &blk,
        &inputs.seqs,
        r0,
        BLOCK_ROWS as usize,
        &args,
        STEP_KEYS as usize,
        c,
    );
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;

    let mut sh = SharedMemory::<V4>::new(comptime!((SHARED_ROWS * PITCH) as usize));
    let acc_n = comptime!((d_chunks * 4).max(1) as usize);
    let mut acc = Array::<V4>::new(acc_n);
    #[unroll]
    for n in 0..acc_n {
        acc[n] = V4::new(0.0f32);
    }
    let rw = load_rows::<F>(inputs, grads, ds, &blk, r0, ty, &args, c, 4u32, write_ds);
    let mut w = new_weights();
    let v_chunks = value_dim.div_ceil(CHUNK as usize);

    let key0 = usize::min(key_span.start, key_span.end);
    let steps = (key_span.end - key0).div_ceil(STEP_KEYS as usize);
    for st in 0..steps {
        let j0 = key0 + st * STEP_KEYS as usize;
        let keys = usize::min(seq_k - j0, STEP_KEYS as usize);
        let k_base = row_at(k, batch, hkv, j0);
        let v_base = row_at(v, batch, hkv, j0);
        raw_scores::<F>(
            inputs, &mut sh, &mut w, &blk, r0, j0, k_base, keys, a_at, b_at, ty, tx, c, BLOCK_ROWS,
            STEP_KEYS, 4u32, 2u32,
        );
        for vc in 0..v_chunks {
            let c0 = vc * CHUNK as usize;
            stage_rows::<F>(d_out, &mut sh, a_at, &blk, r0, c0, value_dim, BLOCK_ROWS);
            stage::<F>(
                v,
                &mut sh,
                b_at,
                v_base,
                v.stride(2),
                keys,
                c0,
                value_dim,
                STEP_KEYS,
            );
            sync_cube();
            product_abt(&sh, a_at, b_at, &mut w.dp, ty, tx, 4u32, 2u32);
            sync_cube();
        }
        rebuild::<F>(inputs, &rw, &mut w, &blk, j0, tx, &args, c, 4u32, 2u32);
        // dS, and dR = dS ⊙ softcap' into `W` transposed: key `tx + 16·j`, rows `ty + 16·i`.
        #[unroll]
        for j in 0..2u32 {
            let key = j0 + (tx + GRID * j) as usize;
            let mut vec = V4::empty();
            #[unroll]
            for i in 0..4u32 {
                let at = (i * 2 + j) as usize;
                let mut g = w.p[at] * (w.dp[at] * w.z[at] - rw.delta[i as usize]);
                if comptime!(c.fills() && !crate::mutation::fill_grad()) {
                    g *= w.gate[at];
                }
                if comptime!(write_ds) {
                    if rw.ok[i as usize] && key < seq_k {
                        let mut val = g;
                        if comptime!(given && crate::mutation::zero_dx()) {
                            val = 0.0f32;
                        }
                        let at = rw.ds[i as usize] + key * ds.stride(3);
                        ds[at] = F::cast_from(val);
                    }
                }
                vec[i as usize] = g * w.dfac[at];
            }
            if comptime!(!given) {
                sh[w_at + slot(tx + GRID * j, ty)] = vec;
            }
        }
        // dQ += dR·K (given scores: `dS` is the result)
        #[unroll]
        for dc in 0..comptime!(if given { 0 } else { d_chunks }) {
            let c0 = (dc * CHUNK) as usize;
            stage::<F>(
                k,
                &mut sh,
                b_at,
                k_base,
                k.stride(2),
                keys,
                c0,
                head_dim,
                STEP_KEYS,
            );
            sync_cube();
            product_wb(&sh, w_at, b_at, &mut acc, ty, tx, dc * 4, STEP_KEYS);
            sync_cube();
        }
    }
    // Keys outside every row's range (before the window, past the causal diagonal or the
    // window): dS = 0 there.
    if comptime!(write_ds) {
        let done = key0 + steps * STEP_KEYS as usize;
        #[unroll]
        for i in 0..4usize {
            if rw.ok[i] {
                let mut key = tx as usize;
                while key < seq_k {
                    if key < key0 || key >= done {
                        let at = rw.ds[i] + key * ds.stride(3);
                        ds[at] = F::cast_from(0.0f32);
                    }
                    key += GRID as usize;
                }
            }
        }
    }

    // Unit (ty, tx) owns rows r0 + ty + 16·a, columns 4·tx .. of every chunk.
    #[unroll]
    for a in 0..comptime!(if given { 0u32 } else { 4u32 }) {
        let row = r0 + (ty + GRID * a) as usize;
        if row < rows {
            let head = group_head(hkv, row / seq_q, group, heads_kv);
            let base = row_at(dq, batch, head, row % seq_q);
            #[unroll]
            for dc in 0..d_chunks {
                let vec = acc[(dc * 4 + a) as usize];
                #[unroll]
                for e in 0..4u32 {
                    let col = (dc * CHUNK + 4 * tx + e) as usize;
                    if col < head_dim {
                        let mut val = args.scale * vec[e as usize];
                        if comptime!(crate::mutation::zero_dq()) {
                            val = 0.0f32;
                        }
                        dq[base + col * dq.stride(3)] = F::cast_from(val);
                    }
                }
            }
        }
    }
}

/// Runs [`flash_backward_dkv()`] and [`flash_backward_dq()`] on the launch's grids.
///
/// # Safety
/// The operands' shapes and strides describe their buffers, the grids are the kernels' (key
/// blocks × column tiles, row blocks; pairs folded by [`crate::flash::block::fold_pairs`]),
/// and `c` is a configuration the kernels take (chunks of [`CHUNK`]).
pub unsafe fn launch<R: Runtime>(
    l: &BackwardLaunch<'_, R>,
    scalars: Scalars,
    c: FlashConfig,
    write_ds: bool,
) {
    let (client, t, delta, dtype) = (l.client, l.t, l.delta, l.dtype);
    let units = cubecl::CubeDim::new_1d(UNITS);
    // SAFETY: the caller's (above).
    unsafe {
        if let Some(cubes) = l.dkv_cubes {
            flash_backward_dkv::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                units,
                t.score_inputs(&t.q),
                t.grad_inputs(delta),
                t.dk.arg(),
                t.dv.arg(),
                scalars.arg(),
                c,
                dtype,
            );
        }
        if let Some(cubes) = l.dq_cubes {
            flash_backward_dq::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                units,
                t.score_inputs(&t.q),
                t.grad_inputs(delta),
                t.dq.arg(),
                t.ds.arg(),
                scalars.arg(),
                c,
                write_ds,
                dtype,
            );
        }
    }
}
