//! Device code of `softmax(X)·V`, forward and backward, on plain units (any runtime, any float).
//!
//! Every tensor is 3-D `[batch, rows, cols]` and indexed through its strides (a batch stride of
//! 0 shares one `V` between batches). Values are stored in `F`; all arithmetic is in f32.
//!
//! A cube has [`UNITS`] units in a 16 × 16 grid. Products of two shared-memory tiles are
//! register-tiled ([`tile_fma()`]): unit `(ty, tx)` owns rows `ty·TM .. ty·TM + TM` and columns
//! `tx, tx + 16, …` of the cube's output tile, so that the 16 units of a half-plane read 16
//! consecutive columns of the second operand and one broadcast row of the first.

use cubecl::prelude::*;

use crate::flash::{inverse_sum, log_sum_exp, next_reference, rescale_factor};

// These kernels keep the accurate `exp`: with the approximate one the f32 forward's error
// exceeded twice that of Burn's naive composition on some random inputs (d2 = 1025).

/// Units per cube of every kernel here (a 16 × 16 grid).
pub const UNITS: u32 = 256;
/// Side of the unit grid.
pub const GRID: u32 = 16;

/// Comptime configuration of [`smm_forward()`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ForwardTiles {
    /// Rows of `X` (and of the output) per cube.
    pub block_1: u32,
    /// Columns of `X` (rows of `V`) per step of the online softmax.
    pub block_2: u32,
    /// Output columns per cube (a cube recomputes the softmax statistics for each such tile).
    pub tile_3: u32,
}

/// Comptime configuration of the backward product kernels: an output tile of `rows × cols`
/// accumulated over the reduced dimension in steps of `depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProductTiles {
    /// Output rows per cube (a multiple of 16).
    pub rows: u32,
    /// Output columns per cube (a multiple of 16).
    pub cols: u32,
    /// Step along the reduced dimension.
    pub depth: u32,
}

/// `acc += A·B` for one unit's register tile, with both operands in shared memory.
///
/// `A[row][k]` is at `a[row·a_row + k·a_k]` and `B[k][col]` at `b[k·b_k + col·b_col]`; the unit
/// owns rows `ty·tm + i` and columns `tx + 16·c`; `acc[i·tn + c]` is its element `(i, c)`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn tile_fma(
    a: &SharedMemory<f32>,
    b: &SharedMemory<f32>,
    acc: &mut Array<f32>,
    ty: u32,
    tx: u32,
    #[comptime] a_row: u32,
    #[comptime] a_k: u32,
    #[comptime] b_k: u32,
    #[comptime] b_col: u32,
    #[comptime] depth: u32,
    #[comptime] tm: u32,
    #[comptime] tn: u32,
) {
    let a_base = (ty * tm * a_row) as usize;
    let b_base = (tx * b_col) as usize;
    let mut av = Array::<f32>::new(comptime!(tm as usize));
    let mut bv = Array::<f32>::new(comptime!(tn as usize));
    for k in 0..depth {
        #[unroll]
        for i in 0..tm {
            av[i as usize] = a[a_base + (i * a_row + k * a_k) as usize];
        }
        #[unroll]
        for c in 0..tn {
            bv[c as usize] = b[b_base + (k * b_k + c * GRID * b_col) as usize];
        }
        #[unroll]
        for i in 0..tm {
            #[unroll]
            for c in 0..tn {
                let idx = (i * tn + c) as usize;
                acc[idx] += av[i as usize] * bv[c as usize];
            }
        }
    }
}

/// Columns of the forward's unit grid: a plane per grid row, so that every unit of a plane
/// reads the same `P` vector (a broadcast) and 32 consecutive `V` vectors.
pub const FORWARD_GRID_X: u32 = 32;
/// Rows of the forward's unit grid.
pub const FORWARD_GRID_Y: u32 = UNITS / FORWARD_GRID_X;

/// `out = softmax(x)·v` row block by row block, never storing the softmax, plus the row
/// log-sum-exp `lse = m + ln l` (−inf for a row without a finite score, whose output is 0).
///
/// Grid: `(output column tiles, row blocks, batch)`; column tiles are the fastest axis so that
/// the cubes reading the same rows of `x` run together and share them through L2.
///
/// Per step of `block_2` columns: each unit takes groups of 4 consecutive scores of one row
/// (`block_1 · block_2 / 4` groups), the row's step maximum `m'` is reduced through shared
/// memory, `P = e^(x − m')` is written to shared memory as 4-vectors along the row and summed,
/// the accumulator is rescaled by `e^(m − m')` and `P·V_j` is added. In the product, unit
/// `(ty, tx)` of the 8 × 32 grid owns rows `ty·tm ..` and the `NT` consecutive columns
/// `tx·NT ..`: per 4 steps of `k` it reads `tm` broadcast `P` vectors and 4 `V` vectors for
/// `16·tm·NT`… FMAs, so shared memory feeds the FMA units.
#[cube(launch_unchecked)]
pub fn smm_forward<F: Float, NT: Size>(
    x: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[define(F)] _dtype: StorageType,
) {
    let nt = NT::value();
    let b1 = comptime!(t.block_1);
    let b2 = comptime!(t.block_2);
    let t3 = comptime!(t.tile_3);
    // Groups of 4 scores per row, and the pitch of a `P` row in 4-vectors.
    let groups = comptime!(t.block_2 / 4);
    let tm = comptime!(t.block_1 / FORWARD_GRID_Y);
    let group_rounds = comptime!((t.block_1 * t.block_2 / 4).div_ceil(UNITS));
    let v_pitch = comptime!(t.tile_3 as usize / nt);

    let batch = CUBE_POS_Z as usize;
    let row0 = (CUBE_POS_Y * b1) as usize;
    let col0 = (CUBE_POS_X * t3) as usize;
    let d1 = x.shape(1);
    let d2 = x.shape(2);
    let d3 = v.shape(2);
    let x_base = batch * x.stride(0);
    let v_base = batch * v.stride(0);
    let (xs1, xs2) = (x.stride(1), x.stride(2));
    let (vs1, vs2) = (v.stride(1), v.stride(2));
    let ty = UNIT_POS / FORWARD_GRID_X;
    let tx = UNIT_POS % FORWARD_GRID_X;

    let mut p_s =
        SharedMemory::<Vector<f32, Const<4>>>::new(comptime!((t.block_1 * t.block_2 / 4) as usize));
    let mut v_s = SharedMemory::<Vector<f32, NT>>::new(comptime!(t.block_2 as usize * v_pitch));
    let mut red = SharedMemory::<f32>::new(comptime!((t.block_1 * t.block_2 / 4) as usize));
    let mut row_s = SharedMemory::<f32>::new(comptime!(t.block_1 as usize));

    let mut acc = Array::<Vector<f32, NT>>::new(comptime!(tm as usize));
    #[unroll]
    for i in 0..tm {
        acc[i as usize] = Vector::new(0.0f32);
    }
    // Statistics of the rows of this unit's groups (one row per round).
    let mut m = Array::<f32>::new(comptime!(group_rounds as usize));
    let mut l = Array::<f32>::new(comptime!(group_rounds as usize));
    let mut xg = Array::<Vector<f32, Const<4>>>::new(comptime!(group_rounds as usize));
    let mut alpha = Array::<f32>::new(comptime!(group_rounds as usize));
    #[unroll]
    for e in 0..group_rounds {
        m[e as usize] = f32::min_value();
        l[e as usize] = 0.0f32;
    }

    let steps = d2.div_ceil(b2 as usize);
    for step in 0..steps {
        let j0 = step * b2 as usize;
        // -- a. this unit's groups of scores and their maxima; the V tile --
        #[unroll]
        for e in 0..group_rounds {
            let idx = UNIT_POS + e * UNITS;
            if idx < b1 * groups {
                let (r, g) = (idx / groups, idx % groups);
                let row = row0 + r as usize;
                let mut vec = Vector::<f32, Const<4>>::new(f32::min_value());
                let mut gmax = f32::min_value();
                #[unroll]
                for q in 0..4u32 {
                    let col = j0 + (g * 4 + q) as usize;
                    if row < d1 && col < d2 {
                        let val = f32::cast_from(x[x_base + row * xs1 + col * xs2]);
                        vec[q as usize] = val;
                        gmax = f32::max(gmax, val);
                    }
                }
                xg[e as usize] = vec;
                red[idx as usize] = gmax;
            }
        }
        #[unroll]
        for e in 0..comptime!((t.block_2 as usize * v_pitch).div_ceil(UNITS as usize)) {
            let idx = UNIT_POS as usize + e * UNITS as usize;
            if idx < comptime!(t.block_2 as usize * v_pitch) {
                let (k, cv) = (idx / v_pitch, idx % v_pitch);
                let mut vec = Vector::<f32, NT>::new(0.0f32);
                #[unroll]
                for c in 0..nt {
                    let col = col0 + cv * nt + c;
                    if j0 + k < d2 && col < d3 {
                        vec[c] = f32::cast_from(v[v_base + (j0 + k) * vs1 + col * vs2]);
                    }
                }
                v_s[idx] = vec;
            }
        }
        sync_cube();

        // -- b. new row maxima, P = e^(x − m') (0 outside the row), its partial sums --
        let mut psum = Array::<f32>::new(comptime!(group_rounds as usize));
        #[unroll]
        for e in 0..group_rounds {
            let idx = UNIT_POS + e * UNITS;
            psum[e as usize] = 0.0f32;
            if idx < b1 * groups {
                let (r, g) = (idx / groups, idx % groups);
                let mut step_max = f32::min_value();
                for q in 0..groups {
                    step_max = f32::max(step_max, red[(r * groups + q) as usize]);
                }
                let m_new = next_reference(m[e as usize], step_max, false);
                alpha[e as usize] = rescale_factor(m[e as usize], m_new);
                m[e as usize] = m_new;
                let xv = xg[e as usize];
                let mut p = Vector::<f32, Const<4>>::new(0.0f32);
                #[unroll]
                for q in 0..4u32 {
                    if j0 + ((g * 4 + q) as usize) < d2 {
                        p[q as usize] = f32::exp(xv[q as usize] - m_new);
                    }
                }
                p_s[idx as usize] = p;
                psum[e as usize] = p[0usize] + p[1usize] + p[2usize] + p[3usize];
            }
        }
        sync_cube();
        #[unroll]
        for e in 0..group_rounds {
            let idx = UNIT_POS + e * UNITS;
            if idx < b1 * groups {
                red[idx as usize] = psum[e as usize];
                let g = idx % groups;
                if g == 0 {
                    row_s[(idx / groups) as usize] = alpha[e as usize];
                }
            }
        }
        sync_cube();

        // -- c. running sums; rescale the accumulator; acc += P·V_j --
        #[unroll]
        for e in 0..group_rounds {
            let idx = UNIT_POS + e * UNITS;
            if idx < b1 * groups {
                let r = idx / groups;
                let mut total = 0.0f32;
                for q in 0..groups {
                    total += red[(r * groups + q) as usize];
                }
                l[e as usize] = alpha[e as usize] * l[e as usize] + total;
            }
        }
        #[unroll]
        for i in 0..tm {
            acc[i as usize] = acc[i as usize] * Vector::new(row_s[(ty * tm + i) as usize]);
        }
        let a_base = (ty * tm * groups) as usize;
        for kv in 0..groups {
            let mut a = Array::<Vector<f32, Const<4>>>::new(comptime!(tm as usize));
            #[unroll]
            for i in 0..tm {
                a[i as usize] = p_s[a_base + (i * groups + kv) as usize];
            }
            #[unroll]
            for kk in 0..4u32 {
                let bv = v_s[(kv * 4 + kk) as usize * v_pitch + tx as usize];
                #[unroll]
                for i in 0..tm {
                    let ai = a[i as usize];
                    acc[i as usize] += Vector::new(ai[kk as usize]) * bv;
                }
            }
        }
        sync_cube();
    }

    // -- normalise and store --
    #[unroll]
    for e in 0..group_rounds {
        let idx = UNIT_POS + e * UNITS;
        let g = idx % groups;
        if idx < b1 * groups && g == 0 {
            let r = idx / groups;
            row_s[r as usize] = l[e as usize];
            let row = row0 + r as usize;
            if row < d1 && CUBE_POS_X == 0 {
                // ln 0 = −inf: a row without a finite score gets lse = −inf.
                let at = batch * lse.stride(0) + row * lse.stride(1);
                lse[at] = log_sum_exp(m[e as usize], l[e as usize]);
            }
        }
    }
    sync_cube();
    let (os1, os2) = (out.stride(1), out.stride(2));
    let o_base = batch * out.stride(0);
    #[unroll]
    for i in 0..tm {
        let r = ty * tm + i;
        let row = row0 + r as usize;
        let sum = row_s[r as usize];
        let inv = inverse_sum(sum);
        let vec = acc[i as usize];
        #[unroll]
        for c in 0..nt {
            let col = col0 + tx as usize * nt + c;
            if row < d1 && col < d3 {
                out[o_base + row * os1 + col * os2] = F::cast_from(vec[c] * inv);
            }
        }
    }
}

/// Rows of `delta` per cube of [`smm_delta()`].
pub const DELTA_ROWS: u32 = 8;
/// Units per cube of [`smm_delta()`]: 32 per row.
pub const DELTA_UNITS: u32 = 32 * DELTA_ROWS;

/// `delta[b, i] = Σ_c dO[b, i, c] · O[b, i, c]` (f32 accumulation): 32 units per row read it
/// coalesced, their partial sums are added through shared memory. Grid: rows / [`DELTA_ROWS`]
/// cubes, along x then y.
#[cube(launch_unchecked)]
pub fn smm_delta<F: Float>(
    d_out: &Tensor<F>,
    out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let d1 = out.shape(1);
    let d3 = out.shape(2);
    let rows = out.shape(0) * d1;
    let lane = (UNIT_POS % 32) as usize;
    let group = UNIT_POS / 32;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let r = cube * DELTA_ROWS as usize + group as usize;
    let (b, i) = (r / d1, r % d1);
    let mut partial = 0.0f32;
    if r < rows {
        let g_base = b * d_out.stride(0) + i * d_out.stride(1);
        let o_base = b * out.stride(0) + i * out.stride(1);
        let (gs, os) = (d_out.stride(2), out.stride(2));
        for s in 0..d3.div_ceil(32) {
            let c = s * 32 + lane;
            if c < d3 {
                partial +=
                    f32::cast_from(d_out[g_base + c * gs]) * f32::cast_from(out[o_base + c * os]);
            }
        }
    }
    let mut part_s = SharedMemory::<f32>::new(DELTA_UNITS as usize);
    part_s[UNIT_POS as usize] = partial;
    sync_cube();
    if lane == 0 && r < rows {
        let mut sum = 0.0f32;
        for q in 0..32u32 {
            sum += part_s[(group * 32 + q) as usize];
        }
        if comptime!(crate::mutation::drop_delta()) {
            sum = 0.0f32;
        }
        delta[b * delta.stride(0) + i * delta.stride(1)] = sum;
    }
}

/// The softmax probability `P = e^(x − lse)`, 0 where the row had no finite score.
#[cube]
fn probability(x: f32, lse: f32, neg_inf: f32) -> f32 {
    select(lse == neg_inf, 0.0f32, f32::exp(x - lse))
}

/// `dX = P ⊙ (dO·Vᵀ − delta)`, with `P` recomputed from `x` and the saved log-sum-exp.
///
/// Grid: `(column tiles of d2, row tiles of d1, batch)`. The product `dO·Vᵀ` is accumulated over
/// `d3` in steps of `depth`; `x` is read only in the epilogue.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn smm_backward_dx<F: Float>(
    x: &Tensor<F>,
    v: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dx: &mut Tensor<F>,
    neg_inf: f32,
    #[comptime] t: ProductTiles,
    #[define(F)] _dtype: StorageType,
) {
    let tm = comptime!(t.rows / GRID);
    let tn = comptime!(t.cols / GRID);
    let depth = comptime!(t.depth);
    let batch = CUBE_POS_Z as usize;
    let row0 = (CUBE_POS_Y * t.rows) as usize;
    let col0 = (CUBE_POS_X * t.cols) as usize;
    let d1 = x.shape(1);
    let d2 = x.shape(2);
    let d3 = v.shape(2);
    let g_base = batch * d_out.stride(0);
    let v_base = batch * v.stride(0);
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;

    // dO tile row-major [rows][depth]; V tile [cols][depth + 1] (padded: conflict-free reads).
    let mut g_s = SharedMemory::<f32>::new(comptime!((t.rows * t.depth) as usize));
    let mut v_s = SharedMemory::<f32>::new(comptime!((t.cols * (t.depth + 1)) as usize));
    let mut acc = Array::<f32>::new(comptime!((tm * tn) as usize));
    #[unroll]
    for i in 0..tm * tn {
        acc[i as usize] = 0.0f32;
    }

    let steps = d3.div_ceil(depth as usize);
    for step in 0..steps {
        let c0 = step * depth as usize;
        #[unroll]
        for e in 0..comptime!(t.rows * t.depth / UNITS) {
            let idx = UNIT_POS + e * UNITS;
            let (r, c) = ((idx / depth) as usize, (idx % depth) as usize);
            let mut val = 0.0f32;
            if row0 + r < d1 && c0 + c < d3 {
                val = f32::cast_from(
                    d_out[g_base + (row0 + r) * d_out.stride(1) + (c0 + c) * d_out.stride(2)],
                );
            }
            g_s[idx as usize] = val;
        }
        #[unroll]
        for e in 0..comptime!(t.cols * t.depth / UNITS) {
            let idx = UNIT_POS + e * UNITS;
            let (j, c) = (idx / depth, idx % depth);
            let mut val = 0.0f32;
            if col0 + (j as usize) < d2 && c0 + (c as usize) < d3 {
                val = f32::cast_from(
                    v[v_base + (col0 + j as usize) * v.stride(1) + (c0 + c as usize) * v.stride(2)],
                );
            }
            v_s[(j * (depth + 1) + c) as usize] = val;
        }
        sync_cube();
        tile_fma(
            &g_s,
            &v_s,
            &mut acc,
            ty,
            tx,
            depth,
            1u32,
            1u32,
            comptime!(t.depth + 1),
            depth,
            tm,
            tn,
        );
        sync_cube();
    }

    let x_base = batch * x.stride(0);
    let dx_base = batch * dx.stride(0);
    let (dxs1, dxs2) = (dx.stride(1), dx.stride(2));
    #[unroll]
    for i in 0..tm {
        let row = row0 + (ty * tm + i) as usize;
        if row < d1 {
            let row_lse = lse[batch * lse.stride(0) + row * lse.stride(1)];
            let row_delta = delta[batch * delta.stride(0) + row * delta.stride(1)];
            #[unroll]
            for c in 0..tn {
                let col = col0 + (tx + c * GRID) as usize;
                if col < d2 {
                    let xv = f32::cast_from(x[x_base + row * x.stride(1) + col * x.stride(2)]);
                    let p = probability(xv, row_lse, neg_inf);
                    let mut grad = p * (acc[(i * tn + c) as usize] - row_delta);
                    if comptime!(crate::mutation::zero_dx()) {
                        grad = 0.0f32;
                    }
                    dx[dx_base + row * dxs1 + col * dxs2] = F::cast_from(grad);
                }
            }
        }
    }
}

/// `dV = Pᵀ·dO`, with `P` recomputed from `x` and the saved log-sum-exp, summed over
/// `inner_batches` consecutive batches (all of them when `V` is shared, else 1).
///
/// Grid: `(column tiles of d3, row tiles of d2, batch / inner_batches)`; the product runs over
/// `d1` in steps of `depth`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn smm_backward_dv<F: Float>(
    x: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    dv: &mut Tensor<F>,
    inner_batches: usize,
    neg_inf: f32,
    #[comptime] t: ProductTiles,
    #[define(F)] _dtype: StorageType,
) {
    let tm = comptime!(t.rows / GRID);
    let tn = comptime!(t.cols / GRID);
    let depth = comptime!(t.depth);
    let row0 = (CUBE_POS_Y * t.rows) as usize; // along d2
    let col0 = (CUBE_POS_X * t.cols) as usize; // along d3
    let d1 = x.shape(1);
    let d2 = x.shape(2);
    let d3 = d_out.shape(2);
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;

    // P tile row-major [depth][rows] (A = Pᵀ read transposed); dO tile [depth][cols].
    let mut p_s = SharedMemory::<f32>::new(comptime!((t.depth * t.rows) as usize));
    let mut g_s = SharedMemory::<f32>::new(comptime!((t.depth * t.cols) as usize));
    let mut acc = Array::<f32>::new(comptime!((tm * tn) as usize));
    #[unroll]
    for i in 0..tm * tn {
        acc[i as usize] = 0.0f32;
    }

    let steps = d1.div_ceil(depth as usize);
    for bi in 0..inner_batches {
        let batch = CUBE_POS_Z as usize * inner_batches + bi;
        let x_base = batch * x.stride(0);
        let g_base = batch * d_out.stride(0);
        for step in 0..steps {
            let i0 = step * depth as usize;
            #[unroll]
            for e in 0..comptime!(t.depth * t.rows / UNITS) {
                let idx = UNIT_POS + e * UNITS;
                let (k, j) = ((idx / t.rows) as usize, (idx % t.rows) as usize);
                let mut p = 0.0f32;
                if i0 + k < d1 && row0 + j < d2 {
                    let row = i0 + k;
                    let xv =
                        f32::cast_from(x[x_base + row * x.stride(1) + (row0 + j) * x.stride(2)]);
                    p = probability(
                        xv,
                        lse[batch * lse.stride(0) + row * lse.stride(1)],
                        neg_inf,
                    );
                }
                p_s[idx as usize] = p;
            }
            #[unroll]
            for e in 0..comptime!(t.depth * t.cols / UNITS) {
                let idx = UNIT_POS + e * UNITS;
                let (k, c) = ((idx / t.cols) as usize, (idx % t.cols) as usize);
                let mut val = 0.0f32;
                if i0 + k < d1 && col0 + c < d3 {
                    val = f32::cast_from(
                        d_out[g_base + (i0 + k) * d_out.stride(1) + (col0 + c) * d_out.stride(2)],
                    );
                }
                g_s[idx as usize] = val;
            }
            sync_cube();
            tile_fma(
                &p_s,
                &g_s,
                &mut acc,
                ty,
                tx,
                1u32,
                comptime!(t.rows),
                comptime!(t.cols),
                1u32,
                depth,
                tm,
                tn,
            );
            sync_cube();
        }
    }

    let dv_base = CUBE_POS_Z as usize * dv.stride(0);
    let (dvs1, dvs2) = (dv.stride(1), dv.stride(2));
    #[unroll]
    for i in 0..tm {
        let row = row0 + (ty * tm + i) as usize;
        #[unroll]
        for c in 0..tn {
            let col = col0 + (tx + c * GRID) as usize;
            if row < d2 && col < d3 {
                dv[dv_base + row * dvs1 + col * dvs2] = F::cast_from(acc[(i * tn + c) as usize]);
            }
        }
    }
}
