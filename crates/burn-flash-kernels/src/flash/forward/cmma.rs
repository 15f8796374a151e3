//! The flash forward on cooperative matrices: cubecl's whole-fragment `cmma` (fill, load,
//! execute, store), which every runtime with matrix units compiles — SPIR-V's
//! `OpCooperativeMatrixMulAddKHR` on Vulkan, Metal's simdgroup matrices, CUDA's `wmma`. The
//! score source is a comptime choice ([`crate::flash::ScoreSource`]).
//!
//! A fragment's elements cannot be addressed per lane there, so everything between the two
//! products goes through shared memory, as cubek-attention's "bounce" tiles do. One cube of
//! `block_q / m` planes per block of `block_q` query rows of one (batch, key/value head) and
//! one tile of `value_dim` output columns, rows running over the group's query heads
//! ([`crate::flash::block`]); plane `p` owns the `m` rows `p·m ..` of the block. Lane `λ` of a plane works on row `λ / L` of the plane's
//! tile (`L = plane / m` lanes per row) and on the columns `nv·(L·g + λ mod L) + e`. Per step of
//! `block_k` keys:
//!
//! 1. the cube writes the step's `K` (computed scores) and `V` blocks, loaded into registers
//!    during the step before, to shared memory, and starts the loads of the next step's (no
//!    asynchronous copies outside CUDA: the registers are the second buffer);
//! 2. the scores: `S = Q·Kᵀ` on the matrix units (the plane's `Q` fragments stay in registers
//!    for the whole loop; `K`'s rows are a column-major `B` operand), stored as f32 into the
//!    plane's score tile; or the given `X` read straight from memory by the lanes;
//! 3. per lane: the finished scores ([`crate::flash::scores`]), the row maximum across the
//!    row's `L` lanes (plane shuffles), the online update with the lazy rescale
//!    ([`crate::flash::online::next_reference()`]) and `P` (dropout applied) into the plane's
//!    `P` tile in the input type;
//! 4. only when a row's reference moved (a plane-uniform test, rare with the lazy rescale):
//!    each output fragment goes through the score tile, is scaled per row and reloaded;
//! 5. `O += P·V` on the matrix units, `P` as the `A` operand from shared memory, `V`'s rows as
//!    a row-major `B` operand.
//!
//! The output fragments leave through the score tile, each row divided by its sum. Causal: the
//! key blocks after every row's diagonal are never loaded.

use cubecl::{
    cmma::{self, Matrix, MatrixIdent, MatrixLayout},
    features::MmaConfig,
    ir::{ElemType, FloatKind},
    prelude::*,
};

use crate::dropout::keep_weight;
use crate::flash::args::{ForwardOutputs, ScoreArgs, ScoreInputs};
use crate::flash::block::{QueryGroup, cube_block, cube_group};
use crate::flash::config::FlashConfig;
use crate::flash::online::{
    inverse_sum, next_reference, output_sum, probability, rescale_factor, row_lse,
};
use crate::flash::scores::{new_refs, score, set_row, visible};

mod layout;

pub use layout::*;

/// Query rows per cube where shared memory allows (attention).
pub const WIDE_BLOCK_Q: u32 = 128;
/// Query rows per cube otherwise.
pub const BLOCK_Q: u32 = 64;
/// Query rows staged at a time to load the planes' `Q` fragments.
pub const Q_PASS: u32 = 64;
/// Keys per step of attention.
pub const BLOCK_K: u32 = 32;
/// Padding of a row of a shared 16-bit tile, in elements (16 bytes): keeps every tile start
/// 32-byte aligned (what `wmma` asks) while staggering rows across banks.
pub const PAD: u32 = 8;
/// Padding of a row of the f32 score tile, in elements (16 bytes).
pub const S_PAD: u32 = 4;

/// Loads rows `first .. first + n_rows` × columns `0 .. width` of `t` (the rows of one
/// (batch, head) from element offset `base`) into this unit's registers `regs`, as vectors of
/// `NV` (the unit's share: vector `UNIT_POS + e·units` of the block in `regs[e]`); zeros at and
/// past row `end` and column `cols`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_rows<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    regs: &mut Array<Vector<F, NV>>,
    base: usize,
    first: usize,
    end: usize,
    cols: usize,
    #[comptime] n_rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let nv = NV::value();
    let vecs = comptime!(width / nv as u32);
    let total = comptime!(n_rows * vecs);
    let zero = Vector::<F, NV>::new(F::from_int(0));
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units)) {
        let idx = UNIT_POS + e * units;
        let (r, cv) = ((idx / vecs) as usize, (idx % vecs) as usize);
        let row = first + r;
        let col = cv * nv;
        let ok = idx < total && row < end && col < cols;
        let src = select(ok, base + row * t.stride(2) + col * t.stride(3), 0);
        regs[e as usize] = select(ok, t[src / nv], zero);
    }
}

/// Writes what [`load_rows()`] loaded into `sh` from `at`, row pitch `ld`, as the operand
/// type `M` (rounded to TF32 where `M` is; the input type itself otherwise).
#[cube]
pub(crate) fn store_rows<F: Float, M: Float, NV: Size>(
    regs: &Array<Vector<F, NV>>,
    sh: &mut SharedMemory<M>,
    #[comptime] at: u32,
    #[comptime] ld: u32,
    #[comptime] n_rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let nv = NV::value();
    let vecs = comptime!(width / nv as u32);
    let total = comptime!(n_rows * vecs);
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units)) {
        let idx = UNIT_POS + e * units;
        if idx < total {
            let dst = (at + (idx / vecs) * ld) as usize + ((idx % vecs) as usize) * nv;
            let vec = regs[e as usize];
            #[unroll]
            for i in 0..nv {
                sh[dst + i] = M::cast_from(vec[i]);
            }
        }
    }
}

/// Stages rows `r0 .. r0 + n_rows` of a query group (`group`; rows at and past `rows` zero) ×
/// columns `col0 .. col0 + width` of `t` (zero at and past `col0 + cols`) into `sh` from `at`,
/// row pitch `ld`, reading vectors of `NV`, as the operand type `M`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_group_rows<F: Float, M: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    sh: &mut SharedMemory<M>,
    group: &QueryGroup,
    r0: usize,
    col0: usize,
    cols: usize,
    #[comptime] at: u32,
    #[comptime] ld: u32,
    #[comptime] n_rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let nv = NV::value();
    let vecs = comptime!(width / nv as u32);
    let total = comptime!(n_rows * vecs);
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units)) {
        let idx = UNIT_POS + e * units;
        if idx < total {
            let (r, cv) = ((idx / vecs) as usize, (idx % vecs) as usize);
            let row = r0 + r;
            let col = cv * nv;
            let ok = row < group.rows && col < cols;
            let src = select(ok, group.offset(t, row) + (col0 + col) * t.stride(3), 0);
            let vec = t[src / nv];
            let dst = (at + (idx / vecs) * ld) as usize + col;
            #[unroll]
            for i in 0..nv {
                sh[dst + i] = select(ok, M::cast_from(vec[i]), M::new(0.0));
            }
        }
    }
}

/// Writes accumulators `acc` (the plane's `m` rows × `width` columns), times `factor`, to `t`:
/// row `r` of the plane at element offset `row_at` when `row_ok`, columns below `cols`
/// (through the bounce tile at `s_at`, pitch `sl`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_accumulators<F: Float>(
    acc: &Sequence<Matrix<f32>>,
    ss: &mut SharedMemory<f32>,
    t: &mut Tensor<F>,
    row_at: usize,
    row_ok: bool,
    cols: usize,
    factor: f32,
    s_at: usize,
    r: usize,
    cl: usize,
    #[comptime] sl: u32,
    #[comptime] width: u32,
    #[comptime] f: Fragment,
) {
    let lanes = comptime!(f.lanes_per_row()) as usize;
    let s_end = s_at + (f.m * sl) as usize;
    #[unroll]
    for tt in 0..comptime!(width / f.n) as usize {
        cmma::store(
            &mut ss.slice_mut(s_at, s_end),
            acc.index(tt),
            sl,
            MatrixLayout::RowMajor,
        );
        sync_plane();
        #[unroll]
        for i in 0..comptime!(f.n / f.lanes_per_row()) as usize {
            let col = i * lanes + cl;
            let gcol = tt * f.n as usize + col;
            if row_ok && gcol < cols {
                t[row_at + gcol * t.stride(3)] =
                    F::cast_from(factor * ss[s_at + r * sl as usize + col]);
            }
        }
        sync_plane();
    }
}

/// `A·Bᵀ` of the plane's `A` fragments `a` (`m` rows × `depth`) and the `cols` rows of a tile
/// at `b_at` (pitch `ld`; its rows are the product's columns), stored as f32 into the plane's
/// bounce tile at `s_at` (pitch `sl`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_abt<F: Float>(
    a: &Sequence<Matrix<F>>,
    sh: &SharedMemory<F>,
    ss: &mut SharedMemory<f32>,
    b_at: usize,
    s_at: usize,
    #[comptime] ld: u32,
    #[comptime] sl: u32,
    #[comptime] depth: u32,
    #[comptime] cols: u32,
    #[comptime] f: Fragment,
) {
    let (tm, tn, tk) = (f.m as usize, f.n as usize, f.k as usize);
    #[unroll]
    for nt in 0..comptime!(cols / f.n) as usize {
        let acc = Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            tm,
            tn,
            tk,
            MatrixLayout::Undefined,
            0.0f32,
        );
        #[unroll]
        for kc in 0..comptime!(depth / f.k) as usize {
            let at = b_at + nt * tn * ld as usize + kc * tk;
            let b = Matrix::<F>::from_slice(
                MatrixIdent::B,
                tm,
                tn,
                tk,
                MatrixLayout::ColMajor,
                &sh.slice(at, at + tn * ld as usize),
                ld,
            );
            cmma::execute::<F, F, f32, f32>(a.index(kc), &b, &acc, &acc);
        }
        cmma::store(
            &mut ss.slice_mut(s_at + nt * tn, s_at + (tm * sl as usize)),
            &acc,
            sl,
            MatrixLayout::RowMajor,
        );
    }
}

/// `acc += W·B`: the plane's weight tile at `w_at` (`m` × `depth`, pitch `wl`) as `A`, the
/// `depth` rows of a tile at `b_at` (pitch `ld`, `width` columns) as `B`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_wb<F: Float>(
    acc: &Sequence<Matrix<f32>>,
    sh: &SharedMemory<F>,
    w_at: usize,
    b_at: usize,
    #[comptime] wl: u32,
    #[comptime] ld: u32,
    #[comptime] width: u32,
    #[comptime] depth: u32,
    #[comptime] f: Fragment,
) {
    let (tm, tn, tk) = (f.m as usize, f.n as usize, f.k as usize);
    #[unroll]
    for kc in 0..comptime!(depth / f.k) as usize {
        let a_at = w_at + kc * tk;
        let a = Matrix::<F>::from_slice(
            MatrixIdent::A,
            tm,
            tn,
            tk,
            MatrixLayout::RowMajor,
            &sh.slice(a_at, a_at + tm * wl as usize),
            wl,
        );
        #[unroll]
        for t in 0..comptime!(width / f.n) as usize {
            let at = b_at + kc * tk * ld as usize + t * tn;
            let b = Matrix::<F>::from_slice(
                MatrixIdent::B,
                tm,
                tn,
                tk,
                MatrixLayout::RowMajor,
                &sh.slice(at, at + tk * ld as usize),
                ld,
            );
            cmma::execute::<F, F, f32, f32>(&a, &b, acc.index(t), acc.index(t));
        }
    }
}

/// The maximum (`max`) or the sum of `x` over the `lanes` lanes of a row (adjacent lanes).
#[cube]
pub(crate) fn row_reduce(x: f32, #[comptime] lanes: u32, #[comptime] max: bool) -> f32 {
    let mut r = x;
    #[unroll]
    for b in 0..comptime!(lanes.trailing_zeros()) {
        let other = plane_shuffle_xor(r, comptime!(1u32 << b));
        if comptime!(max) {
            r = f32::max(r, other);
        } else {
            r += other;
        }
    }
    r
}

/// Eight 16-row planes of fragments (256 threads): one cube per SM. Known spills: D 256 on
/// CUDA's `wmma` (the path runs on CUDA only when forced; RESULTS §15).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(1, 640);

/// `out`, `lse` as [`super::mma::flash_forward_mma()`] (same tensors for each score source), on
/// the cooperative matrices of fragment `f` (module docs). `q`, `k`, `v` are read as vectors of
/// `NV` elements (`NV` dividing their rows and strides, unit stride along the rows); `mask`,
/// `bias` and `out` an element at a time. `c.head_dim` is `D` rounded up to `f.k`,
/// `c.value_dim` the output tile, a multiple of `f.n` ([`fits`]).
/// Grid: `(column tiles of Dv, row blocks of G·Sq, B·Hkv)`, `(plane, block_q / m)` units.
/// `M` is the products' operand type ([`Fragment::operand`]): `F` itself, or TF32 for f32.
#[cube(launch_unchecked)]
pub fn flash_forward_cmma<F: Float, M: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    outputs: &mut ForwardOutputs<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] f: Fragment,
    #[define(F, M)] _dtypes: [StorageType; 2],
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (out, lse) = (&mut outputs.out, &mut outputs.lse);
    let drop = args.dropout;
    let given = comptime!(c.given());
    let nv = NV::value();
    let (tm, tn, tk) = (f.m as usize, f.n as usize, f.k as usize);
    let lanes = comptime!(f.lanes_per_row());
    let units = comptime!(f.units(c.block_q));
    let lay = comptime!(layout(c));
    let (k_at, v_at, p_at) = (lay.k_at, lay.v_at, lay.p_at);
    let (dl, vl, pl, sl) = comptime!((d_ld(c), v_ld(c), p_ld(c), s_ld(c)));
    let bk = c.block_k as usize;
    // Vectors of a lane's columns per step, and per output fragment.
    let groups = comptime!(c.block_k / (lanes * nv as u32)) as usize;
    let frag_cols = comptime!(f.n / lanes) as usize;
    let q_frags = comptime!(c.head_dim / f.k) as usize;
    let o_frags = comptime!(c.value_dim / f.n) as usize;

    let blk = cube_block(q, k, &inputs.seqs, &args, c);
    let group = cube_group(&blk);
    let (seq_q, seq_k, rows) = (blk.seq_q, blk.seq_k, blk.rows);
    let (batch, hkv) = (blk.batch, blk.hkv);
    let head_dim = q.shape(3);
    // The tile's columns of `V` and of the output that exist.
    let col0 = blk.col0;
    let v_cols = out.shape(3) - col0;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = lane / lanes as usize;
    let cl = lane % lanes as usize;
    let prow = plane * tm;
    let row = blk.row0 + prow + r;
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1) + col0 * v.stride(3);
    let steps = blk.steps(c);
    // This plane's tiles.
    let s_at = prow * sl as usize;
    let s_end = s_at + tm * sl as usize;
    let pp_at = p_at as usize + prow * pl as usize;

    let mut refs = new_refs(1usize);
    set_row(&mut refs, 0, inputs, &group, row, seq_k, &args, c);
    let pair = batch * q.shape(1) + group.head(row);
    let x_row = group.offset(q, row);

    // 32-byte aligned: every fragment's tile starts on a 32-byte boundary (`wmma`'s rule).
    let mut sh = SharedMemory::<M>::new_aligned(comptime!(lay.len as usize), 32usize);
    let mut ss = SharedMemory::<f32>::new_aligned(comptime!(lay.s_len as usize), 32usize);

    // The plane's `Q` fragments, staged through shared memory [`Q_PASS`] rows at a time (the
    // planes of a pass load theirs).
    let mut qf = Sequence::<Matrix<M>>::new();
    if comptime!(!given) {
        #[unroll]
        for _kc in 0..q_frags {
            // SAFETY (cubecl's): loaded below, before any use.
            qf.push(unsafe {
                Matrix::<M>::uninitialized(MatrixIdent::A, tm, tn, tk, MatrixLayout::RowMajor)
            });
        }
        let pass_rows = comptime!(c.block_q.min(Q_PASS));
        #[unroll]
        for pass in 0..comptime!(c.block_q / pass_rows) {
            let r0 = blk.row0 + (pass * pass_rows) as usize;
            // Rows of a block can span heads: each staged row finds its own offset.
            stage_group_rows::<F, M, NV>(
                q, &mut sh, &group, r0, 0, head_dim, 0u32, dl, pass_rows, c.head_dim, units,
            );
            sync_cube();
            if prow / pass_rows as usize == pass as usize {
                let first = (prow % pass_rows as usize) * dl as usize;
                #[unroll]
                for kc in 0..q_frags {
                    let at = first + kc * tk;
                    cmma::load(qf.index(kc), &sh.slice(at, at + tm * dl as usize), dl);
                }
            }
            sync_cube();
        }
    }

    let mut o = Sequence::<Matrix<f32>>::new();
    #[unroll]
    for _t in 0..o_frags {
        o.push(Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            tm,
            tn,
            tk,
            MatrixLayout::Undefined,
            0.0f32,
        ));
    }
    let mut m = f32::min_value();
    let mut l = 0.0f32;

    // The next step's K and V blocks, in flight in registers while a step computes.
    let k_regs = comptime!(if given {
        1
    } else {
        (c.block_k * c.head_dim / nv as u32).div_ceil(units)
    });
    let v_regs = comptime!((c.block_k * c.value_dim / nv as u32).div_ceil(units));
    let mut pre_k = Array::<Vector<F, NV>>::new(k_regs as usize);
    let mut pre_v = Array::<Vector<F, NV>>::new(v_regs as usize);
    if comptime!(!given) {
        load_rows::<F, NV>(
            k,
            &mut pre_k,
            k_base,
            blk.kv_start,
            blk.kv_end,
            head_dim,
            c.block_k,
            c.head_dim,
            units,
        );
    }
    load_rows::<F, NV>(
        v,
        &mut pre_v,
        v_base,
        blk.kv_start,
        blk.kv_end,
        v_cols,
        c.block_k,
        c.value_dim,
        units,
    );

    for st in 0..steps {
        let j0 = blk.step_key(st, c);
        let full = blk.full_step(st, c);
        // -- 1. the step's K and V blocks into shared memory, the next step's into registers --
        if comptime!(!given) {
            store_rows::<F, M, NV>(&pre_k, &mut sh, k_at, dl, c.block_k, c.head_dim, units);
        }
        store_rows::<F, M, NV>(&pre_v, &mut sh, v_at, vl, c.block_k, c.value_dim, units);
        sync_cube();
        if st + 1 < steps {
            if comptime!(!given) {
                load_rows::<F, NV>(
                    k,
                    &mut pre_k,
                    k_base,
                    j0 + bk,
                    blk.kv_end,
                    head_dim,
                    c.block_k,
                    c.head_dim,
                    units,
                );
            }
            load_rows::<F, NV>(
                v,
                &mut pre_v,
                v_base,
                j0 + bk,
                blk.kv_end,
                v_cols,
                c.block_k,
                c.value_dim,
                units,
            );
        }

        // -- 2. the scores --
        if comptime!(!given) {
            product_abt::<M>(
                &qf,
                &sh,
                &mut ss,
                k_at as usize,
                s_at,
                dl,
                sl,
                c.head_dim,
                c.block_k,
                f,
            );
            sync_plane();
        }

        // -- 3. finished scores, the online update, P --
        let mut sv = Array::<f32>::new(comptime!(groups * nv));
        let mut vis = Array::<bool>::new(comptime!(groups * nv));
        let mut pmax = f32::min_value();
        #[unroll]
        for g in 0..groups {
            let first = (g * lanes as usize + cl) * nv;
            if comptime!(given) {
                let key = j0 + first;
                let vec = q[select(key < seq_k, x_row + key * q.stride(3), 0) / nv];
                #[unroll]
                for e in 0..nv {
                    sv[g * nv + e] = f32::cast_from(vec[e]);
                }
            } else {
                #[unroll]
                for e in 0..nv {
                    let raw = ss[s_at + r * sl as usize + first + e];
                    sv[g * nv + e] =
                        score::<F>(mask, bias, &refs, 0, raw, j0 + first + e, seq_k, &args, c);
                }
            }
            #[unroll]
            for e in 0..nv {
                let key = j0 + first + e;
                let ok = visible::<F>(mask, &refs, 0, key, seq_q, seq_k, c, false)
                    && (full || visible::<F>(mask, &refs, 0, key, seq_q, seq_k, c, true));
                vis[g * nv + e] = ok;
                pmax = select(ok, f32::max(pmax, sv[g * nv + e]), pmax);
            }
        }
        let rmax = row_reduce(pmax, lanes, true);
        let m_new = next_reference(m, rmax, true);
        let alpha = rescale_factor(m, m_new);
        let moved = plane_any(m_new != m);
        m = m_new;
        let mut psum = 0.0f32;
        #[unroll]
        for g in 0..groups {
            let first = (g * lanes as usize + cl) * nv;
            #[unroll]
            for e in 0..nv {
                let at = g * nv + e;
                let p = probability(sv[at], m, vis[at]);
                // The row sum takes every weight; `P·V` the kept ones, scaled.
                let mut kept = p;
                if comptime!(c.rules.dropout) {
                    kept *= keep_weight(
                        drop.seed_lo,
                        drop.seed_hi,
                        drop.threshold,
                        drop.inv_keep,
                        pair,
                        refs.pos[0],
                        j0 + first + e,
                        false,
                    );
                }
                sh[pp_at + r * pl as usize + first + e] = M::cast_from(kept);
                psum += p;
            }
        }
        l = alpha * l + row_reduce(psum, lanes, false);

        // -- 4. rescale the output fragments where a row's reference moved --
        if moved && comptime!(!crate::mutation::keep_fragments()) {
            #[unroll]
            for t in 0..o_frags {
                cmma::store(
                    &mut ss.slice_mut(s_at, s_end),
                    o.index(t),
                    sl,
                    MatrixLayout::RowMajor,
                );
                sync_plane();
                #[unroll]
                for i in 0..frag_cols {
                    let at = s_at + r * sl as usize + i * lanes as usize + cl;
                    ss[at] *= alpha;
                }
                sync_plane();
                cmma::load_with_layout(
                    o.index(t),
                    &ss.slice(s_at, s_end),
                    sl,
                    MatrixLayout::RowMajor,
                );
                sync_plane();
            }
        }
        sync_plane();

        // -- 5. O += P·V --
        product_wb::<M>(
            &o,
            &sh,
            pp_at,
            v_at as usize,
            pl,
            vl,
            c.value_dim,
            c.block_k,
            f,
        );
        // Every plane is done with K, V and P before the next step stages over them.
        sync_cube();
    }

    // -- normalise and store --
    if row < rows && cl == 0 && blk.first_tile {
        let at = batch * lse.stride(0)
            + group.head(row) * lse.stride(1)
            + group.pos(row) * lse.stride(2);
        lse[at] = row_lse(m, l, refs.sink[0], c);
    }
    let inv = inverse_sum(output_sum(m, l, refs.sink[0], c));
    let o_at = group.offset(out, row) + col0 * out.stride(3);
    store_accumulators::<F>(
        &o,
        &mut ss,
        out,
        o_at,
        row < rows,
        v_cols,
        inv,
        s_at,
        r,
        cl,
        sl,
        c.value_dim,
        f,
    );
}
