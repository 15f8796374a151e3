//! `softmax(X)·V` on the matrix units with each `P` block computed **once** per row block: one
//! cube owns [`BLOCK_ROWS`] rows of `X` and every output column (all of `d3`, up to
//! [`MAX_COLUMNS`]), and its planes share `P` through shared memory (f16/bf16, `mma` m16n8k16
//! with f32 accumulators, `ldmatrix`, `cp.async`; CUDA sm_80+).
//!
//! The flash loop of [`crate::flash::mma`] keeps `P` in registers, so a cube owns one column tile
//! of the output and every tile recomputes the row's `e^(x − m)` (4 times at `d3 = 512`: as many
//! exponentials as `mma`s, and the cubes of a row block read `X` 4 times). Here each step of
//! `block_k` columns of `X` ([`STEPS`]) has two roles:
//! - **producers** (the first `BLOCK_ROWS / rows-per-plane` planes): a lane reads 8 consecutive
//!   scores of one row (one 16-byte vector, straight from global memory one step ahead), the
//!   lanes of a row take its maximum with shuffles, and the lane writes `P = e^(x − m)` (16-bit)
//!   to shared memory and, once per row, the rescale factor `α` of the step. The row's reference
//!   `m` is lazy ([`next_reference()`]) and its sum `l` is kept in f32 by the lanes of the row.
//! - **consumers** (every plane): a plane owns `16·row_tiles` rows × [`SLAB`] output columns, in
//!   f32 accumulators; per step it rescales them by `α` (only when a row's reference moved) and
//!   adds `P·V`, with `P` by `ldmatrix` and `V` by `ldmatrix.trans` from shared memory.
//!
//! The roles run one step apart: after the step's barrier, producers write `P` of step `j + 1`
//! into one buffer while consumers read step `j`'s from the other, and `V` of step `j + 1` is
//! copied (`cp.async`) into one of two buffers while step `j` is read from the other. One
//! `sync_cube` per step.

use cubecl::{
    cmma::MmaDefinition,
    ir::{FastMath, MatrixIdent},
    prelude::barrier::Barrier,
    prelude::*,
};

use crate::flash::mma::{NV8, accumulate_pv, stage_rows, store_row_vectors};
use crate::flash::{
    FlashConfig, cube_block, inverse_sum, next_reference, output_sum, probability, rescale_factor,
    row_lse,
};
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, zero_accumulators};

/// Rows of `X` per cube.
pub const BLOCK_ROWS: u32 = 64;
/// Columns of `X` (keys) per step: [`STEPS`] are possible, the longer one where shared memory
/// holds its two `V` buffers.
pub const STEPS: [u32; 2] = [64, 32];
/// Output columns per consumer plane.
pub const SLAB: u32 = 64;
/// The widest output one cube owns (its `V` buffers grow with it).
pub const MAX_COLUMNS: u32 = 512;
/// The narrowest output the kernel takes: narrower ones are one column tile of
/// [`crate::flash::mma`], which computes `P` once already.
pub const MIN_COLUMNS: u32 = 129;
/// Lanes that share a row in the producer role; each takes `block_k / 32` vectors of 8 scores
/// of the step.
const ROW_LANES: u32 = 4;
/// Rows of one producer plane.
const PRODUCER_ROWS: u32 = PLANE / ROW_LANES;
/// Planes in the producer role.
pub const PRODUCERS: u32 = BLOCK_ROWS / PRODUCER_ROWS;

/// Why the kernel cannot take `d3` output columns, if it cannot.
pub fn refuses(d3: usize) -> Option<String> {
    (!(MIN_COLUMNS as usize..=MAX_COLUMNS as usize).contains(&d3)).then(|| {
        format!(
            "it takes d3 in {MIN_COLUMNS}..={MAX_COLUMNS} (d3 = {d3}; up to 128 columns the \
             matrix-unit loop computes each weight once already)"
        )
    })
}

/// The kernel's configuration for `d3` output columns (not [`refuses()`]d) and `block_k`
/// columns of `X` per step (one of [`STEPS`]). The output width rounds up to [`SLAB`]; a
/// consumer plane takes two tiles of 16 rows where that still gives at least [`PRODUCERS`]
/// planes, else one.
pub fn config(base: FlashConfig, d3: usize, block_k: u32) -> FlashConfig {
    let width = d3.next_multiple_of(SLAB as usize);
    let slabs = (width / SLAB as usize) as u32;
    // 4 row tiles (64 × 64 slabs, 8 planes at d3 = 512) measured no faster than 2 (16 planes of
    // 32 × 64) and take 226 registers against 128 (NOTES.md, session 16).
    let row_tiles = [2, 1]
        .into_iter()
        .find(|&rt| BLOCK_ROWS / (MMA_M * rt) * slabs >= PRODUCERS)
        .unwrap_or(1);
    FlashConfig {
        block_q: BLOCK_ROWS,
        row_tiles,
        block_k,
        head_dim: 0,
        value_dim: width as u32,
        ..base
    }
}

/// Planes per cube of `c`: `BLOCK_ROWS / (16·row_tiles)` row groups × `value_dim / SLAB`
/// column slabs.
pub fn planes(c: FlashConfig) -> u32 {
    (c.block_q / (MMA_M * c.row_tiles)) * (c.value_dim / SLAB)
}

/// Shared memory of [`softmax_matmul_wide()`] with `stages` buffers, in bytes: per stage a
/// step of `V` and one of `X`; two `P` buffers (rows padded by [`V_PAD`] elements), two steps
/// of `α` and the rows' output scales.
pub fn shared_bytes(c: FlashConfig, stages: u32) -> usize {
    let pad = V_PAD as usize;
    let (bq, bk, dv) = (c.block_q as usize, c.block_k as usize, c.value_dim as usize);
    let stage = bk * (dv + pad) + bq * (bk + pad);
    (stages as usize * stage + 2 * bq * (bk + pad)) * 2 + (3 * bq) * 4
}

/// The most copy stages (4 down to 2) whose shared memory fits in `max_shared` bytes, if any.
pub fn stages(c: FlashConfig, max_shared: usize) -> Option<u32> {
    (2..=4u32)
        .rev()
        .find(|&stages| shared_bytes(c, stages) <= max_shared)
}

/// The producer role for one step starting at column `j0`: this lane's scores `xr` of its row
/// (vector `u` holds columns `j0 + 8·(4u + part)..`), the row's maximum over its [`ROW_LANES`]
/// lanes, the lazy reference `m`, the lane's share of `l`, `P` (16-bit) into `p_s` at row
/// offset `p_at` (vector `4u + part`) and, from the row's first lane, `α` into `alpha_s` at
/// `alpha_at`. `bounds`: the step crosses the end of the row (columns from `seq_k` on are
/// invisible).
#[cube]
#[allow(clippy::too_many_arguments)]
fn produce<F: Float, NV: Size>(
    xr: &Array<Vector<F, NV>>,
    j0: usize,
    part: usize,
    seq_k: usize,
    m: &mut f32,
    l: &mut f32,
    p_s: &mut SharedMemory<Vector<F, NV>>,
    alpha_s: &mut SharedMemory<f32>,
    p_at: usize,
    alpha_at: usize,
    #[comptime] c: FlashConfig,
    #[comptime] bounds: bool,
) {
    let vectors = comptime!((c.block_k / (ROW_LANES * NV8 as u32)) as usize);
    let mut s = Array::<f32>::new(comptime!(NV8 * vectors));
    let mut step_max = f32::min_value();
    #[unroll]
    for u in 0..vectors {
        let col = j0 + (comptime!(u * ROW_LANES as usize) + part) * NV8;
        let xv = xr[u];
        #[unroll]
        for i in 0..comptime!(NV8) {
            let mut val = f32::cast_from(xv[i]);
            if comptime!(bounds) {
                val = select(col + i < seq_k, val, f32::min_value());
            }
            s[comptime!(u * NV8 + i)] = val;
            step_max = f32::max(step_max, val);
        }
    }
    #[unroll]
    for k in 0..comptime!(ROW_LANES.trailing_zeros()) {
        step_max = f32::max(step_max, plane_shuffle_xor(step_max, comptime!(1u32 << k)));
    }
    let m_new = next_reference(*m, step_max, true);
    let alpha = rescale_factor(*m, m_new);
    *m = m_new;
    let mut sum = 0.0f32;
    #[unroll]
    for u in 0..vectors {
        let mut pv = Vector::<F, NV>::empty();
        #[unroll]
        for i in 0..comptime!(NV8) {
            let x = s[comptime!(u * NV8 + i)];
            // A given −inf needs no test (e^(−inf − m) = 0); columns past the end do.
            let mut p = f32::exp(x - m_new);
            if comptime!(bounds) {
                p = probability(x, m_new, x > f32::min_value());
            }
            sum += p;
            pv[i] = F::cast_from(p);
        }
        p_s[p_at + comptime!(u * ROW_LANES as usize) + part] = pv;
    }
    *l = *l * alpha + sum;
    if part == 0 {
        alpha_s[alpha_at] = alpha;
    }
}

/// Commits the copies this unit issued for copy group `j` and arrives on its barrier
/// (`j % stages`).
#[cube]
fn commit_group(bars: &Sequence<Shared<Barrier>>, j: usize, #[comptime] stages: u32) {
    let slot = j % stages as usize;
    #[unroll]
    for b in 0..stages {
        if slot == b as usize {
            let bar = bars.index(b as usize);
            bar.commit_copy_async();
            let _token = bar.arrive();
        }
    }
}

/// Waits for copy group `j` (barrier `j % stages`, in its `j / stages`-th phase).
#[cube]
fn wait_group(bars: &Sequence<Shared<Barrier>>, j: usize, #[comptime] stages: u32) {
    let slot = j % stages as usize;
    let phase = ((j / stages as usize) % 2) as u32;
    #[unroll]
    for b in 0..stages {
        if slot == b as usize {
            bars.index(b as usize).wait_parity(phase);
        }
    }
}

/// Issues the copies of group `j` into stage `j % stages`: `V`'s rows of step `j` and `X`'s
/// block of step `j + 1` (rows of the cube, zeros past the end).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_group<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    x_s: &mut SharedMemory<Vector<F, NV>>,
    v_s: &mut SharedMemory<Vector<F, NV>>,
    j: usize,
    steps: usize,
    bases: (usize, usize),
    strides: (usize, usize),
    sizes: (usize, usize, usize),
    #[comptime] c: FlashConfig,
    #[comptime] stages: u32,
) {
    let (x_base, v_base) = bases;
    let (x_stride, v_stride) = strides;
    let (rows_left, seq_k, value_dim) = sizes;
    let units = comptime!(planes(c) * PLANE);
    let bk = comptime!(c.block_k as usize);
    let stage = j % stages as usize;
    let v_len = comptime!(c.block_k as usize * (c.value_dim + V_PAD) as usize / NV8);
    let x_len = comptime!(c.block_q as usize * (c.block_k + V_PAD) as usize / NV8);
    if j < steps {
        stage_rows::<F, NV>(
            v,
            v_s,
            stage * v_len,
            j * bk,
            v_base,
            v_stride,
            seq_k,
            value_dim,
            c.block_k,
            c.value_dim,
            units,
            false,
        );
    }
    if j + 1 < steps {
        let col0 = (j + 1) * bk;
        stage_rows::<F, NV>(
            x,
            x_s,
            stage * x_len,
            0,
            x_base + col0,
            x_stride,
            rows_left,
            seq_k - col0,
            c.block_q,
            c.block_k,
            units,
            false,
        );
    }
}

/// The consumer role for one step: rescales this plane's accumulators by the step's `α` (only
/// when a row's reference moved) and adds `P·V` of the step, `P` from `p_s` at `p_buf`, `V`
/// from `v_s` at `v_buf`, `α` from `alpha_s` at `alpha_buf`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn consume<F: Float, NV: Size>(
    p_s: &SharedMemory<Vector<F, NV>>,
    v_s: &SharedMemory<Vector<F, NV>>,
    alpha_s: &SharedMemory<f32>,
    bufs: (usize, usize, usize),
    lanes: (usize, usize, usize),
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] c: FlashConfig,
) {
    let (p_buf, v_buf, alpha_buf) = bufs;
    let (p_lane, v_lane, row_lane) = lanes;
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let rts = comptime!(c.row_tiles);
    let tiles = comptime!(SLAB / MMA_N);
    let p_ldv = comptime!((c.block_k + V_PAD) as usize / NV8);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);

    // -- the rescale: slot 2·rt + h is row `row_lane + 16·rt + 8·h` --
    let mut alpha = Array::<f32>::new(comptime!(2 * rts as usize));
    let mut moved = false;
    #[unroll]
    for slot in 0..comptime!(2 * rts as usize) {
        let a = alpha_s[alpha_buf + row_lane + comptime!(16 * (slot / 2) + 8 * (slot % 2))];
        alpha[slot] = a;
        moved = moved || a != 1.0f32;
    }
    if plane_any(moved) {
        #[unroll]
        for rt in 0..rts {
            #[unroll]
            for nt in 0..tiles {
                let frag = acc.index_mut(comptime!(rt * tiles + nt) as usize);
                #[unroll]
                for h in 0..2u32 {
                    frag[h as usize] = frag[h as usize] * Vector::new(alpha[(2 * rt + h) as usize]);
                }
            }
        }
    }

    // -- O += P·V, per 16 keys: one `ldmatrix.x4` of P per row tile, each V fragment pair
    // (`ldmatrix.x4.trans`) shared by the row tiles --
    #[unroll]
    for kc in 0..comptime!(c.block_k / 16) {
        let mut pa = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for rt in 0..rts {
            let at = p_buf + p_lane + comptime!((rt * MMA_M) as usize * p_ldv + kc as usize * 2);
            pa.push(def.load_matrix::<Vector<F, NV>, Const<2>>(
                &p_s.slice(at, at + 1),
                MatrixIdent::A,
                4usize,
                false,
            ));
        }
        accumulate_pv::<F, NV>(v_s, v_buf + v_lane, kc, &pa, acc, v_ldv, SLAB, rts);
    }
}

/// `out = softmax(x)·v` and the row log-sum-exp `lse`, for f16/bf16 tensors whose rows are
/// contiguous and 16-byte aligned (row lengths and every stride multiples of 8), `d3` at most
/// `c.value_dim` ([`config()`]), with `stages` copy stages ([`stages()`]).
///
/// Copies run in groups: group `j` is `V`'s step `j` and `X`'s step `j + 1`, in stage
/// `j % stages`, issued `stages − 1` steps ahead. Step `st`, after its barrier: issue group
/// `st + stages − 1` (into the stage that group `st − 1` used, read by then), produce `P` of
/// step `st + 1` from `X` in shared memory, consume step `st`. Step 0's scores are loaded from
/// global memory in the prologue.
///
/// Shapes (the flash kernels' 4-D view, one head): `x` `[B, 1, d1, d2]`, `v` `[B or 1, 1, d2,
/// d3]` (batch stride 0 when shared), `out` `[B, 1, d1, d3]`, `lse` `[B, 1, d1]`.
///
/// Grid: `(1, row blocks, B)` folded as [`crate::flash::fold_grid`] lays it out; [`planes()`]
/// planes per cube.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
pub fn softmax_matmul_wide<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    out: &mut Tensor<Vector<F, NV>>,
    lse: &mut Tensor<f32>,
    #[comptime] c: FlashConfig,
    #[comptime] stages: u32,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(c.block_k as usize);
    let bq = comptime!(c.block_q as usize);
    let rts = comptime!(c.row_tiles);
    let slabs = comptime!(c.value_dim / SLAB);
    let tiles = comptime!(SLAB / MMA_N);
    let vectors = comptime!((c.block_k / (ROW_LANES * NV8 as u32)) as usize);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let p_ldv = comptime!((c.block_k + V_PAD) as usize / NV8);
    let v_len = comptime!(c.block_k as usize * v_ldv);
    let p_len = comptime!(c.block_q as usize * p_ldv);

    let blk = cube_block(x, x, c);
    let (seq_k, rows, batch, row0) = (blk.seq_k, blk.rows, blk.batch, blk.row0);
    let value_dim = out.shape(3);
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let steps = seq_k.div_ceil(bk);
    let full_steps = seq_k / bk;

    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(stages as usize * v_len));
    let mut x_s = SharedMemory::<Vector<F, NV>>::new(comptime!(stages as usize * p_len));
    let mut p_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * p_len));
    let mut alpha_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut inv_s = SharedMemory::<f32>::new(bq);
    let mut bars = Sequence::<Shared<Barrier>>::new();
    #[unroll]
    for _ in 0..stages {
        bars.push(Barrier::shared(CUBE_DIM, UNIT_POS == 0));
    }

    // -- producer role: row `p_row` of the block, vectors `4u + part` of each step --
    let producer = plane < PRODUCERS;
    let p_row = (plane * PRODUCER_ROWS + lane / ROW_LANES) as usize;
    let part = (lane % ROW_LANES) as usize;
    let x_row = usize::min(row0 + p_row, rows - 1);
    let p_at = p_row * p_ldv;
    let mut m = f32::min_value();
    let mut l = 0.0f32;
    let mut xr = Array::<Vector<F, NV>>::new(vectors);

    // -- consumer role: rows `16·row_tiles·group ..`, columns `SLAB·slab ..` --
    let group = plane / slabs;
    let slab = plane % slabs;
    let mat = lane / 8;
    let mat_row = lane % 8;
    let row_base = (group * MMA_M * rts) as usize;
    let p_lane = (row_base + ((mat % 2) * 8 + mat_row) as usize) * p_ldv + (mat / 2) as usize;
    let v_lane = ((mat % 2) * 8 + mat_row) as usize * v_ldv
        + (slab * SLAB) as usize / NV8
        + (mat / 2) as usize;
    let row_lane = row_base + (lane / 4) as usize;
    let mut acc = zero_accumulators(comptime!(rts * tiles));

    let bases = (
        batch * x.stride(0) + row0 * x.stride(2),
        batch * v.stride(0),
    );
    // Read once: a tensor's strides come from memory.
    let strides = (x.stride(2), v.stride(2));
    let sizes = (rows - row0, seq_k, value_dim);

    // -- prologue: groups 0 .. stages − 1; step 0's scores straight from global memory --
    #[unroll]
    for j in 0..comptime!(stages as usize - 1) {
        stage_group::<F, NV>(
            x, v, &mut x_s, &mut v_s, j, steps, bases, strides, sizes, c, stages,
        );
        commit_group(&bars, j, stages);
    }
    if producer && steps > 0 {
        let x_base = batch * x.stride(0) + x_row * x.stride(2);
        #[unroll]
        for u in 0..vectors {
            let col = (comptime!(u * ROW_LANES as usize) + part) * NV8;
            xr[u] = x[(x_base + select(col < seq_k, col, 0)) / NV8];
        }
        if full_steps > 0 {
            produce::<F, NV>(
                &xr,
                0,
                part,
                seq_k,
                &mut m,
                &mut l,
                &mut p_s,
                &mut alpha_s,
                p_at,
                p_row,
                c,
                false,
            );
        } else {
            produce::<F, NV>(
                &xr,
                0,
                part,
                seq_k,
                &mut m,
                &mut l,
                &mut p_s,
                &mut alpha_s,
                p_at,
                p_row,
                c,
                true,
            );
        }
    }

    for st in 0..steps {
        let parity = st % 2;
        let stage = st % stages as usize;
        // Group `st` (V of this step, X of the next) has landed, every P of this step is
        // written, and every plane is done with the buffers of the step before.
        wait_group(&bars, st, stages);
        sync_cube();
        let j = st + comptime!(stages as usize - 1);
        stage_group::<F, NV>(
            x, v, &mut x_s, &mut v_s, j, steps, bases, strides, sizes, c, stages,
        );
        commit_group(&bars, j, stages);
        let next = st + 1;
        if producer && next < steps {
            #[unroll]
            for u in 0..vectors {
                xr[u] = x_s[stage * p_len + p_at + comptime!(u * ROW_LANES as usize) + part];
            }
            let (p_next, a_next) = ((1 - parity) * p_len + p_at, (1 - parity) * bq + p_row);
            if next < full_steps {
                produce::<F, NV>(
                    &xr,
                    next * bk,
                    part,
                    seq_k,
                    &mut m,
                    &mut l,
                    &mut p_s,
                    &mut alpha_s,
                    p_next,
                    a_next,
                    c,
                    false,
                );
            } else {
                produce::<F, NV>(
                    &xr,
                    next * bk,
                    part,
                    seq_k,
                    &mut m,
                    &mut l,
                    &mut p_s,
                    &mut alpha_s,
                    p_next,
                    a_next,
                    c,
                    true,
                );
            }
        }
        consume::<F, NV>(
            &p_s,
            &v_s,
            &alpha_s,
            (parity * p_len, stage * v_len, parity * bq),
            (p_lane, v_lane, row_lane),
            &mut acc,
            c,
        );
    }

    // -- the rows' sums: the producers' lanes of a row add their shares; the row's first lane
    // stores the log-sum-exp and shares the output scale --
    if producer {
        let mut total = l;
        #[unroll]
        for k in 0..comptime!(ROW_LANES.trailing_zeros()) {
            total += plane_shuffle_xor(total, comptime!(1u32 << k));
        }
        let row = row0 + p_row;
        if part == 0 {
            inv_s[p_row] = inverse_sum(output_sum(m, total, c));
            if row < rows && blk.first_tile {
                lse[batch * lse.stride(0) + row * lse.stride(2)] = row_lse(m, total, c);
            }
        }
    }
    sync_cube();

    // -- normalise and store, 16 bytes per lane --
    #[unroll]
    for slot in 0..comptime!(2 * rts as usize) {
        let r = row_lane + comptime!(16 * (slot / 2) + 8 * (slot % 2));
        let row = row0 + r;
        let o_base = batch * out.stride(0) + usize::min(row, rows - 1) * out.stride(2);
        store_row_vectors::<F, NV>(
            out,
            &acc,
            comptime!((slot / 2) as u32 * tiles),
            comptime!(slot % 2),
            inv_s[r],
            o_base,
            (slab * SLAB) as usize,
            value_dim,
            row < rows,
            tiles,
        );
    }
}
