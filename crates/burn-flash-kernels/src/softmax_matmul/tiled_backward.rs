//! The register-tiled backward products of `softmax(X)·V` on plain units (any runtime; f32
//! arithmetic for every float type), with the inner loop of [`crate::tiling`].
//!
//! Both gradients are products `C = A·B` over a reduction index `k`, with `P = e^(x − lse)`
//! recomputed from the saved log-sum-exp (0 for a row without a finite score):
//!
//! - `dV = Pᵀ·dO` (`dv`): `C[j, c] = Σ_i P[i, j]·dO[i, c]`, `k = i` runs over `d1` (and over
//!   every batch when `V` is shared). `A[k][m] = P[i, j]` and `B[k][n] = dO[i, c]` are rows of `x`
//!   and `dO` as they lie in memory.
//! - `dX = P ⊙ (dO·Vᵀ − δ)`: `C[i, j] = Σ_c dO[i, c]·V[j, c]`, `k = c` runs over `d3`; `A` and
//!   `B` are `dO` and `V` *transposed*: a unit loads a 4 × 4 block along their rows and writes it
//!   transposed (4-vector column XOR-swizzled by `2·(k / 4)`, conflict-free as in the forward).
//!   The epilogue reads `x`, `lse` and `δ = rowsum(dO ⊙ O)` and stores `P ⊙ (C − δ)`.
//!
//! A cube of [`crate::tiling::UNITS`] units owns a [`TILE_M`] × [`TILE_N`] tile of `C` and walks `k` in steps of
//! [`STEP`]: units 0..128 stage `A`, units 128..256 stage `B` (double-buffered, one `sync_cube` per
//! step, the next step's loads in flight during the product), then every unit does 8 × 8 FMAs per
//! `k` from two `A` and two `B` 4-vectors. Loads are unconditional, from clamped addresses; only
//! the last, partial step masks (to zeros).

use cubecl::prelude::*;

use crate::tiling::{BUF, SCORE_UNITS, STEP, TILE_M, TILE_N, VECS, pre_at, product_step};

/// Shared memory of [`smm_backward_tiled()`], in bytes: two `A` and two `B` buffers.
pub const SHARED_BYTES: usize = (4 * BUF * 16) as usize;

/// Loads this unit's part of step `k0` of its operand (`src`: `A` for units 0..128, `B` for
/// the others; `at = (base, stride of k, stride of m/n)`, `o0` its first row/column of `m`/`n`,
/// `mn_len` its length there) into `pre`: four 4-vectors along `m`/`n` at rows `k` (`dv`), or a
/// 4 × 4 block of rows `m`/`n`, 4-vectors along `k` (else).
#[cube]
// `offset` is assigned in both comptime branches.
#[allow(clippy::too_many_arguments, unused_assignments)]
fn load_step<F: Float, NV: Size>(
    src: &Tensor<Vector<F, NV>>,
    pre: &mut Array<Vector<F, NV>>,
    at: (usize, usize, usize),
    o0: usize,
    mn_len: usize,
    k_len: usize,
    k0: usize,
    #[comptime] dv: bool,
) {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let (base, s_k, s_mn) = at;
    let u = (UNIT_POS % SCORE_UNITS) as usize;
    #[unroll]
    for e in 0..4usize {
        #[unroll]
        for q in 0..per4 {
            let mut offset = 0usize;
            if comptime!(dv) {
                // Row k = u / 32 + 4·e, 4-vector u % 32 along m/n.
                let idx = u + e * SCORE_UNITS as usize;
                let k = usize::min(k0 + idx / VECS as usize, k_len - 1);
                let c = o0 + 4 * (idx % VECS as usize) + q * nv;
                let c = select(c < mn_len, c, 0);
                offset = base + k * s_k + c * s_mn;
            } else {
                // Row m/n = 4·(u / 4) + e, columns k = 4·(u % 4) ..
                let r = usize::min(o0 + 4 * (u / 4) + e, mn_len - 1);
                let k = k0 + 4 * (u % 4) + q * nv;
                let k = select(k < k_len, k, 0);
                offset = base + r * s_mn + k * s_k;
            }
            pre[e * per4 + q] = src[offset / nv];
        }
    }
}

/// Writes this unit's loaded part into the `A` (units 0..128) or `B` buffer at `pbuf`: `dV`'s `A`
/// as `P = e^(x − lse)`; `masked` (the last, partial step) zeroes reduction indices past `K`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn build_step<F: Float, NV: Size>(
    pre: &Array<Vector<F, NV>>,
    lse: &Tensor<f32>,
    lse_base: usize,
    a_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    b_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    pbuf: usize,
    k0: usize,
    k_len: usize,
    neg_inf: f32,
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
                let row = usize::min(k0 + k, k_len - 1);
                let l = lse[lse_base + row * lse.stride(1)];
                #[unroll]
                for c in 0..4usize {
                    vec[c] = select(l == neg_inf, 0.0f32, f32::exp(vec[c] - l));
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

/// The product of one batch: every step of `k` (double buffers from `parity`), accumulated
/// into `acc`; `at = (stride of k, stride of m/n, first row/column of m/n, length of m/n, K)` of
/// this unit's operand. Returns the parity after the last step.
#[cube]
#[allow(clippy::too_many_arguments)]
fn product_batch<F: Float, NV: Size>(
    a: &Tensor<Vector<F, NV>>,
    b: &Tensor<Vector<F, NV>>,
    lse: &Tensor<f32>,
    a_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    b_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    acc: &mut Array<Vector<f32, Const<4>>>,
    pre: &mut Array<Vector<F, NV>>,
    batch: usize,
    parity: usize,
    at: (usize, usize, usize, usize, usize),
    ty: u32,
    tx: u32,
    neg_inf: f32,
    #[comptime] dv: bool,
) -> usize {
    let (s_k, s_mn, o0, mn_len, k_len) = at;
    let is_a = UNIT_POS < SCORE_UNITS;
    let step = STEP as usize;
    let steps = k_len.div_ceil(step);
    let full_steps = k_len / step;
    let src_at = (batch * select(is_a, a.stride(0), b.stride(0)), s_k, s_mn);
    let lse_base = batch * lse.stride(0);
    if is_a {
        load_step::<F, NV>(a, pre, src_at, o0, mn_len, k_len, 0, dv);
    } else {
        load_step::<F, NV>(b, pre, src_at, o0, mn_len, k_len, 0, dv);
    }
    for s in 0..steps {
        let pbuf = ((parity + s) % 2) * BUF as usize;
        let k0 = s * step;
        if s < full_steps {
            build_step::<F, NV>(
                pre, lse, lse_base, a_s, b_s, pbuf, k0, k_len, neg_inf, dv, false,
            );
        } else {
            build_step::<F, NV>(
                pre, lse, lse_base, a_s, b_s, pbuf, k0, k_len, neg_inf, dv, true,
            );
        }
        let next = usize::min(s + 1, steps - 1) * step;
        if is_a {
            load_step::<F, NV>(a, pre, src_at, o0, mn_len, k_len, next, dv);
        } else {
            load_step::<F, NV>(b, pre, src_at, o0, mn_len, k_len, next, dv);
        }
        sync_cube();
        product_step(acc, a_s, b_s, a_s, pbuf, 0, ty, tx, false, !dv);
    }
    (parity + steps) % 2
}

/// `dV` (`dv = true`: `a = x`, `b = d_out`, `out = dV`; with `sum_batches`, summed over
/// `inner_batches` consecutive batches) or `dX` (`a = d_out`, `b = v`, `out = dX`) by the register-tiled product of the
/// module docs. Grid: `(N / TILE_N, M / TILE_M, batch / inner_batches)` (rounded up),
/// [`crate::tiling::UNITS`] units. `NV` (1, 2 or 4) divides the rows and strides of every tensor (last stride 1).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn smm_backward_tiled<F: Float, NV: Size>(
    a: &Tensor<Vector<F, NV>>,
    b: &Tensor<Vector<F, NV>>,
    x: &Tensor<Vector<F, NV>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    out: &mut Tensor<Vector<F, NV>>,
    inner_batches: usize,
    neg_inf: f32,
    #[comptime] dv: bool,
    #[comptime] sum_batches: bool,
    #[define(F)] _dtype: StorageType,
) {
    let nv = NV::value();
    let m0 = (CUBE_POS_Y * TILE_M) as usize;
    let n0 = (CUBE_POS_X * TILE_N) as usize;
    let (d1, d2) = (x.shape(1), x.shape(2));
    let d3 = b.shape(2);
    let plane = UNIT_POS / 32;
    let ty = (plane / 2) * 4 + (UNIT_POS % 32) / 8;
    let tx = (plane % 2) * 8 + UNIT_POS % 8;
    // (K, M, N) of the product.
    let mut k_len = d3;
    let mut m_len = d1;
    let mut n_len = d2;
    if comptime!(dv) {
        k_len = d1;
        m_len = d2;
        n_len = d3;
    }

    let mut a_s = SharedMemory::<Vector<f32, Const<4>>>::new(comptime!(2 * BUF as usize));
    let mut b_s = SharedMemory::<Vector<f32, Const<4>>>::new(comptime!(2 * BUF as usize));
    let mut acc = Array::<Vector<f32, Const<4>>>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = Vector::new(0.0f32);
    }
    let mut pre = Array::<Vector<F, NV>>::new(comptime!(16 / nv));

    let is_a = UNIT_POS < SCORE_UNITS;
    // This unit's operand: dV: A[k = i][m = j] = x[i, j], B[k = i][n = c] = dO[i, c]; dX:
    // A[k = c][m = i] = dO[i, c], B[k = c][n = j] = v[j, c].
    let mut s_k = select(is_a, a.stride(2), b.stride(2));
    let mut s_mn = select(is_a, a.stride(1), b.stride(1));
    if comptime!(dv) {
        s_k = select(is_a, a.stride(1), b.stride(1));
        s_mn = select(is_a, a.stride(2), b.stride(2));
    }
    let o0 = select(is_a, m0, n0);
    let mn_len = select(is_a, m_len, n_len);
    let at = (s_k, s_mn, o0, mn_len, k_len);
    if comptime!(sum_batches) {
        let mut parity = 0usize;
        for bi in 0..inner_batches {
            let batch = CUBE_POS_Z as usize * inner_batches + bi;
            parity = product_batch::<F, NV>(
                a, b, lse, &mut a_s, &mut b_s, &mut acc, &mut pre, batch, parity, at, ty, tx,
                neg_inf, dv,
            );
        }
    } else {
        product_batch::<F, NV>(
            a,
            b,
            lse,
            &mut a_s,
            &mut b_s,
            &mut acc,
            &mut pre,
            CUBE_POS_Z as usize,
            0,
            at,
            ty,
            tx,
            neg_inf,
            dv,
        );
    }

    // -- epilogue: C (dV), or P ⊙ (C − δ) (dX) --
    let o_batch = CUBE_POS_Z as usize;
    let o_base = o_batch * out.stride(0);
    let (os1, os2) = (out.stride(1), out.stride(2));
    let x_base = o_batch * x.stride(0);
    let (xs1, xs2) = (x.stride(1), x.stride(2));
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
                    row_lse = lse[o_batch * lse.stride(0) + row * lse.stride(1)];
                    row_delta = delta[o_batch * delta.stride(0) + row * delta.stride(1)];
                }
                #[unroll]
                for g in 0..2u32 {
                    let vec = acc[((4 * h + i) * 2 + g) as usize];
                    #[unroll]
                    for q in 0..per4 {
                        let col = n0 + (64 * g + 4 * tx) as usize + q * nv;
                        if col < n_len {
                            let mut o = Vector::<F, NV>::empty();
                            if comptime!(dv) {
                                #[unroll]
                                for c in 0..nv {
                                    o[c] = F::cast_from(vec[q * nv + c]);
                                }
                            } else {
                                let xv = x[(x_base + row * xs1 + col * xs2) / nv];
                                #[unroll]
                                for c in 0..nv {
                                    let p = select(
                                        row_lse == neg_inf,
                                        0.0f32,
                                        f32::exp(f32::cast_from(xv[c]) - row_lse),
                                    );
                                    let mut grad = p * (vec[q * nv + c] - row_delta);
                                    if comptime!(crate::mutation::zero_dx()) {
                                        grad = 0.0f32;
                                    }
                                    o[c] = F::cast_from(grad);
                                }
                            }
                            out[(o_base + row * os1 + col * os2) / nv] = o;
                        }
                    }
                }
            }
        }
    }
}
