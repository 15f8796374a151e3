//! The 16-bit matrix-unit forward of `softmax(X)·V` with its memory traffic overlapped with the
//! arithmetic (CUDA, sm_80+; 16-byte aligned rows).
//!
//! Per plane of 32 lanes, 16 rows of `X` and `tile_3` output columns (FlashAttention-2 style),
//! like [`super::mma::smm_forward_mma16()`], with three changes:
//!
//! - **`X` goes straight from global memory into registers**, 16 bytes per load, and the loads
//!   of the next step are issued before the current step's arithmetic. This works because the
//!   reduction dimension may be permuted freely, as long as `P` and `V` are permuted alike: a
//!   lane that holds logical columns `{2t, 2t+1, 2t+8, 2t+9}` of an `mma` A operand (PTX
//!   m16n8k16 layout, `t = lane % 4`) takes the 4 *consecutive* columns `4t .. 4t+4` of `X`
//!   instead, and two `mma` steps take 8 consecutive columns, one 16-byte vector.
//! - **`V` is staged with asynchronous copies** (`cp.async`, 16 bytes) into two shared-memory
//!   buffers: the copies of step `j + 1` run while step `j` computes, completion is tracked by
//!   one shared barrier per buffer, and one `sync_cube` per step protects buffer reuse. The
//!   copies write `V`'s rows in the permuted order, so each `ldmatrix.trans` still reads 8
//!   consecutive (conflict-free) rows.
//! - No shared memory for `X`, so two `V` buffers fit where the unpipelined kernel had one `V`
//!   and one `X` tile.

use cubecl::{
    cmma::MmaDefinition,
    ir::{FastMath, MatrixIdent},
    prelude::barrier::Barrier,
    prelude::*,
};

use super::kernel::ForwardTiles;
use crate::flash::{LAZY_RESCALE, inverse_sum, log_sum_exp, next_reference, rescale_factor};
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, mma_v_pair, quad_max, zero_accumulators};
use crate::staging::{commit_next, copy_vec, wait_step};
/// Columns of `X` one lane-quad loads per chunk: 4 lanes × 8 elements (16 bytes each).
pub const CHUNK: u32 = 32;

/// Shared memory of [`smm_forward_pipelined()`]: two padded `V` buffers of 16-bit elements.
pub fn shared_bytes(block_2: usize, tile_3: usize) -> usize {
    2 * block_2 * (tile_3 + V_PAD as usize) * 2
}

/// Whether the tile shape fits the kernel: whole chunks per step, whole `ldmatrix.x4` pairs.
pub fn tiles_fit(t: ForwardTiles) -> bool {
    t.block_2.is_multiple_of(CHUNK)
        && t.tile_3.is_multiple_of(16)
        && t.block_1.is_multiple_of(MMA_M)
}

/// Row of the shared `V` buffer that row `p` of the step's `V` tile is copied to: the logical
/// position of column `p` of `X` in the `mma` operand order (see the module docs).
#[cube]
fn staged_row(p: usize) -> usize {
    let q = p % 32;
    // Column q of a chunk is 8·t + 4·s' + 2·s + n: lane-quad member t, mma step s', operand
    // half s, element n; in operand order it is row 16·s' + 8·s + 2·t + n of the chunk.
    (p - q) + 16 * ((q % 8) / 4) + 8 * ((q % 4) / 2) + 2 * (q / 8) + q % 2
}

/// Issues the asynchronous copies of one step's `V` tile (`block_2 × tile_3`, zeros past the
/// tensor's edges) into the buffer at `buf`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_v<F: Float, NV: Size>(
    v: &Tensor<Vector<F, NV>>,
    v_s: &mut SharedMemory<Vector<F, NV>>,
    buf: usize,
    j0: usize,
    col0: usize,
    v_base: usize,
    vs1: usize,
    d2: usize,
    d3: usize,
    #[comptime] t: ForwardTiles,
) {
    let nv = NV::value();
    let units = comptime!((t.block_1 / MMA_M) * PLANE) as usize;
    let per_row = comptime!(t.tile_3 as usize / nv);
    let v_ldv = comptime!((t.tile_3 + V_PAD) as usize / nv);
    let total = comptime!(t.block_2 as usize * per_row);
    let exact = comptime!(total.is_multiple_of(units));
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units)) {
        let idx = UNIT_POS as usize + e * units;
        if exact || idx < total {
            let (p, cv) = (idx / per_row, idx % per_row);
            let (row, col) = (j0 + p, col0 + cv * nv);
            let valid = row < d2 && col < d3;
            let dst = buf + staged_row(p) * v_ldv + cv;
            copy_vec::<F, NV>(v, v_s, (v_base + row * vs1 + col) / nv, dst, valid);
        }
    }
}

/// Loads this lane's scores of one step: rows `r` and `r + 8`, 8 consecutive columns per chunk
/// (`xr[2·chunk + half]`). The loads are unconditional, from clamped addresses, so that nothing
/// waits for them before their use in the next step: rows past `d1` are never stored, columns
/// past `d2` are masked by [`pv_step()`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_x<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    xr: &mut Array<Vector<F, NV>>,
    x_base: usize,
    xs1: usize,
    row: usize,
    j0: usize,
    quad: usize,
    d1: usize,
    d2: usize,
    #[comptime] chunks: u32,
) {
    let nv = NV::value();
    #[unroll]
    for c in 0..chunks {
        let col = j0 + (c * CHUNK) as usize + quad * nv;
        let col = select(col < d2, col, 0);
        #[unroll]
        for h in 0..2usize {
            let r = usize::min(row + h * 8, d1 - 1);
            xr[c as usize * 2 + h] = x[(x_base + r * xs1 + col) / nv];
        }
    }
}

/// One step of `block_2` columns: the row maxima of this lane's scores `xr`, the (lazy)
/// rescale, and per `mma` step `P = e^(x − m)` as an A operand and `acc += P·V` with `V` from
/// the shared buffer at `buf`. `masked` (the last, partial step) zeroes the columns past `d2`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn pv_step<F: Float, NV: Size>(
    xr: &Array<Vector<F, NV>>,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    m: &mut Array<f32>,
    l: &mut Array<Vector<f32, Const<2>>>,
    v_s: &SharedMemory<Vector<F, NV>>,
    buf: usize,
    j0: usize,
    d2: usize,
    quad: usize,
    #[comptime] t: ForwardTiles,
    #[comptime] masked: bool,
) {
    let nv = NV::value();
    let chunks = comptime!(t.block_2 / CHUNK);
    let n_pairs = comptime!(t.tile_3 / 16);
    let v_ldv = comptime!((t.tile_3 + V_PAD) as usize / nv);
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let mat = lane / 8;
    let mat_row = lane % 8;
    // This lane's row of an `ldmatrix.x4.trans`: rows k (+ 8 for matrices 1, 3) of the step's
    // 16-row slice, columns + 8 for matrices 2, 3.
    let lane_base =
        buf + ((mat % 2) * 8 + mat_row) as usize * v_ldv + (mat / 2) as usize * (8 / nv);
    let mut ones = Array::<Vector<F, Const<2>>>::new(2usize);
    ones[0usize] = Vector::new(F::from_int(1));
    ones[1usize] = Vector::new(F::from_int(1));

    // -- the row maxima, in the storage type (no conversions) --
    let mut valid = Array::<bool>::new(comptime!(chunks as usize));
    let mut step_max = Array::<F>::new(2usize);
    step_max[0usize] = F::min_value();
    step_max[1usize] = F::min_value();
    #[unroll]
    for c in 0..chunks {
        let ok = j0 + (c * CHUNK) as usize + quad * nv < d2;
        valid[c as usize] = ok;
        #[unroll]
        for h in 0..2usize {
            let vec = xr[c as usize * 2 + h];
            #[unroll]
            for q in 0..nv {
                if comptime!(masked) {
                    step_max[h] = select(ok, F::max(step_max[h], vec[q]), step_max[h]);
                } else {
                    step_max[h] = F::max(step_max[h], vec[q]);
                }
            }
        }
    }
    // -- raise the reference maximum only when a row's maximum outgrows it --
    let mut m_new = Array::<f32>::new(2usize);
    let mut grow = false;
    #[unroll]
    for h in 0..2usize {
        // The lazy rule of `crate::flash`, per plane: when one row outgrows its reference by
        // more than LAZY_RESCALE, every row of the plane moves to its exact maximum.
        m_new[h] = next_reference(m[h], quad_max(f32::cast_from(step_max[h])), false);
        grow = grow || m_new[h] > m[h] + LAZY_RESCALE;
    }
    if plane_any(grow) {
        let mut alpha = Array::<f32>::new(2usize);
        #[unroll]
        for h in 0..2usize {
            // Every row moves to its exact maximum (finite: seeded with the lowest value).
            alpha[h] = rescale_factor(m[h], m_new[h]);
            m[h] = m_new[h];
            l[h] = l[h] * Vector::new(alpha[h]);
        }
        #[unroll]
        for nt in 0..comptime!(t.tile_3 / MMA_N) {
            let frag = acc.index_mut(nt as usize);
            // Fragment vector h holds row r + 8·h.
            #[unroll]
            for h in 0..2usize {
                frag[h] = frag[h] * Vector::new(alpha[h]);
            }
        }
    }

    #[unroll]
    for c in 0..chunks {
        let ok = valid[c as usize];
        #[unroll]
        for s in 0..2u32 {
            // A register i: row r + 8·(i % 2), operand half i / 2 = columns 2·(i / 2) + n
            // of this mma step's 4 columns.
            let mut a = Array::<Vector<F, Const<2>>>::new(4usize);
            #[unroll]
            for i in 0..4u32 {
                let h = (i % 2) as usize;
                let vec = xr[c as usize * 2 + h];
                let mut pair = Vector::<F, Const<2>>::empty();
                #[unroll]
                for n in 0..2u32 {
                    let q = (4 * s + 2 * (i / 2) + n) as usize;
                    let mut p = f32::exp(f32::cast_from(vec[q]) - m[h]);
                    if comptime!(masked) {
                        p = select(ok, p, 0.0f32);
                    }
                    pair[n as usize] = F::cast_from(p);
                }
                a[i as usize] = pair;
            }
            // Row sums of P on the matrix units: P times a column block of ones.
            def.execute_inplace(&a, &ones, l);
            let kc = c * 2 + s;
            #[unroll]
            for np in 0..n_pairs {
                let start =
                    lane_base + comptime!((kc * 16) as usize * v_ldv + (np * 16) as usize / nv);
                mma_v_pair::<F, NV>(&a, v_s, start, acc, np);
            }
        }
    }
}

/// `out = softmax(x)·v` and `lse`, as [`super::kernel::smm_forward()`], for f16/bf16 with
/// 16-byte vectors (`NV` = 8): `x` and `v` rows contiguous, their lengths and strides multiples
/// of 8 elements. Grid: `(output column tiles, row blocks, batch)`; `block_1 / 16` planes per
/// cube; `block_2` a multiple of 32.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
pub fn smm_forward_pipelined<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[define(F)] _dtype: StorageType,
) {
    let nv = NV::value();
    let b2 = comptime!(t.block_2) as usize;
    let t3 = comptime!(t.tile_3);
    let chunks = comptime!(t.block_2 / CHUNK);
    let v_ldv = comptime!((t.tile_3 + V_PAD) as usize / nv);
    let buf_len = comptime!(t.block_2 as usize * v_ldv);

    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let c_vecs = def.vectors_per_lane(MatrixIdent::Accumulator);

    let batch = CUBE_POS_Z as usize;
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let quad = (lane % 4) as usize;
    let row0 = (CUBE_POS_Y * t.block_1 + plane * MMA_M) as usize;
    let my_row = row0 + (lane / 4) as usize;
    let col0 = (CUBE_POS_X * t3) as usize;
    let d1 = out.shape(1);
    let d2 = x.shape(2);
    let d3 = out.shape(2);
    let x_base = batch * x.stride(0);
    let v_base = batch * v.stride(0);
    let (xs1, vs1) = (x.stride(1), v.stride(1));

    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * buf_len));
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let mut acc = zero_accumulators(comptime!(t.tile_3 / MMA_N));
    let mut m = Array::<f32>::new(2usize);
    // Row sums `l`, as an `mma` accumulator: vector h holds (twice) the sum of row r + 8·h.
    let mut l = Array::<Vector<f32, Const<2>>>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        m[h] = f32::min_value();
        l[h] = Vector::new(0.0f32);
    }
    let steps = d2.div_ceil(b2);
    // Steps whose columns are all inside the tensor need no masking.
    let full_steps = d2 / b2;
    let mut xr = Array::<Vector<F, NV>>::new(comptime!(2 * chunks as usize));
    let mut xn = Array::<Vector<F, NV>>::new(comptime!(2 * chunks as usize));

    // -- prologue: step 0's V copies and scores --
    stage_v::<F, NV>(v, &mut v_s, 0, 0, col0, v_base, vs1, d2, d3, t);
    bar0.commit_copy_async();
    let _token = bar0.arrive();
    load_x::<F, NV>(x, &mut xr, x_base, xs1, my_row, 0, quad, d1, d2, chunks);

    for step in 0..steps {
        let parity = step % 2;
        let next = step + 1;
        // -- issue step + 1's copies into the other buffer, and its scores --
        if next < steps {
            stage_v::<F, NV>(
                v,
                &mut v_s,
                (1 - parity) * buf_len,
                next * b2,
                col0,
                v_base,
                vs1,
                d2,
                d3,
                t,
            );
        }
        commit_next(&bar0, &bar1, step);
        let j0 = step * b2;
        load_x::<F, NV>(
            x,
            &mut xn,
            x_base,
            xs1,
            my_row,
            usize::min(next, steps - 1) * b2,
            quad,
            d1,
            d2,
            chunks,
        );

        let buf = parity * buf_len;
        wait_step(&bar0, &bar1, step);
        if step < full_steps {
            pv_step::<F, NV>(
                &xr, &mut acc, &mut m, &mut l, &v_s, buf, j0, d2, quad, t, false,
            );
        } else {
            pv_step::<F, NV>(
                &xr, &mut acc, &mut m, &mut l, &v_s, buf, j0, d2, quad, t, true,
            );
        }
        // Every plane is done with this buffer before step + 2's copies overwrite it.
        sync_cube();
        #[unroll]
        for i in 0..comptime!(2 * chunks) {
            xr[i as usize] = xn[i as usize];
        }
    }

    // -- normalise and store --
    let mut inv = Array::<f32>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        let total = l[h][0usize];
        inv[h] = inverse_sum(total);
        let row = my_row + h * 8;
        if quad == 0 && row < d1 && CUBE_POS_X == 0 {
            let at = batch * lse.stride(0) + row * lse.stride(1);
            lse[at] = log_sum_exp(m[h], total);
        }
    }
    let (os1, os2) = (out.stride(1), out.stride(2));
    let o_base = batch * out.stride(0);
    #[unroll]
    for nt in 0..comptime!(t.tile_3 / MMA_N) {
        let frag = acc.index(nt as usize);
        #[unroll]
        for h in 0..c_vecs {
            let vec = frag[h];
            let row = my_row + h * 8;
            #[unroll]
            for n in 0..2usize {
                let col = col0 + (nt * MMA_N) as usize + quad * 2 + n;
                if row < d1 && col < d3 {
                    out[o_base + row * os1 + col * os2] = F::cast_from(vec[n] * inv[h]);
                }
            }
        }
    }
}
