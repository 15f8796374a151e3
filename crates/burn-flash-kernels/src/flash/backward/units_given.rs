//! The plain-unit backward core's **given-score** products, register-tiled (any runtime; f32
//! arithmetic for every float type), with the inner loop of [`crate::tiling`].
//!
//! With given scores (`softmax_matmul`) nothing is accumulated across the two gradients: no
//! `dQ` needs `dS` while `dK` does, so the flash schedule of [`crate::flash::backward::units`]
//! (both products of a step in one cube, 4 × 2 scores per unit) buys nothing, and each gradient
//! is one product with the core's rules at its edge (faster than the flash schedule:
//! RESULTS.md, softmax·V backward):
//!
//! - `dV = Pᵀ·dO` (`dv`): `C[j, c] = Σ_r P[r, j]·dO[r, c]`, `k = r` runs over every row of the
//!   group (`G·d1`: a shared `V` sums its batches here, as grouped-query attention sums a
//!   group's heads); `P = e^(x − lse)` is rebuilt as the `A` operand is staged.
//! - `dX = P ⊙ (dO·Vᵀ − δ)`: `C[r, j] = Σ_c dO[r, c]·V[j, c]`, `k = c` runs over `d3`; `A` and
//!   `B` are `dO` and `V` *transposed*: a unit loads a 4 × 4 block along their rows and writes
//!   it transposed (4-vector column XOR-swizzled by `2·(k / 4)`, conflict-free as in the
//!   forward). The epilogue reads `x`, `lse` and `δ` and stores `P ⊙ (C − δ)`: the core's `dS`.
//!
//! Tensors are the core's 4-D views ([`BackwardOperands`] with given scores): `x`, `dO`, `dX`
//! `[pairs, G, d1, ·]`, `V`, `dV` `[pairs, 1, d2, d3]`, `lse` `[pairs, G, d1]`, `δ` contiguous
//! by row. A tile's rows may run over several heads of the group: every row's
//! address is its own (`head = r / d1`, `pos = r % d1`; a division only where the group has
//! several heads).
//!
//! [`BackwardOperands`]: crate::flash::args::BackwardOperands
//!
//! A cube of [`crate::tiling::UNITS`] units owns a [`TILE_M`] × [`TILE_N`] tile of `C` and walks `k` in steps of
//! [`STEP`]: units 0..128 stage `A`, units 128..256 stage `B` (double-buffered, one `sync_cube` per
//! step, the next step's loads in flight during the product), then every unit does 8 × 8 FMAs per
//! `k` from two `A` and two `B` 4-vectors. Loads are unconditional, from clamped addresses; only
//! the last, partial step masks (to zeros).

use cubecl::prelude::*;

use crate::flash::args::{BackwardLaunch, GradInputs};
use crate::flash::block::{cube_count, pair_index};
use crate::tiling::{BUF, SCORE_UNITS, STEP, TILE_M, TILE_N, VECS, pre_at, product_step};

/// Shared memory of [`flash_backward_given_tiled()`], in bytes: two `A` and two `B` buffers.
pub const SHARED_BYTES: usize = (4 * BUF * 16) as usize;

/// Cubes along x of [`flash_backward_given_tiled()`] for an `m × n` gradient.
pub fn tiles(m: usize, n: usize) -> usize {
    m.div_ceil(TILE_M as usize).max(1) * n.div_ceil(TILE_N as usize).max(1)
}

/// Where a unit's operand lies: the pair's base, the strides of a row's head, of its position
/// and of a column, the positions per head (`d1` for the rows of a group; `d2` for `V`'s rows,
/// all of head 0), and the rows (`m`/`n` or `k`, as staged) and columns there are.
#[derive(CubeType)]
struct Operand {
    base: usize,
    s_head: usize,
    s_pos: usize,
    s_col: usize,
    per_head: usize,
    rows: usize,
    cols: usize,
}

/// The [`Operand`] of the 4-D tensor `t` for batch pair `pair`: memory row `r` is head
/// `r / per_head`, position `r % per_head`.
#[cube]
fn operand<E: CubePrimitive>(
    t: &Tensor<E>,
    pair: usize,
    per_head: usize,
    rows: usize,
    cols: usize,
) -> Operand {
    Operand {
        base: pair * t.stride(0),
        s_head: t.stride(1),
        s_pos: t.stride(2),
        s_col: t.stride(3),
        per_head,
        rows,
        cols,
    }
}

/// Offset of element `col` of memory row `row` of `op`. Only rows over several heads (the
/// batches of a shared `V`) pay a division: the branch is the same for the whole cube.
#[cube]
fn at(op: &Operand, row: usize, col: usize) -> usize {
    let mut r = op.base + row * op.s_pos;
    if op.per_head < op.rows {
        r = op.base + (row / op.per_head) * op.s_head + (row % op.per_head) * op.s_pos;
    }
    r + col * op.s_col
}

/// Loads this unit's part of step `k0` of its operand (`A` for units 0..128, `B` for the
/// others; `o0` its first index of `m`/`n`) into `pre`: four 4-vectors along `m`/`n` at memory
/// rows `k` (`dv`), or a 4 × 4 block of memory rows `m`/`n`, 4-vectors along `k` (else).
#[cube]
fn load_step<F: Float, NV: Size>(
    src: &Tensor<Vector<F, NV>>,
    pre: &mut Array<Vector<F, NV>>,
    op: &Operand,
    o0: usize,
    k0: usize,
    #[comptime] dv: bool,
) {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let u = (UNIT_POS % SCORE_UNITS) as usize;
    #[unroll]
    for e in 0..4usize {
        // dv: memory row k = u / 32 + 4·e, 4-vector u % 32 along m/n; else memory row
        // m/n = 4·(u / 4) + e, columns k = 4·(u % 4) ..
        let mut row = o0 + 4 * (u / 4) + e;
        if comptime!(dv) {
            row = k0 + u / VECS as usize + 4 * e;
        }
        let row_at = at(op, usize::min(row, op.rows - 1), 0);
        #[unroll]
        for q in 0..per4 {
            let mut col = k0 + 4 * (u % 4) + q * nv;
            if comptime!(dv) {
                col = o0 + 4 * (u % VECS as usize) + q * nv;
            }
            let col = select(col < op.cols, col, 0);
            pre[e * per4 + q] = src[(row_at + col * op.s_col) / nv];
        }
    }
}

/// [`load_step()`] of this unit's operand: `x` or `dO` (`dv`), `dO` or `V` (else).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    d_out: &Tensor<Vector<F, NV>>,
    pre: &mut Array<Vector<F, NV>>,
    op: &Operand,
    o0: usize,
    k0: usize,
    #[comptime] dv: bool,
) {
    let is_a = UNIT_POS < SCORE_UNITS;
    if comptime!(dv) {
        if is_a {
            load_step::<F, NV>(x, pre, op, o0, k0, true);
        } else {
            load_step::<F, NV>(d_out, pre, op, o0, k0, true);
        }
    } else if is_a {
        load_step::<F, NV>(d_out, pre, op, o0, k0, false);
    } else {
        load_step::<F, NV>(v, pre, op, o0, k0, false);
    }
}

/// Writes this unit's loaded part into the `A` (units 0..128) or `B` buffer at `pbuf`: `dV`'s `A`
/// as `P = e^(x − lse)` (0 for a row without a finite score); `masked` (the last, partial step) zeroes reduction indices past `K`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn build_step<F: Float, NV: Size>(
    pre: &Array<Vector<F, NV>>,
    lse: &Tensor<f32>,
    lse_op: &Operand,
    a_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    b_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    pbuf: usize,
    k0: usize,
    k_len: usize,
    #[comptime] dv: bool,
    #[comptime] masked: bool,
) {
    let is_a = UNIT_POS < SCORE_UNITS;
    let u = (UNIT_POS % SCORE_UNITS) as usize;
    if comptime!(dv) {
        #[unroll]
        for e in 0..4usize {
            let idx = u + e * SCORE_UNITS as usize;
            let k = idx / VECS as usize;
            let mut vec = Vector::<f32, Const<4>>::empty();
            #[unroll]
            for c in 0..4usize {
                vec[c] = pre_at::<F, NV>(pre, e, c);
            }
            if is_a {
                // Read here rather than with the step's loads: fewer live registers.
                let l = lse[at(lse_op, usize::min(k0 + k, k_len - 1), 0)];
                #[unroll]
                for c in 0..4usize {
                    vec[c] = select(l > f32::min_value(), f32::exp(vec[c] - l), 0.0f32);
                }
            }
            if comptime!(masked) {
                vec = select(k0 + k < k_len, vec, Vector::new(0.0f32));
            }
            let mv = idx % VECS as usize;
            if is_a {
                a_s[pbuf + k * VECS as usize + (mv ^ (2 * (k / 4)))] = vec;
            } else {
                b_s[pbuf + idx] = vec;
            }
        }
    } else {
        let rg = u / 4;
        let cc = u % 4;
        let col = rg ^ (2 * cc);
        #[unroll]
        for kk in 0..4usize {
            let mut vec = Vector::<f32, Const<4>>::empty();
            #[unroll]
            for r in 0..4usize {
                vec[r] = pre_at::<F, NV>(pre, r, kk);
            }
            let k = 4 * cc + kk;
            if comptime!(masked) {
                vec = select(k0 + k < k_len, vec, Vector::new(0.0f32));
            }
            let at = pbuf + k * VECS as usize + col;
            if is_a {
                a_s[at] = vec;
            } else {
                b_s[at] = vec;
            }
        }
    }
}

/// 256 threads of register tiles: one cube per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

/// `dV` (`dv`: `a = x`, `b = dO`, `out = dV`) or `dX` (`a = dO`, `b = V`, `out = dX`) of one
/// (batch, key/value head) pair (module docs). Grid: `(tiles(m, n), y, z)` with the pairs
/// folded over `y·z` ([`crate::flash::block::fold_pairs`]), [`crate::tiling::UNITS`] units; `NV` (1, 2 or 4)
/// divides the rows and strides of every tensor (last stride 1).
#[cube(launch_unchecked)]
// `to` is assigned in both comptime branches.
#[allow(clippy::too_many_arguments, unused_assignments)]
pub fn flash_backward_given_tiled<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    grads: &GradInputs<Vector<F, NV>>,
    out: &mut Tensor<Vector<F, NV>>,
    #[comptime] dv: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (d_out, lse, delta) = (&grads.d_out, &grads.lse, &grads.delta);
    let nv = NV::value();
    let group = x.shape(1);
    let d1 = x.shape(2);
    let d2 = x.shape(3);
    let d3 = v.shape(3);
    let pair = pair_index();
    if pair >= x.shape(0) {
        terminate!();
    }
    let rows = group * d1;
    // (K, M, N) of the product.
    let mut k_len = d3;
    let mut m_len = rows;
    let mut n_len = d2;
    if comptime!(dv) {
        k_len = rows;
        m_len = d2;
        n_len = d3;
    }
    let n_tiles = n_len.div_ceil(TILE_N as usize).max(1);
    let m0 = (CUBE_POS_X as usize / n_tiles) * TILE_M as usize;
    let n0 = (CUBE_POS_X as usize % n_tiles) * TILE_N as usize;
    let plane = UNIT_POS / 32;
    let ty = (plane / 2) * 4 + (UNIT_POS % 32) / 8;
    let tx = (plane % 2) * 8 + UNIT_POS % 8;

    // The group's rows (x, dO): memory row r is head r / d1, position r % d1; V's rows: keys.
    // (V's rows are all of one head: `per_head` = `rows` = `d2`.)
    let x_op = operand(x, pair, d1, rows, d2);
    let o_op = operand(d_out, pair, d1, rows, d3);
    let v_op = operand(v, pair, d2, d2, d3);
    let lse_op = Operand {
        base: pair * lse.stride(0),
        s_head: lse.stride(1),
        s_pos: lse.stride(2),
        s_col: 0,
        per_head: d1,
        rows,
        cols: 1,
    };

    let mut a_s = SharedMemory::<Vector<f32, Const<4>>>::new(comptime!(2 * BUF as usize));
    let mut b_s = SharedMemory::<Vector<f32, Const<4>>>::new(comptime!(2 * BUF as usize));
    let mut acc = Array::<Vector<f32, Const<4>>>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = Vector::new(0.0f32);
    }
    let mut pre = Array::<Vector<F, NV>>::new(comptime!(16 / nv));

    // This unit's operand: dV: A[k = r][m = j] = x[r, j], B[k = r][n = c] = dO[r, c]; dX:
    // A[k = c][m = r] = dO[r, c], B[k = c][n = j] = V[j, c].
    let is_a = UNIT_POS < SCORE_UNITS;
    let o0 = select(is_a, m0, n0);
    let step = STEP as usize;
    let steps = k_len.div_ceil(step);
    let full_steps = k_len / step;
    // This unit's operand.
    // dO's rows, unless x's (dV's A) or V's (dX's B).
    let mut base = o_op.base;
    let mut s_head = o_op.s_head;
    let mut s_pos = o_op.s_pos;
    let mut s_col = o_op.s_col;
    let mut per_head = d1;
    let mut op_rows = rows;
    let mut cols = d3;
    if comptime!(dv) {
        if is_a {
            base = x_op.base;
            s_head = x_op.s_head;
            s_pos = x_op.s_pos;
            s_col = x_op.s_col;
            cols = d2;
        }
    } else if !is_a {
        base = v_op.base;
        s_head = 0;
        s_pos = v_op.s_pos;
        s_col = v_op.s_col;
        per_head = d2;
        op_rows = d2;
    }
    let op = Operand {
        base,
        s_head,
        s_pos,
        s_col,
        per_head,
        rows: op_rows,
        cols,
    };
    load::<F, NV>(x, v, d_out, &mut pre, &op, o0, 0, dv);
    for s in 0..steps {
        let pbuf = (s % 2) * BUF as usize;
        let k0 = s * step;
        if s < full_steps {
            build_step::<F, NV>(
                &pre, lse, &lse_op, &mut a_s, &mut b_s, pbuf, k0, k_len, dv, false,
            );
        } else {
            build_step::<F, NV>(
                &pre, lse, &lse_op, &mut a_s, &mut b_s, pbuf, k0, k_len, dv, true,
            );
        }
        let next = usize::min(s + 1, steps - 1) * step;
        load::<F, NV>(x, v, d_out, &mut pre, &op, o0, next, dv);
        sync_cube();
        product_step(&mut acc, &a_s, &b_s, &a_s, pbuf, 0, ty, tx, false, !dv);
    }

    // -- epilogue: C (dV), or P ⊙ (C − δ) (dX) --
    let out_op = Operand {
        base: pair * out.stride(0),
        s_head: out.stride(1),
        s_pos: out.stride(2),
        s_col: out.stride(3),
        per_head: d1,
        rows,
        cols: d2,
    };
    let per4 = comptime!(4 / nv);
    #[unroll]
    for h in 0..2u32 {
        #[unroll]
        for i in 0..4u32 {
            let row = m0 + (64 * h + 4 * ty + i) as usize;
            if row < m_len {
                let mut row_lse = 0.0f32;
                let mut row_delta = 0.0f32;
                if comptime!(!dv) {
                    row_lse = lse[at(&lse_op, row, 0)];
                    row_delta = delta[pair * rows + row];
                }
                #[unroll]
                for g in 0..2u32 {
                    let vec = acc[((4 * h + i) * 2 + g) as usize];
                    #[unroll]
                    for q in 0..per4 {
                        let col = n0 + (64 * g + 4 * tx) as usize + q * nv;
                        if col < n_len {
                            let mut o = Vector::<F, NV>::empty();
                            let mut to = 0usize;
                            if comptime!(dv) {
                                #[unroll]
                                for c in 0..nv {
                                    o[c] = F::cast_from(vec[q * nv + c]);
                                }
                                to = pair * out.stride(0)
                                    + row * out.stride(2)
                                    + col * out.stride(3);
                            } else {
                                let xv = x[at(&x_op, row, col) / nv];
                                #[unroll]
                                for c in 0..nv {
                                    let p = select(
                                        row_lse > f32::min_value(),
                                        f32::exp(f32::cast_from(xv[c]) - row_lse),
                                        0.0f32,
                                    );
                                    let mut grad = p * (vec[q * nv + c] - row_delta);
                                    if comptime!(crate::mutation::zero_dx()) {
                                        grad = 0.0f32;
                                    }
                                    o[c] = F::cast_from(grad);
                                }
                                to = at(&out_op, row, col);
                            }
                            out[to / nv] = o;
                        }
                    }
                }
            }
        }
    }
}

/// Runs [`flash_backward_given_tiled()`] for `dV` (on the launch's dK/dV grid) and for `dX`
/// (its dQ grid). The operands are the core's 4-D views (`t.q` is `X`, `t.ds` is `dX`);
/// `vector` (1, 2 or 4) divides the rows and strides of `x`, `V`, `dO`, `dX` and `dV`.
///
/// # Safety
/// The operands' shapes and strides describe their buffers and the grids are the kernel's
/// (`(tiles(m, n), y, z)`, pairs folded by [`crate::flash::block::fold_pairs`]).
pub unsafe fn launch<R: Runtime>(l: &BackwardLaunch<'_, R>, vector: usize) {
    let (client, t, delta, dtype) = (l.client, l.t, l.delta, l.dtype);
    let units = cubecl::CubeDim::new_1d(crate::tiling::UNITS);
    for (cubes, dv) in [(l.dkv_cubes, true), (l.dq_cubes, false)] {
        let Some(cubes) = cubes else { continue };
        let out = if dv { &t.dv } else { &t.ds };
        // SAFETY: the caller's.
        unsafe {
            flash_backward_given_tiled::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                units,
                vector,
                t.q.arg(),
                t.v.arg(),
                t.grad_inputs(delta),
                out.arg(),
                dv,
                dtype,
            );
        }
    }
}
