//! The forward of `softmax(X)·V` for f16/bf16 with `P·V` on the matrix units (manual `mma`,
//! f32 accumulators), FlashAttention-2 style: each plane owns 16 rows, builds its `P` operand in
//! registers from `X` (no shared memory for `P`), rescales its accumulators in registers, and
//! reads `V` from a shared-memory tile. Rows that are not 16-byte aligned, and forced block
//! sizes the pipelined kernel cannot take, run here; see [`super::pipelined`] for the rest.

use cubecl::{
    cmma::MmaDefinition,
    ir::{FastMath, MatrixIdent},
    prelude::*,
};

use super::kernel::ForwardTiles;
use crate::flash::{inverse_sum, log_sum_exp, next_reference, rescale_factor};
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, mma_v_pair, quad_max, quad_sum, slot_of};

/// Shared memory of [`smm_forward_mma16()`]: the padded `X` and `V` tiles.
pub fn shared_bytes(block_1: usize, block_2: usize, tile_3: usize, dtype: StorageType) -> usize {
    let pad = V_PAD as usize;
    (block_2 * (tile_3 + pad) + block_1 * (block_2 + pad)) * dtype.size()
}

/// `out = softmax(x)·v` and `lse` for 16-bit inputs (f16, bf16) on the matrix units, with every
/// operand loaded by `ldmatrix` from shared memory.
///
/// Per step of `block_2` columns the cube stages the `X` tile (`block_1 × block_2`) and the `V`
/// tile (`block_2 × tile_3`) in shared memory with `NV`-wide vector loads (16 B when the layout
/// allows); each plane then loads its 16 rows of `X` as `mma` A fragments (`ldmatrix.x4`), takes
/// the row maxima across the 4 lanes of a row, rescales its accumulators, turns the scores into
/// the `P` fragments in registers, and multiplies them by `V` fragments loaded with
/// `ldmatrix.x4.trans` (two 8-column tiles per load). Rows of both tiles are padded by 8
/// elements (16 B), which makes every `ldmatrix` conflict-free.
// `exp` may lower to the hardware's approximate exponential (`ex2.approx` on CUDA: ~2 ulp, +0
// for −inf, NaN for NaN), the precision FlashAttention uses.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
pub fn smm_forward_mma16<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[define(F)] _dtype: StorageType,
) {
    let nv = NV::value();
    let b2 = comptime!(t.block_2);
    let t3 = comptime!(t.tile_3);
    // Row pitches of the staged tiles, in elements and in vectors.
    let x_ld = comptime!(t.block_2 + V_PAD);
    let v_ld = comptime!(t.tile_3 + V_PAD);
    let x_ldv = comptime!(((t.block_2 + V_PAD) as usize) / nv);
    let v_ldv = comptime!(((t.tile_3 + V_PAD) as usize) / nv);
    let k_steps = comptime!(t.block_2 / 16);
    let n_pairs = comptime!(t.tile_3 / 16);
    let units = comptime!((t.block_1 / MMA_M) * PLANE);

    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let c_vecs = def.vectors_per_lane(MatrixIdent::Accumulator);

    let batch = CUBE_POS_Z as usize;
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let block_row0 = (CUBE_POS_Y * t.block_1) as usize;
    let row0 = block_row0 + (plane * MMA_M) as usize;
    let col0 = (CUBE_POS_X * t3) as usize;
    let d1 = out.shape(1);
    let d2 = x.shape(2);
    let d3 = out.shape(2);
    let x_base = batch * x.stride(0);
    let v_base = batch * v.stride(0);
    let (xs1, xs2) = (x.stride(1), x.stride(2));
    let (vs1, vs2) = (v.stride(1), v.stride(2));

    let mut x_s = SharedMemory::<Vector<F, NV>>::new(comptime!(t.block_1 as usize * x_ldv));
    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(t.block_2 as usize * v_ldv));

    let mut acc = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _ in 0..comptime!(t.tile_3 / MMA_N) {
        let mut frag = Array::<Vector<f32, Const<2>>>::new(c_vecs);
        #[unroll]
        for i in 0..c_vecs {
            frag[i] = Vector::new(0.0f32);
        }
        acc.push(frag);
    }
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        m[r] = f32::min_value();
        l[r] = 0.0f32;
    }
    // This lane's row and column inside an 8×8 matrix of an `ldmatrix.x4`.
    let mat = lane / 8;
    let mat_row = lane % 8;

    let steps = d2.div_ceil(b2 as usize);
    for step in 0..steps {
        let j0 = step * b2 as usize;
        // -- stage X and V (zeros outside the tensors) --
        let x_vecs_row = comptime!(t.block_2 as usize / nv);
        #[unroll]
        for e in 0..comptime!((t.block_1 * t.block_2) as usize / nv / units as usize) {
            let idx = UNIT_POS as usize + e * units as usize;
            let (r, cv) = (idx / x_vecs_row, idx % x_vecs_row);
            let (row, col) = (block_row0 + r, j0 + cv * nv);
            let mut val = Vector::<F, NV>::new(F::from_int(0));
            if row < d1 && col < d2 {
                val = x[(x_base + row * xs1 + col * xs2) / nv];
            }
            x_s[r * x_ldv + cv] = val;
        }
        let v_vecs_row = comptime!(t.tile_3 as usize / nv);
        let v_vecs = comptime!((t.block_2 * t.tile_3) as usize / nv);
        #[unroll]
        for e in 0..comptime!(v_vecs.div_ceil(units as usize)) {
            let idx = UNIT_POS as usize + e * units as usize;
            if idx < v_vecs {
                let (k, cv) = (idx / v_vecs_row, idx % v_vecs_row);
                let (row, col) = (j0 + k, col0 + cv * nv);
                let mut val = Vector::<F, NV>::new(F::from_int(0));
                if row < d2 && col < d3 {
                    val = v[(v_base + row * vs1 + col * vs2) / nv];
                }
                v_s[k * v_ldv + cv] = val;
            }
        }
        sync_cube();

        // -- scores as A fragments, and the step's row maxima --
        let mut step_max = Array::<f32>::new(2usize);
        step_max[0usize] = f32::min_value();
        step_max[1usize] = f32::min_value();
        #[unroll]
        for kc in 0..k_steps {
            let r = plane * MMA_M + (mat % 2) * 8 + mat_row;
            let c = kc * 16 + (mat / 2) * 8;
            let start = (r * x_ld + c) as usize / nv;
            let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
                &x_s.slice(start, start + comptime!(8 / nv)),
                MatrixIdent::A,
                4usize,
                false,
            );
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for n in 0..2usize {
                    let e = i * 2 + n;
                    let (er, ec) = def.position_of_nth(lane, e as u32, MatrixIdent::A);
                    let col = j0 + (kc * 16 + ec) as usize;
                    let mut val = f32::min_value();
                    if col < d2 {
                        val = f32::cast_from(regs[i][n]);
                    }
                    let sl = slot_of(er);
                    step_max[sl] = f32::max(step_max[sl], val);
                }
            }
        }
        let mut alpha = Array::<f32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let m_new = next_reference(m[r], quad_max(step_max[r]), false);
            alpha[r] = rescale_factor(m[r], m_new);
            m[r] = m_new;
            l[r] *= alpha[r];
        }

        // -- rescale the accumulators --
        #[unroll]
        for nt in 0..comptime!(t.tile_3 / MMA_N) {
            let frag = acc.index_mut(nt as usize);
            #[unroll]
            for i in 0..c_vecs {
                let mut vec = frag[i];
                #[unroll]
                for n in 0..2usize {
                    let (r, _c) =
                        def.position_of_nth(lane, (i * 2 + n) as u32, MatrixIdent::Accumulator);
                    vec[n] = vec[n] * alpha[slot_of(r)];
                }
                frag[i] = vec;
            }
        }

        // -- per 16 columns: P = e^(x − m) as an A fragment (scores reloaded from shared
        // memory rather than kept in registers), then acc += P·V, two 8-column tiles of V per
        // `ldmatrix.x4.trans` --
        #[unroll]
        for kc in 0..k_steps {
            let r = plane * MMA_M + (mat % 2) * 8 + mat_row;
            let c = kc * 16 + (mat / 2) * 8;
            let start = (r * x_ld + c) as usize / nv;
            let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
                &x_s.slice(start, start + comptime!(8 / nv)),
                MatrixIdent::A,
                4usize,
                false,
            );
            let mut a = Array::<Vector<F, Const<2>>>::new(4usize);
            #[unroll]
            for i in 0..4usize {
                let mut vec = Vector::<F, Const<2>>::empty();
                #[unroll]
                for n in 0..2usize {
                    let e = i * 2 + n;
                    let (er, ec) = def.position_of_nth(lane, e as u32, MatrixIdent::A);
                    let col = j0 + (kc * 16 + ec) as usize;
                    let sl = slot_of(er);
                    let mut p = 0.0f32;
                    if col < d2 {
                        p = f32::exp(f32::cast_from(regs[i][n]) - m[sl]);
                    }
                    l[sl] += p;
                    vec[n] = F::cast_from(p);
                }
                a[i] = vec;
            }
            #[unroll]
            for np in 0..n_pairs {
                let k = kc * 16 + (mat % 2) * 8 + mat_row;
                let c = np * 16 + (mat / 2) * 8;
                let start = (k * v_ld + c) as usize / nv;
                mma_v_pair::<F, NV>(&a, &v_s, start, &mut acc, np);
            }
        }
        sync_cube();
    }

    // -- normalise and store --
    let mut inv = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let total = quad_sum(l[r]);
        inv[r] = inverse_sum(total);
        let row = row0 + (lane / 4 + r as u32 * 8) as usize;
        if (lane & 3) == 0 && row < d1 && CUBE_POS_X == 0 {
            let at = batch * lse.stride(0) + row * lse.stride(1);
            lse[at] = log_sum_exp(m[r], total);
        }
    }
    let (os1, os2) = (out.stride(1), out.stride(2));
    let o_base = batch * out.stride(0);
    #[unroll]
    for nt in 0..comptime!(t.tile_3 / MMA_N) {
        let frag = acc.index(nt as usize);
        #[unroll]
        for i in 0..c_vecs {
            let vec = frag[i];
            #[unroll]
            for n in 0..2usize {
                let (r, c) =
                    def.position_of_nth(lane, (i * 2 + n) as u32, MatrixIdent::Accumulator);
                let row = row0 + r as usize;
                let col = col0 + (nt * MMA_N + c) as usize;
                if row < d1 && col < d3 {
                    out[o_base + row * os1 + col * os2] = F::cast_from(vec[n] * inv[slot_of(r)]);
                }
            }
        }
    }
}
