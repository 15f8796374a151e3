//! The register-tiled plain-unit forward of `softmax(X)·V` (any runtime; f32 arithmetic for
//! every float type): an SGEMM-style inner loop fed by an online softmax.
//!
//! A cube of [`UNITS`] units owns a [`TILE_M`] × [`TILE_N`] output tile and walks `d2` in steps
//! of [`STEP`] columns. With plane shuffles (`planes`), each step has two phases separated by
//! one `sync_cube`, with double-buffered shared memory so that the next step's writes never race
//! this step's reads; without, the row maxima go through shared memory, which costs a second
//! `sync_cube` per step, and single buffers suffice (and fit wgpu's 32 KiB):
//!
//! - **Build** (units 0..128 and 128..256 split the work): a *score unit* holds a 4 × 4 block
//!   of scores (4 rows, 4 consecutive columns); the 4 score units of a row group exchange their
//!   maxima, update the row's reference maximum lazily (only when it grows by
//!   more than 8), and write `P = e^(x − m)` *transposed* into shared memory as
//!   4-vectors along the rows, with the row scales `α = e^(m_old − m)` (1 when unchanged). A
//!   *V unit* copies four 4-vectors of the step's `V` tile into shared memory. Both then load the
//!   next step's scores / `V` into the same registers, so the global loads overlap the product.
//! - **Product**: unit `(ty, tx)` of a 16 × 16 grid owns rows `4·ty .. +4` and `64 + 4·ty .. +4`
//!   and columns `4·tx .. +4` and `64 + 4·tx .. +4` (64 f32 accumulators). Per reduction index it
//!   reads two `P` 4-vectors and two `V` 4-vectors (a plane covers 4 × 8 units: 4 distinct `P`
//!   and 8 distinct `V` vectors, one shared-memory wavefront each) for 64 FMAs; rows whose scale
//!   is not 1 are rescaled first (rare after the first steps).
//!
//! `P` is stored with its 4-vector column XOR-swizzled by the step column's group
//! (`rg ^ 2·(k / 4)`), so the build's transposed writes are conflict-free while the product's
//! reads stay one wavefront.
//!
//! Loads are unconditional, from clamped addresses (rows past `d1`, columns past `d2`/`d3` read
//! valid memory and are masked at use or never stored); only the last, partial step masks.

use cubecl::prelude::*;

use crate::flash::{inverse_sum, log_sum_exp, next_reference, rescale_factor};

/// Units per cube.
pub const UNITS: u32 = 256;
/// Rows of `X` (and of the output) per cube.
pub const TILE_M: u32 = 128;
/// Output columns per cube.
pub const TILE_N: u32 = 128;
/// Columns of `X` (rows of `V`) per step.
pub const STEP: u32 = 16;

/// Units that build `P` (the others stage `V`).
pub(super) const SCORE_UNITS: u32 = 128;
/// 4-vectors per row of a `P`ᵀ / `V` tile.
pub(super) const VECS: u32 = TILE_M / 4;
/// 4-vectors of one buffer of the `P`ᵀ or `V` tile.
pub(super) const BUF: u32 = STEP * VECS;

/// Shared memory of [`smm_forward_tiled()`], in bytes: `P`ᵀ, `V` and row-scale buffers (two
/// of each with `planes`), the row sums, and without `planes` the chunk maxima.
pub fn shared_bytes(planes: bool) -> usize {
    let vecs = if planes {
        4 * BUF + 3 * VECS
    } else {
        2 * BUF + 2 * VECS + TILE_M
    };
    (vecs * 16) as usize
}

/// Shared-memory buffers of one step.
#[derive(CubeType)]
struct Buffers {
    /// `P`ᵀ, 4-vectors along the rows, column-swizzled (see the module docs).
    p_s: SharedMemory<Vector<f32, Const<4>>>,
    /// The step's `V` tile, 4-vectors along the row.
    v_s: SharedMemory<Vector<f32, Const<4>>>,
    /// Row scales (per buffer), then the row sums.
    a_s: SharedMemory<Vector<f32, Const<4>>>,
    /// Without planes: the score units' chunk maxima, `[row][column chunk]`.
    mx_s: SharedMemory<Vector<f32, Const<4>>>,
}

/// Loads one step's inputs into `pre`: a score unit its 4 × 4 block of `x` (rows
/// `row0 + 4·rg + i`, columns `j0 + 4·cc ..`), a V unit four 4-vectors of `v`'s `STEP` × `TILE_N`
/// tile. Addresses are clamped into the tensors.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_step<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    pre: &mut Array<Vector<F, NV>>,
    j0: usize,
    row0: usize,
    col0: usize,
    x_at: (usize, usize, usize),
    v_at: (usize, usize, usize),
    dims: (usize, usize, usize),
) {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let (x_base, xs1, xs2) = x_at;
    let (v_base, vs1, vs2) = v_at;
    let (d1, d2, d3) = dims;
    if UNIT_POS < SCORE_UNITS {
        let rg = (UNIT_POS / 4) as usize;
        let cc = (UNIT_POS % 4) as usize;
        #[unroll]
        for i in 0..4usize {
            let r = usize::min(row0 + 4 * rg + i, d1 - 1);
            #[unroll]
            for q in 0..per4 {
                let col = j0 + 4 * cc + q * nv;
                let col = select(col < d2, col, 0);
                pre[i * per4 + q] = x[(x_base + r * xs1 + col * xs2) / nv];
            }
        }
    } else {
        let vu = (UNIT_POS - SCORE_UNITS) as usize;
        #[unroll]
        for e in 0..4usize {
            let idx = vu + e * SCORE_UNITS as usize;
            let (k, c4) = (idx / VECS as usize, idx % VECS as usize);
            let row = usize::min(j0 + k, d2 - 1);
            #[unroll]
            for q in 0..per4 {
                let col = col0 + 4 * c4 + q * nv;
                let col = select(col < d3, col, 0);
                pre[e * per4 + q] = v[(v_base + row * vs1 + col * vs2) / nv];
            }
        }
    }
}

/// Element `c` (0..4) of 4-vector `g` of `pre`, as f32.
#[cube]
pub(super) fn pre_at<F: Float, NV: Size>(
    pre: &Array<Vector<F, NV>>,
    g: usize,
    #[comptime] c: usize,
) -> f32 {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let vec = pre[g * per4 + comptime!(c / nv)];
    f32::cast_from(vec[comptime!(c % nv)])
}

/// The build phase of one step (see the module docs): `P`ᵀ and the row scales into the buffers
/// at `pbuf` / `abuf` (score units), the `V` tile into the buffer at `pbuf` (V units). `masked`
/// (the last, partial step) zeroes `P` and `V` past `d2`. Without `planes` the chunk maxima go
/// through shared memory: every unit of the cube must call this.
#[cube]
// The comptime `masked` test cannot be merged with the runtime one.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn build_step<F: Float, NV: Size>(
    pre: &Array<Vector<F, NV>>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    sh: &mut Buffers,
    pbuf: usize,
    abuf: usize,
    j0: usize,
    d2: usize,
    #[comptime] planes: bool,
    #[comptime] masked: bool,
) {
    let rg = UNIT_POS / 4;
    let cc = UNIT_POS % 4;
    let mut valid = Array::<bool>::new(4usize);
    #[unroll]
    for c in 0..4usize {
        valid[c] = j0 + (4 * cc) as usize + c < d2;
    }
    // -- this unit's maximum of each of its 4 rows, then the rows' maxima --
    let mut rmax = Vector::<f32, Const<4>>::empty();
    if UNIT_POS < SCORE_UNITS {
        #[unroll]
        for i in 0..4usize {
            let mut cmax = f32::min_value();
            #[unroll]
            for c in 0..4usize {
                let val = pre_at::<F, NV>(pre, i, c);
                if comptime!(masked) {
                    cmax = select(valid[c], f32::max(cmax, val), cmax);
                } else {
                    cmax = f32::max(cmax, val);
                }
            }
            rmax[i] = cmax;
        }
        if comptime!(planes) {
            #[unroll]
            for i in 0..4usize {
                let r = f32::max(rmax[i], plane_shuffle_xor(rmax[i], 1));
                rmax[i] = f32::max(r, plane_shuffle_xor(r, 2));
            }
        } else {
            sh.mx_s[UNIT_POS as usize] = rmax;
        }
    }
    if comptime!(!planes) {
        sync_cube();
        if UNIT_POS < SCORE_UNITS {
            #[unroll]
            for q in 0..4u32 {
                let other = sh.mx_s[(4 * rg + q) as usize];
                #[unroll]
                for i in 0..4usize {
                    rmax[i] = f32::max(rmax[i], other[i]);
                }
            }
        }
    }
    if UNIT_POS < SCORE_UNITS {
        let mut alpha = Vector::<f32, Const<4>>::empty();
        let mut p = Array::<f32>::new(16usize);
        #[unroll]
        for i in 0..4usize {
            // The lazy rule of `crate::flash`: most steps keep the reference (α = 1, no exp).
            let mut a = 1.0f32;
            let m_new = next_reference(m[i], rmax[i], true);
            if m_new != m[i] {
                a = rescale_factor(m[i], m_new);
                m[i] = m_new;
                l[i] *= a;
            }
            alpha[i] = a;
            let mut sum = 0.0f32;
            #[unroll]
            for c in 0..4usize {
                let mut e = f32::exp(pre_at::<F, NV>(pre, i, c) - m[i]);
                if comptime!(masked) {
                    e = select(valid[c], e, 0.0f32);
                }
                p[i * 4 + c] = e;
                sum += e;
            }
            l[i] += sum;
        }
        // Column k = 4·cc + kk of Pᵀ, 4-vector rg (swizzled by the column group cc).
        let col = (rg ^ (2 * cc)) as usize;
        #[unroll]
        for kk in 0..4usize {
            let mut vec = Vector::<f32, Const<4>>::empty();
            #[unroll]
            for i in 0..4usize {
                vec[i] = p[i * 4 + kk];
            }
            sh.p_s[pbuf + (4 * cc as usize + kk) * VECS as usize + col] = vec;
        }
        if cc == 0 {
            sh.a_s[abuf + rg as usize] = alpha;
        }
    } else {
        let vu = (UNIT_POS - SCORE_UNITS) as usize;
        #[unroll]
        for e in 0..4usize {
            let idx = vu + e * SCORE_UNITS as usize;
            let k = idx / VECS as usize;
            let mut vec = Vector::<f32, Const<4>>::empty();
            #[unroll]
            for c in 0..4usize {
                vec[c] = pre_at::<F, NV>(pre, e, c);
            }
            if comptime!(masked) {
                if j0 + k >= d2 {
                    vec = Vector::new(0.0f32);
                }
            }
            sh.v_s[pbuf + idx] = vec;
        }
    }
}

/// The product phase of one step: with `rescale`, rescale the rows whose scale in `a_s` (at
/// `abuf`) is not 1; then `acc += A·B` over the step's `STEP` reduction indices, from `A` (`P`ᵀ
/// here) and `B` (`V` here) tiles stored `[k][4-vector]` at `pbuf` in `p_s` and `v_s`; the
/// 4-vector index of `A`, and of `B` with `swizzle_b`, is XOR-swizzled by `2·(k / 4)`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn product_step(
    acc: &mut Array<Vector<f32, Const<4>>>,
    p_s: &SharedMemory<Vector<f32, Const<4>>>,
    v_s: &SharedMemory<Vector<f32, Const<4>>>,
    a_s: &SharedMemory<Vector<f32, Const<4>>>,
    pbuf: usize,
    abuf: usize,
    ty: u32,
    tx: u32,
    #[comptime] rescale: bool,
    #[comptime] swizzle_b: bool,
) {
    // acc[(4·h + i)·2 + g]: row 64·h + 4·ty + i, columns 64·g + 4·tx ..
    #[unroll]
    for h in 0..comptime!(if rescale { 2u32 } else { 0u32 }) {
        let alpha = a_s[abuf + (16 * h + ty) as usize];
        if alpha[0usize] != 1.0f32
            || alpha[1usize] != 1.0f32
            || alpha[2usize] != 1.0f32
            || alpha[3usize] != 1.0f32
        {
            #[unroll]
            for i in 0..4u32 {
                #[unroll]
                for g in 0..2u32 {
                    let at = ((4 * h + i) * 2 + g) as usize;
                    acc[at] = acc[at] * Vector::new(alpha[i as usize]);
                }
            }
        }
    }
    #[unroll]
    for k in 0..STEP {
        let swz = comptime!(2 * (k / 4));
        let row = pbuf + (k * VECS) as usize;
        let mut pa = Array::<Vector<f32, Const<4>>>::new(2usize);
        let mut vb = Array::<Vector<f32, Const<4>>>::new(2usize);
        #[unroll]
        for h in 0..2u32 {
            pa[h as usize] = p_s[row + (16 * h + (ty ^ swz)) as usize];
            let mut bx = tx;
            if comptime!(swizzle_b) {
                bx = tx ^ swz;
            }
            vb[h as usize] = v_s[row + (16 * h + bx) as usize];
        }
        #[unroll]
        for h in 0..2u32 {
            #[unroll]
            for i in 0..4u32 {
                let a = Vector::<f32, Const<4>>::new(pa[h as usize][i as usize]);
                #[unroll]
                for g in 0..2u32 {
                    let at = ((4 * h + i) * 2 + g) as usize;
                    acc[at] += a * vb[g as usize];
                }
            }
        }
    }
}

/// `out = softmax(x)·v` and `lse`, as [`crate::flash::units::flash_forward_units()`] with
/// given scores, with the register-tiled product of the module docs. Grid: `(d3 / TILE_N, d1 / TILE_M, batch)` (rounded up),
/// [`UNITS`] units per cube; `planes` needs plane shuffles over groups of 4 consecutive units.
/// `NV` (1, 2 or 4) divides the rows and strides of `x`, `v` and `out` (whose last stride is
/// then 1).
#[cube(launch_unchecked)]
// `is_multiple_of` has no device expansion in cubecl 0.10.
#[allow(clippy::manual_is_multiple_of)]
pub fn smm_forward_tiled<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    out: &mut Tensor<Vector<F, NV>>,
    lse: &mut Tensor<f32>,
    #[comptime] planes: bool,
    #[define(F)] _dtype: StorageType,
) {
    let nv = NV::value();
    let batch = CUBE_POS_Z as usize;
    let row0 = (CUBE_POS_Y * TILE_M) as usize;
    let col0 = (CUBE_POS_X * TILE_N) as usize;
    let d1 = out.shape(1);
    let d2 = x.shape(2);
    let d3 = out.shape(2);
    let dims = (d1, d2, d3);
    let x_at = (batch * x.stride(0), x.stride(1), x.stride(2));
    let v_at = (batch * v.stride(0), v.stride(1), v.stride(2));
    let plane = UNIT_POS / 32;
    let ty = (plane / 2) * 4 + (UNIT_POS % 32) / 8;
    let tx = (plane % 2) * 8 + UNIT_POS % 8;

    let bufs = comptime!(if planes { 2usize } else { 1usize });
    let mut sh = Buffers {
        p_s: SharedMemory::new(comptime!(bufs * BUF as usize)),
        v_s: SharedMemory::new(comptime!(bufs * BUF as usize)),
        a_s: SharedMemory::new(comptime!((bufs + 1) * VECS as usize)),
        mx_s: SharedMemory::new(comptime!(if planes {
            1usize
        } else {
            SCORE_UNITS as usize
        })),
    };

    let mut acc = Array::<Vector<f32, Const<4>>>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = Vector::new(0.0f32);
    }
    // Score units: reference maximum and partial sum of each of their 4 rows.
    let mut m = Array::<f32>::new(4usize);
    let mut l = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        m[i] = f32::min_value();
        l[i] = 0.0f32;
    }
    let mut pre = Array::<Vector<F, NV>>::new(comptime!(16 / nv));

    let step = STEP as usize;
    let steps = d2.div_ceil(step);
    let full_steps = d2 / step;
    load_step::<F, NV>(x, v, &mut pre, 0, row0, col0, x_at, v_at, dims);
    for s in 0..steps {
        // Single buffers without planes: the maxima's `sync_cube` separates this step's writes
        // from the previous step's reads.
        let mut parity = 0usize;
        if comptime!(planes) {
            parity = s % 2;
        }
        let pbuf = parity * BUF as usize;
        let abuf = parity * VECS as usize;
        let j0 = s * step;
        if s < full_steps {
            build_step::<F, NV>(
                &pre, &mut m, &mut l, &mut sh, pbuf, abuf, j0, d2, planes, false,
            );
        } else {
            build_step::<F, NV>(
                &pre, &mut m, &mut l, &mut sh, pbuf, abuf, j0, d2, planes, true,
            );
        }
        let next = usize::min(s + 1, steps - 1) * step;
        load_step::<F, NV>(x, v, &mut pre, next, row0, col0, x_at, v_at, dims);
        sync_cube();
        product_step(
            &mut acc, &sh.p_s, &sh.v_s, &sh.a_s, pbuf, abuf, ty, tx, true, false,
        );
    }

    // -- row sums and log-sum-exp (score units), then normalise and store --
    let l_at = comptime!(bufs * VECS as usize);
    if comptime!(!planes) {
        if UNIT_POS < SCORE_UNITS {
            let mut partial = Vector::<f32, Const<4>>::empty();
            #[unroll]
            for i in 0..4usize {
                partial[i] = l[i];
            }
            sh.mx_s[UNIT_POS as usize] = partial;
        }
        sync_cube();
    }
    if UNIT_POS < SCORE_UNITS {
        let rg = UNIT_POS / 4;
        let mut sums = Vector::<f32, Const<4>>::empty();
        #[unroll]
        for i in 0..4usize {
            let mut total = 0.0f32;
            if comptime!(planes) {
                total = l[i] + plane_shuffle_xor(l[i], 1);
                total += plane_shuffle_xor(total, 2);
            } else {
                #[unroll]
                for q in 0..4u32 {
                    total += sh.mx_s[(4 * rg + q) as usize][i];
                }
            }
            sums[i] = total;
            let row = row0 + (4 * rg) as usize + i;
            if UNIT_POS % 4 == 0 && row < d1 && CUBE_POS_X == 0 {
                // ln 0 = −inf: a row without a finite score gets lse = −inf.
                let at = batch * lse.stride(0) + row * lse.stride(1);
                lse[at] = log_sum_exp(m[i], total);
            }
        }
        if UNIT_POS % 4 == 0 {
            sh.a_s[l_at + rg as usize] = sums;
        }
    }
    sync_cube();
    let o_base = batch * out.stride(0);
    let (os1, os2) = (out.stride(1), out.stride(2));
    let per4 = comptime!(4 / nv);
    #[unroll]
    for h in 0..2u32 {
        let sums = sh.a_s[l_at + (16 * h + ty) as usize];
        #[unroll]
        for i in 0..4u32 {
            let total = sums[i as usize];
            let inv = inverse_sum(total);
            let row = row0 + (64 * h + 4 * ty + i) as usize;
            if row < d1 {
                #[unroll]
                for g in 0..2u32 {
                    let vec = acc[((4 * h + i) * 2 + g) as usize];
                    #[unroll]
                    for q in 0..per4 {
                        let col = col0 + (64 * g + 4 * tx) as usize + q * nv;
                        if col < d3 {
                            let mut o = Vector::<F, NV>::empty();
                            #[unroll]
                            for c in 0..nv {
                                o[c] = F::cast_from(vec[q * nv + c] * inv);
                            }
                            out[(o_base + row * os1 + col * os2) / nv] = o;
                        }
                    }
                }
            }
        }
    }
}
