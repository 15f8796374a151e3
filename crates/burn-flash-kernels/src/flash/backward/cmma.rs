//! The flash backward on cooperative matrices (cubecl's whole-fragment `cmma`: Vulkan through
//! SPIR-V, Metal, CUDA's `wmma`), for both score sources: the math of
//! [`crate::flash::backward`], the products on the matrix units, everything between them
//! through shared memory (a fragment's elements cannot be addressed per lane), as in the
//! forward ([`crate::flash::forward::cmma`]).
//!
//! Two kernels, each owning its output, [`PLANES`] planes of `m`-row fragments per cube:
//! - [`flash_backward_dkv_cmma()`]: one cube per block of `PLANES·m` keys of one (batch,
//!   key/value head); plane `p` owns keys `p·m ..` of it and keeps their `K` and `V` rows as
//!   `A` fragments. It loops over the query rows of the head's group in steps of [`STEP`]
//!   (rows above a causal diagonal skipped), computes the transposed scores `Sᵀ = K·Qᵀ` and
//!   `dPᵀ = V·dOᵀ`, and accumulates `dV += (P ⊙ Z)ᵀ·dO` and `dK += dRᵀ·Q` (given scores:
//!   `Sᵀ` read from `X`, no `dK` and so no `dPᵀ`);
//! - [`flash_backward_dq_cmma()`]: one cube per block of `PLANES·m` query rows; plane `p` owns
//!   rows `p·m ..` and keeps their `Q` and `dO` rows as `A` fragments; it loops over the keys
//!   the rows see in steps of [`STEP`], computes `S = Q·Kᵀ` and `dP = dO·Vᵀ`, writes `dS`
//!   where asked (a tracked bias; given scores: `dX`) and accumulates `dQ += dR·K`.
//!
//! Lane `λ` of a plane works on row `λ / L` of the plane's tiles (`L` lanes per row) and on
//! the columns `L·g + λ mod L`. The streamed operands of a step are loaded into registers
//! during the step before ([`crate::flash::forward::cmma`]'s scheme).

use cubecl::{
    cmma::{Matrix, MatrixIdent, MatrixLayout},
    prelude::*,
};

use crate::dropout::keep_weight;
use crate::flash::args::{BackwardLaunch, GradInputs, Scalars, ScoreArgs, ScoreInputs};
use crate::flash::block::{cube_count, pair_block, pair_group, rows_keys, span_positions};
use crate::flash::config::FlashConfig;
use crate::flash::forward::cmma::{
    Fragment, PAD, S_PAD, fragment, load_rows, product_abt, product_wb, stage_group_rows,
    store_accumulators, store_rows,
};
use crate::flash::keys::row_range;
use crate::flash::scores::{
    RowRefs, add_bias, capped, filled, live_score, new_refs, set_row, visible,
};

/// Planes per cube of either kernel.
pub const PLANES: u32 = 4;
/// Query rows per step of the dK/dV kernel, keys per step of the dQ kernel.
pub const STEP: u32 = 32;
/// The widest `D` and `Dv` (their accumulators and `A` fragments stay in registers).
pub const MAX_DIM: u32 = 128;

/// The dQ kernel's configuration tile on fragment `f`: `PLANES·m` rows per cube, [`STEP`] keys
/// per step, `D`, `Dv` rounded up to the fragment.
pub fn tile(head_dim: usize, value_dim: usize, f: Fragment) -> crate::flash::Tile {
    crate::flash::Tile {
        block_q: PLANES * f.m,
        row_tiles: 1,
        block_k: STEP,
        head_dim: head_dim.next_multiple_of(f.k.max(f.n) as usize) as u32,
        value_dim: value_dim.next_multiple_of(f.k.max(f.n) as usize) as u32,
    }
}

/// Keys per cube of the dK/dV kernel on fragment `f`.
pub fn block_keys(f: Fragment) -> u32 {
    PLANES * f.m
}

/// Shared memory of the dQ kernel for `c` (16-bit operands), in bytes: the `Q` and `dO` tiles
/// staged once, then a step's `K` and `V` blocks and the planes' `dR` tiles; the f32 bounce
/// tiles.
pub fn dq_shared_bytes(c: FlashConfig) -> usize {
    (dq_shared_len(c) * 2 + c.block_q * (STEP + S_PAD) * 4) as usize
}

/// [`dq_shared_bytes`]' 16-bit elements.
fn dq_shared_len(c: FlashConfig) -> u32 {
    let (dl, vl, wl) = (c.head_dim + PAD, c.value_dim + PAD, STEP + PAD);
    (c.block_q * (dl + vl)).max(STEP * (dl + vl) + c.block_q * wl)
}

/// Shared memory of the dK/dV kernel for `c` (the dQ kernel's config) on fragment `f`, in bytes:
/// the `K` and `V` tiles staged once (given scores: neither), then a step's `Q` (given scores:
/// `X`) and `dO` rows and the planes' weight tiles; the f32 bounce tiles.
pub fn dkv_shared_bytes(c: FlashConfig, f: Fragment) -> usize {
    (dkv_shared_len(c, f) * 2 + block_keys(f) * (STEP + S_PAD) * 4) as usize
}

/// [`dkv_shared_bytes`]' 16-bit elements.
fn dkv_shared_len(c: FlashConfig, f: Fragment) -> u32 {
    let keys = block_keys(f);
    let (dl, vl, wl) = (c.head_dim + PAD, c.value_dim + PAD, STEP + PAD);
    let (first, rows_l) = if c.given() {
        (0, keys + PAD)
    } else {
        (keys * (dl + vl), dl)
    };
    first.max(STEP * (rows_l + vl) + keys * wl)
}

/// Whether the device of `client` runs the cooperative-matrix backward for `c` on `f`: the
/// kernels take `c` ([`fits`]) and the device has their units and shared memory.
pub fn runs<R: Runtime>(client: &ComputeClient<R>, c: FlashConfig, f: Fragment) -> bool {
    let hw = &client.properties().hardware;
    fits(c, f)
        && hw.max_units_per_cube >= PLANES * f.plane
        && hw.max_shared_memory_size >= dq_shared_bytes(c).max(dkv_shared_bytes(c, f))
}

/// Whether the cooperative-matrix backward takes `c` on `f`: head dims up to [`MAX_DIM`] in
/// whole fragments, [`STEP`] a whole number of fragments and of lanes per row.
pub fn fits(c: FlashConfig, f: Fragment) -> bool {
    let lanes = f.lanes_per_row();
    c.block_q == PLANES * f.m
        && c.block_k == STEP
        && STEP.is_multiple_of(f.n.max(f.k))
        && STEP.is_multiple_of(lanes)
        && f.n.is_multiple_of(lanes)
        && c.head_dim.max(c.value_dim) <= MAX_DIM
        && c.head_dim.is_multiple_of(f.k.max(f.n))
        && c.value_dim.is_multiple_of(f.k.max(f.n))
        && c.value_dim > 0
}

/// The plane's `A` fragments of its `m` rows from a tile at `at` (pitch `ld`): `width / k` of
/// them, along the columns.
#[cube]
fn a_fragments<F: Float>(
    sh: &SharedMemory<F>,
    at: usize,
    #[comptime] ld: u32,
    #[comptime] width: u32,
    #[comptime] f: Fragment,
) -> Sequence<Matrix<F>> {
    let mut frags = Sequence::<Matrix<F>>::new();
    #[unroll]
    for kc in 0..comptime!(width / f.k) as usize {
        let a_at = at + kc * f.k as usize;
        frags.push(Matrix::<F>::from_slice(
            MatrixIdent::A,
            f.m as usize,
            f.n as usize,
            f.k as usize,
            MatrixLayout::RowMajor,
            &sh.slice(a_at, a_at + (f.m * ld) as usize),
            ld,
        ));
    }
    frags
}

/// `count` zeroed accumulators.
#[cube]
fn accumulators(#[comptime] count: u32, #[comptime] f: Fragment) -> Sequence<Matrix<f32>> {
    let mut acc = Sequence::<Matrix<f32>>::new();
    #[unroll]
    for _t in 0..count {
        acc.push(Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            f.m as usize,
            f.n as usize,
            f.k as usize,
            MatrixLayout::Undefined,
            0.0f32,
        ));
    }
    acc
}

/// What the backward takes of one score ([`crate::flash::backward`]'s math): `P` (0 where the
/// key is invisible or the row has none), the dropout factor `Z` (the forward's mask drawn
/// again; 1 without), the softcap's derivative `1 − (s_c/c)²` and whether `dS` flows (0 where a
/// masked key took the fill score).
#[derive(CubeType)]
struct Weight {
    p: f32,
    z: f32,
    fac: f32,
    gate: f32,
}

/// The [`Weight`] of key `key` in the row of `refs`' `slot` (a row that exists where `row_ok`,
/// with log-sum-exp `lse` and dropout pair `pair`), from its raw product `raw` (given scores:
/// the score itself).
#[cube]
#[allow(clippy::too_many_arguments)]
fn weight<F: Float>(
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    raw: f32,
    key: usize,
    row_ok: bool,
    lse: f32,
    pair: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> Weight {
    let mut fac = 1.0f32;
    let mut s = raw;
    if comptime!(!c.given()) {
        let sc = capped(raw, args.scale, args.softcap, c);
        if comptime!(c.rules.softcap) {
            let t = sc / args.softcap;
            fac = 1.0f32 - t * t;
        }
        s = add_bias::<F>(bias, refs, slot, sc, key, seq_k, c);
        s = filled::<F>(mask, refs, slot, s, key, seq_k, c);
    }
    let live = row_ok
        && visible::<F>(mask, refs, slot, key, seq_q, seq_k, c, true)
        && lse > f32::min_value();
    let mut w = Weight {
        p: select(live, f32::exp(s - lse), 0.0f32),
        z: 1.0f32,
        fac,
        gate: 1.0f32,
    };
    if comptime!(c.rules.dropout) {
        let drop = args.dropout;
        w.z = keep_weight(
            drop.seed_lo,
            drop.seed_hi,
            drop.threshold,
            drop.inv_keep,
            pair,
            refs.pos[slot],
            key,
            true,
        );
    }
    if comptime!(c.fills() && !crate::mutation::fill_grad()) {
        w.gate = select(
            live_score::<F>(mask, refs, slot, key, seq_k, c),
            1.0f32,
            0.0f32,
        );
    }
    w
}

/// 4 planes, two cubes per SM. Known spills on CUDA's `wmma` (forced only): f16 D 128
/// with score rules, bf16 on sm_80 (RESULTS §15).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DKV_OCCUPANCY: crate::occupancy::Occupancy =
    crate::occupancy::Occupancy::spilling(2, 12_288);

/// `dK` and `dV` of one block of `PLANES·m` keys (module docs); given scores: `dV` alone.
/// `c` is the dQ kernel's configuration. Grid: `(key blocks, y, z)`, `y·z ≥ B·Hkv`;
/// `(plane, PLANES)` units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dkv_cmma<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] f: Fragment,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, d_out) = (&inputs.q, &inputs.k, &inputs.v, &grads.d_out);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (lse, delta) = (&grads.lse, &grads.delta);
    let given = comptime!(c.given());
    let units = comptime!(PLANES * f.plane);
    let keys_n = comptime!(block_keys(f));
    let lanes = comptime!(f.lanes_per_row());
    let cols_l = comptime!(STEP / lanes) as usize;
    let (dl, vl, wl, sl) = comptime!((
        c.head_dim + PAD,
        c.value_dim + PAD,
        STEP + PAD,
        STEP + S_PAD
    ));
    // Step tiles: `Q` (given scores: the `X` block, rows × keys) at 0, `dO` after it, the
    // planes' weight tiles after that. Before the loop: `K` at 0, `V` after it.
    let xl = comptime!(keys_n + PAD);
    let o_at = comptime!(STEP * if given { xl } else { dl }) as usize;
    let w_at = comptime!(STEP * if given { xl } else { dl } + STEP * vl) as usize;
    let v_at = comptime!(keys_n * dl) as usize;
    let len = comptime!(dkv_shared_len(c, f) as usize);

    let blk = pair_block(q, k, v, c);
    let group = pair_group(&blk);
    let (seq_q, seq_k, rows) = (blk.seq_q, blk.seq_k, blk.rows);
    let (batch, hkv) = (blk.batch, blk.hkv);
    let (head_dim, value_dim) = (blk.head_dim, blk.value_dim);
    let heads_q = q.shape(1);
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = lane / lanes as usize;
    let cl = lane % lanes as usize;
    let j0 = CUBE_POS_X as usize * keys_n as usize;
    let key = j0 + plane * f.m as usize + r;
    let s_at = plane * f.m as usize * sl as usize;
    let pw_at = w_at + plane * f.m as usize * wl as usize;

    let mut sh = SharedMemory::<F>::new_aligned(len, 32usize);
    let mut ss = SharedMemory::<f32>::new_aligned(comptime!((keys_n * sl) as usize), 32usize);

    // The block's `K` and `V` rows, once, as the planes' `A` fragments (given scores: neither,
    // `dPᵀ` is only needed for `dK`).
    let nv = NV::value();
    if comptime!(!given) {
        let k_regs = comptime!((keys_n * c.head_dim / nv as u32).div_ceil(units));
        let v_regs = comptime!((keys_n * c.value_dim / nv as u32).div_ceil(units));
        let mut pre_k = Array::<Vector<F, NV>>::new(k_regs as usize);
        let mut pre_v = Array::<Vector<F, NV>>::new(v_regs as usize);
        let k_base = batch * k.stride(0) + hkv * k.stride(1);
        let v_base = batch * v.stride(0) + hkv * v.stride(1);
        load_rows::<F, NV>(
            k, &mut pre_k, k_base, j0, seq_k, head_dim, keys_n, c.head_dim, units,
        );
        store_rows::<F, NV>(&pre_k, &mut sh, 0u32, dl, keys_n, c.head_dim, units);
        load_rows::<F, NV>(
            v,
            &mut pre_v,
            v_base,
            j0,
            seq_k,
            value_dim,
            keys_n,
            c.value_dim,
            units,
        );
        store_rows::<F, NV>(
            &pre_v,
            &mut sh,
            comptime!(keys_n * dl),
            vl,
            keys_n,
            c.value_dim,
            units,
        );
        sync_cube();
    }
    let (k_width, v_width) = comptime!(if given {
        (0, 0)
    } else {
        (c.head_dim, c.value_dim)
    });
    let kf = a_fragments::<F>(&sh, plane * f.m as usize * dl as usize, dl, k_width, f);
    let vf = a_fragments::<F>(
        &sh,
        v_at + plane * f.m as usize * vl as usize,
        vl,
        v_width,
        f,
    );
    sync_cube();

    let acc_dk = accumulators(comptime!(if given { 0 } else { c.head_dim / f.n }), f);
    let acc_dv = accumulators(comptime!(c.value_dim / f.n), f);

    let blocks = rows.div_ceil(STEP as usize);
    // The positions that see one of the block's keys (causal, window, packed sequences).
    let key_last = usize::min(j0 + keys_n as usize, seq_k) - 1;
    let seen_by = row_range(&inputs.seqs, j0, key_last, seq_q, seq_k, &args, c);
    for qb in 0..blocks {
        let r0 = qb * STEP as usize;
        let last = usize::min(r0 + STEP as usize, rows) - 1;
        let mut live_block = true;
        if comptime!(c.ranged()) {
            let span = span_positions(r0, last, seq_q);
            live_block = span.start < seen_by.end && span.end >= seen_by.start;
        }
        if live_block {
            // -- the step's rows: `Q` (given: the `X` block) and `dO` --
            if comptime!(given) {
                stage_group_rows::<F, NV>(
                    q,
                    &mut sh,
                    &group,
                    r0,
                    j0,
                    seq_k - j0,
                    0u32,
                    xl,
                    STEP,
                    keys_n,
                    units,
                );
            } else {
                stage_group_rows::<F, NV>(
                    q, &mut sh, &group, r0, 0, head_dim, 0u32, dl, STEP, c.head_dim, units,
                );
            }
            stage_group_rows::<F, NV>(
                d_out,
                &mut sh,
                &group,
                r0,
                0,
                value_dim,
                comptime!(o_at as u32),
                vl,
                STEP,
                c.value_dim,
                units,
            );
            // The lane's rows (its columns): references, lse, δ, the dropout key.
            let mut refs = new_refs(cols_l);
            let mut row_ok = Array::<bool>::new(cols_l);
            let mut row_lse = Array::<f32>::new(cols_l);
            let mut row_delta = Array::<f32>::new(cols_l);
            let mut row_pair = Array::<usize>::new(cols_l);
            #[unroll]
            for i in 0..cols_l {
                let row = r0 + i * lanes as usize + cl;
                set_row(&mut refs, i, inputs, &group, row, seq_k, &args, c);
                let (head, pos) = (group.head(row), group.pos(row));
                row_ok[i] = row < rows;
                row_lse[i] =
                    lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
                if comptime!(!given) {
                    row_delta[i] = delta[(batch * heads_q + head) * seq_q + pos];
                }
                row_pair[i] = batch * heads_q + head;
            }
            sync_cube();

            // -- Sᵀ = K·Qᵀ (given: `X` transposed) --
            let mut raw = Array::<f32>::new(cols_l);
            if comptime!(given) {
                #[unroll]
                for i in 0..cols_l {
                    let col = i * lanes as usize + cl;
                    raw[i] = f32::cast_from(sh[col * xl as usize + plane * f.m as usize + r]);
                }
            } else {
                product_abt::<F>(&kf, &sh, &mut ss, 0, s_at, dl, sl, c.head_dim, STEP, f);
                sync_plane();
                #[unroll]
                for i in 0..cols_l {
                    raw[i] = ss[s_at + r * sl as usize + i * lanes as usize + cl];
                }
                sync_plane();
            }
            // -- dPᵀ = V·dOᵀ (for dK) --
            let mut dp = Array::<f32>::new(cols_l);
            if comptime!(!given) {
                product_abt::<F>(&vf, &sh, &mut ss, o_at, s_at, vl, sl, c.value_dim, STEP, f);
                sync_plane();
                #[unroll]
                for i in 0..cols_l {
                    dp[i] = ss[s_at + r * sl as usize + i * lanes as usize + cl];
                }
            }

            // -- the weights: (P ⊙ Z)ᵀ for dV, then dRᵀ for dK --
            let mut g = Array::<f32>::new(cols_l);
            #[unroll]
            for i in 0..cols_l {
                let w = weight::<F>(
                    mask,
                    bias,
                    &refs,
                    i,
                    raw[i],
                    key,
                    row_ok[i],
                    row_lse[i],
                    row_pair[i],
                    seq_q,
                    seq_k,
                    &args,
                    c,
                );
                if comptime!(!given) {
                    g[i] = w.p * (dp[i] * w.z - row_delta[i]) * w.gate * w.fac;
                }
                sh[pw_at + r * wl as usize + i * lanes as usize + cl] = F::cast_from(w.p * w.z);
            }
            sync_plane();
            product_wb::<F>(&acc_dv, &sh, pw_at, o_at, wl, vl, c.value_dim, STEP, f);
            if comptime!(!given) {
                sync_plane();
                #[unroll]
                for i in 0..cols_l {
                    sh[pw_at + r * wl as usize + i * lanes as usize + cl] = F::cast_from(g[i]);
                }
                sync_plane();
                product_wb::<F>(&acc_dk, &sh, pw_at, 0, wl, dl, c.head_dim, STEP, f);
            }
            // Every plane is done with the step's tiles before the next step stages over them.
            sync_cube();
        }
    }

    let key_ok = key < seq_k;
    let kk = usize::min(key, seq_k - 1);
    if comptime!(!given) {
        let mut scale = args.scale;
        if comptime!(crate::mutation::zero_dk()) {
            scale = 0.0f32;
        }
        let dk_at = batch * dk.stride(0) + hkv * dk.stride(1) + kk * dk.stride(2);
        store_accumulators::<F>(
            &acc_dk, &mut ss, dk, dk_at, key_ok, head_dim, scale, s_at, r, cl, sl, c.head_dim, f,
        );
    }
    let dv_at = batch * dv.stride(0) + hkv * dv.stride(1) + kk * dv.stride(2);
    store_accumulators::<F>(
        &acc_dv,
        &mut ss,
        dv,
        dv_at,
        key_ok,
        value_dim,
        1.0f32,
        s_at,
        r,
        cl,
        sl,
        c.value_dim,
        f,
    );
}

/// 4 planes, two cubes per SM. Known spills on CUDA's `wmma` (forced only, bf16): RESULTS §15.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DQ_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(2, 192);

/// `dQ` of one block of `PLANES·m` query rows (module docs), and with `write_ds` the score
/// gradient `dS` of every (row, key) into `ds` (`[B, Hq, Sq, Sk]`; with given scores, `dX`,
/// and no `dQ`). Grid: `(row blocks of G·Sq, y, z)`, `y·z ≥ B·Hkv`; `(plane, PLANES)` units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dq_cmma<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dq: &mut Tensor<F>,
    ds: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] f: Fragment,
    #[comptime] write_ds: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, d_out) = (&inputs.q, &inputs.k, &inputs.v, &grads.d_out);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (lse, delta) = (&grads.lse, &grads.delta);
    let given = comptime!(c.given());
    let nv = NV::value();
    let units = comptime!(PLANES * f.plane);
    let lanes = comptime!(f.lanes_per_row());
    let groups = comptime!(STEP / (lanes * nv as u32)) as usize;
    let n_l = comptime!(STEP / lanes) as usize;
    let (dl, vl, wl, sl) = comptime!((
        c.head_dim + PAD,
        c.value_dim + PAD,
        STEP + PAD,
        STEP + S_PAD
    ));
    // Before the loop: `Q` at 0, `dO` after it. Step tiles: `K` at 0, `V`, the planes' `dR`.
    let o_at = comptime!(c.block_q * dl) as usize;
    let v_at = comptime!(STEP * dl);
    let w_at = comptime!(STEP * (dl + vl)) as usize;
    let len = comptime!(dq_shared_len(c) as usize);
    let bk = STEP as usize;

    let blk = pair_block(q, k, v, c);
    let group = pair_group(&blk);
    let (seq_q, seq_k, rows) = (blk.seq_q, blk.seq_k, blk.rows);
    let (batch, hkv) = (blk.batch, blk.hkv);
    let (head_dim, value_dim) = (blk.head_dim, blk.value_dim);
    let heads_q = q.shape(1);
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = lane / lanes as usize;
    let cl = lane % lanes as usize;
    let r0 = CUBE_POS_X as usize * c.block_q as usize;
    let row = r0 + plane * f.m as usize + r;
    let key_span = rows_keys(
        &blk,
        &inputs.seqs,
        r0,
        c.block_q as usize,
        &args,
        STEP as usize,
        c,
    );
    let key0 = usize::min(key_span.start, key_span.end);
    let kv_end = key_span.end;
    let s_at = plane * f.m as usize * sl as usize;
    let pw_at = w_at + plane * f.m as usize * wl as usize;

    let mut refs = new_refs(1usize);
    set_row(&mut refs, 0, inputs, &group, row, seq_k, &args, c);
    let row_ok = row < rows;
    let (head, pos) = (group.head(row), group.pos(row));
    let row_lse = lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
    let row_delta = delta[(batch * heads_q + head) * seq_q + pos];
    let pair = batch * heads_q + head;
    let x_row = group.offset(q, row);
    let mut ds_row = 0usize;
    if comptime!(write_ds) {
        ds_row = group.offset(ds, row);
    }

    let mut sh = SharedMemory::<F>::new_aligned(len, 32usize);
    let mut ss = SharedMemory::<f32>::new_aligned(comptime!((c.block_q * sl) as usize), 32usize);

    // The block's `Q` and `dO` rows, once, as the planes' `A` fragments.
    if comptime!(!given) {
        stage_group_rows::<F, NV>(
            q, &mut sh, &group, r0, 0, head_dim, 0u32, dl, c.block_q, c.head_dim, units,
        );
    }
    stage_group_rows::<F, NV>(
        d_out,
        &mut sh,
        &group,
        r0,
        0,
        value_dim,
        comptime!(c.block_q * dl),
        vl,
        c.block_q,
        c.value_dim,
        units,
    );
    sync_cube();
    let q_width = comptime!(if given { 0 } else { c.head_dim });
    let qf = a_fragments::<F>(&sh, plane * f.m as usize * dl as usize, dl, q_width, f);
    let of = a_fragments::<F>(
        &sh,
        o_at + plane * f.m as usize * vl as usize,
        vl,
        c.value_dim,
        f,
    );
    sync_cube();

    let acc = accumulators(comptime!(if given { 0 } else { c.head_dim / f.n }), f);
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1);
    let k_regs = comptime!(if given {
        1
    } else {
        (STEP * c.head_dim / nv as u32).div_ceil(units)
    });
    let v_regs = comptime!((STEP * c.value_dim / nv as u32).div_ceil(units));
    let mut pre_k = Array::<Vector<F, NV>>::new(k_regs as usize);
    let mut pre_v = Array::<Vector<F, NV>>::new(v_regs as usize);
    if comptime!(!given) {
        load_rows::<F, NV>(
            k, &mut pre_k, k_base, key0, kv_end, head_dim, STEP, c.head_dim, units,
        );
    }
    load_rows::<F, NV>(
        v,
        &mut pre_v,
        v_base,
        key0,
        kv_end,
        value_dim,
        STEP,
        c.value_dim,
        units,
    );

    let steps = (kv_end - key0).div_ceil(bk);
    for st in 0..steps {
        let j0 = key0 + st * bk;
        if comptime!(!given) {
            store_rows::<F, NV>(&pre_k, &mut sh, 0u32, dl, STEP, c.head_dim, units);
        }
        store_rows::<F, NV>(&pre_v, &mut sh, v_at, vl, STEP, c.value_dim, units);
        sync_cube();
        if st + 1 < steps {
            if comptime!(!given) {
                load_rows::<F, NV>(
                    k,
                    &mut pre_k,
                    k_base,
                    j0 + bk,
                    kv_end,
                    head_dim,
                    STEP,
                    c.head_dim,
                    units,
                );
            }
            load_rows::<F, NV>(
                v,
                &mut pre_v,
                v_base,
                j0 + bk,
                kv_end,
                value_dim,
                STEP,
                c.value_dim,
                units,
            );
        }

        // -- S = Q·Kᵀ (given: `X`) --
        let mut raw = Array::<f32>::new(n_l);
        if comptime!(given) {
            #[unroll]
            for gi in 0..groups {
                let first = (gi * lanes as usize + cl) * nv;
                let key = j0 + first;
                let vec = q[select(key < seq_k, x_row + key * q.stride(3), 0) / nv];
                #[unroll]
                for e in 0..nv {
                    raw[gi * nv + e] = f32::cast_from(vec[e]);
                }
            }
        } else {
            product_abt::<F>(&qf, &sh, &mut ss, 0, s_at, dl, sl, c.head_dim, STEP, f);
            sync_plane();
            #[unroll]
            for gi in 0..groups {
                let first = (gi * lanes as usize + cl) * nv;
                #[unroll]
                for e in 0..nv {
                    raw[gi * nv + e] = ss[s_at + r * sl as usize + first + e];
                }
            }
            sync_plane();
        }
        // -- dP = dO·Vᵀ --
        product_abt::<F>(
            &of,
            &sh,
            &mut ss,
            v_at as usize,
            s_at,
            vl,
            sl,
            c.value_dim,
            STEP,
            f,
        );
        sync_plane();
        // -- dS (written where asked), dR into the plane's tile --
        #[unroll]
        for gi in 0..groups {
            let first = (gi * lanes as usize + cl) * nv;
            #[unroll]
            for e in 0..nv {
                let at = gi * nv + e;
                let key = j0 + first + e;
                let dp = ss[s_at + r * sl as usize + first + e];
                let w = weight::<F>(
                    mask, bias, &refs, 0, raw[at], key, row_ok, row_lse, pair, seq_q, seq_k, &args,
                    c,
                );
                let g = w.p * (dp * w.z - row_delta) * w.gate;
                if comptime!(write_ds) {
                    if row_ok && key < seq_k {
                        let mut val = g;
                        if comptime!(given && crate::mutation::zero_dx()) {
                            val = 0.0f32;
                        }
                        ds[ds_row + key * ds.stride(3)] = F::cast_from(val);
                    }
                }
                if comptime!(!given) {
                    sh[pw_at + r * wl as usize + first + e] = F::cast_from(g * w.fac);
                }
            }
        }
        // -- dQ += dR·K --
        if comptime!(!given) {
            sync_plane();
            product_wb::<F>(&acc, &sh, pw_at, 0, wl, dl, c.head_dim, STEP, f);
        }
        // Every plane is done with the step's tiles before the next step stages over them.
        sync_cube();
    }
    // Keys outside every row's range (before the window, past the causal diagonal or the
    // window): dS = 0 there.
    if comptime!(write_ds) {
        if row_ok {
            let done = key0 + steps * bk;
            let mut key = cl;
            while key < seq_k {
                if key < key0 || key >= done {
                    ds[ds_row + key * ds.stride(3)] = F::cast_from(0.0f32);
                }
                key += lanes as usize;
            }
        }
    }
    if comptime!(!given) {
        let mut scale = args.scale;
        if comptime!(crate::mutation::zero_dq()) {
            scale = 0.0f32;
        }
        let dq_at = group.offset(dq, row);
        store_accumulators::<F>(
            &acc, &mut ss, dq, dq_at, row_ok, head_dim, scale, s_at, r, cl, sl, c.head_dim, f,
        );
    }
}

/// Runs [`flash_backward_dkv_cmma()`] and [`flash_backward_dq_cmma()`] on the launch's grids,
/// reading `q`, `k`, `v` and `dO` as vectors of `vector` elements.
///
/// # Safety
/// The operands' shapes and strides describe their buffers; `vector` divides the rows and
/// strides of `q` (given: `X`), `k`, `v` and `d_out` and `STEP / lanes`; the device offers a
/// fragment for `dtype` ([`fragment`]) on which `c` fits ([`fits`]); the grids are the kernels'.
pub unsafe fn launch<R: Runtime>(
    l: &BackwardLaunch<'_, R>,
    scalars: Scalars,
    c: FlashConfig,
    write_ds: bool,
    vector: usize,
) {
    let (client, t, delta, dtype) = (l.client, l.t, l.delta, l.dtype);
    let f = fragment(client, dtype)
        .expect("a plan picks the cooperative matrices only where they exist");
    let dim = cubecl::CubeDim::new_2d(f.plane, PLANES);
    // SAFETY: the caller's (above).
    unsafe {
        if let Some(cubes) = l.dkv_cubes {
            flash_backward_dkv_cmma::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                dim,
                vector,
                t.score_inputs(&t.q),
                t.grad_inputs(delta),
                t.dk.arg(),
                t.dv.arg(),
                scalars.arg(),
                c,
                f,
                dtype,
            );
        }
        if let Some(cubes) = l.dq_cubes {
            flash_backward_dq_cmma::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                dim,
                vector,
                t.score_inputs(&t.q),
                t.grad_inputs(delta),
                t.dq.arg(),
                t.ds.arg(),
                scalars.arg(),
                c,
                f,
                write_ds,
                dtype,
            );
        }
    }
}
