//! Device code of the `softmax(X)·V` backward on plain units (any runtime, any float); the
//! forward is the flash loop of [`crate::flash`] with given scores.
//!
//! Every tensor is 3-D `[batch, rows, cols]` and indexed through its strides (a batch stride of
//! 0 shares one `V` between batches). Values are stored in `F`; all arithmetic is in f32.
//!
//! A cube has [`UNITS`] units in a 16 × 16 grid. Products of two shared-memory tiles are
//! register-tiled ([`tile_fma()`]): unit `(ty, tx)` owns rows `ty·TM .. ty·TM + TM` and columns
//! `tx, tx + 16, …` of the cube's output tile, so that the 16 units of a half-plane read 16
//! consecutive columns of the second operand and one broadcast row of the first.

use cubecl::prelude::*;

// These kernels keep the accurate `exp`: with the approximate one the f32 forward's error
// exceeded twice that of Burn's naive composition on some random inputs (d2 = 1025).

/// Units per cube of every kernel here (a 16 × 16 grid).
pub const UNITS: u32 = 256;
/// Side of the unit grid.
pub const GRID: u32 = 16;

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
