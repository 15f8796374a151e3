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
    RowRefs, add_bias, cap_slope, capped, filled, live_score, new_refs, set_row, visible,
};

/// An f32 4-vector, the unit of the shared tiles.
type V4 = Vector<f32, Const<4>>;

/// Units per cube.
pub const UNITS: u32 = 256;
/// Units across the grid of a cube (and down it).
pub const GRID: u32 = 16;

mod parts;

pub use parts::dkv_blocks;
use parts::*;

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
