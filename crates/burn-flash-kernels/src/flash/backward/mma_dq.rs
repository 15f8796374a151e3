//! The matrix-unit `dQ` kernel (the `dX` kernel with given scores): the module docs of
//! [`crate::flash::backward::mma`] describe its schedule.

use cubecl::{ir::FastMath, prelude::barrier::Barrier, prelude::*};

use crate::dropout::keep_weight;
use crate::flash::args::{GradInputs, ScoreArgs, ScoreInputs};
use crate::flash::backward::mma::*;
use crate::flash::block::{pair_block, pair_group, rows_keys};
use crate::flash::config::FlashConfig;
use crate::flash::forward::mma::{
    CHUNK, KvRows, NV8, advance_kv, end_step, key_of, start_kv, step_scores,
};
use crate::flash::scores::{
    add_bias, cap_slope, capped, filled, live_score, new_refs, set_row, visible,
};
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, zero_accumulators};
use crate::staging::wait_step;

/// 4 planes, two cubes per SM (8 warps; 3 would need ≤ 168 registers). Known spills (D 64–128):
/// RESULTS §15.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(2, 80);

/// `dQ` of `c.block_q` query rows of the group of one (batch, key/value head) (module docs).
/// `c.block_q` = [`DQ_ROWS`] (or [`WIDE_DX_ROWS`] with given scores), `c.block_k` keys per
/// step, `c.head_dim`, `c.value_dim` = `D`, `Dv` rounded up to 16. Grid: `(row blocks of
/// G·Sq, y, z)`, `y·z ≥ B·Hkv` ([`crate::flash::block::fold_pairs`]); one plane per 16 rows.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
// `x` is assigned in both comptime branches; a comptime `if` stays apart from the runtime one
// inside it (joined, the branch would be expanded for computed scores too).
#[allow(clippy::too_many_arguments, unused_assignments, clippy::collapsible_if)]
pub fn flash_backward_dq_mma<F: Float, NV: Size, ND: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dq: &mut Tensor<F>,
    ds: &mut Tensor<Vector<F, ND>>,
    p_out: &mut Tensor<Vector<F, ND>>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] write_ds: bool,
    #[comptime] ds_vectors: bool,
    #[comptime] write_p: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (d_out, lse, delta) = (&grads.d_out, &grads.lse, &grads.delta);
    // One plane per 16 rows: `c.block_q` is [`DQ_ROWS`] or, for given scores, [`WIDE_DX_ROWS`].
    let rows_per_cube = comptime!(c.block_q);
    let units = comptime!(rows_per_cube / MMA_M * PLANE);
    let given = comptime!(c.given());
    let drop = args.dropout;
    let scale = args.scale;
    let chunks = comptime!(c.block_k / CHUNK);
    let d_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let key_tiles = comptime!(c.block_k / MMA_N);
    let cv = comptime!(FlashConfig {
        head_dim: c.value_dim,
        ..c
    });
    let blk = pair_block(q, k, v, c);
    let group = pair_group(&blk);
    let (seq_q, seq_k, head_dim, value_dim) = (blk.seq_q, blk.seq_k, blk.head_dim, blk.value_dim);
    let rows = blk.rows;
    let (batch, hkv) = (blk.batch, blk.hkv);
    let block_step = comptime!(if crate::mutation::dx_narrow_blocks() {
        DQ_ROWS
    } else {
        rows_per_cube
    });
    let r0 = (CUBE_POS_X * block_step) as usize;
    let keys = rows_keys(
        &blk,
        &inputs.seqs,
        r0,
        rows_per_cube as usize,
        &args,
        comptime!(c.block_k as usize),
        c,
    );
    let kv_end = keys.end;
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let quad = (lane % 4) as usize;
    let g = (lane / 4) as usize;

    // Given scores: no Q and K tiles (the scores come from X, the lane's own, in registers).
    let q_len = comptime!(if given {
        1
    } else {
        rows_per_cube as usize * d_ldv
    });
    let mut q_s = SharedMemory::<Vector<F, NV>>::new(q_len);
    let mut o_s = SharedMemory::<Vector<F, NV>>::new(comptime!(rows_per_cube as usize * v_ldv));
    let k_len = comptime!(if given { 0 } else { c.block_k as usize * d_ldv });
    let v_len = comptime!(c.block_k as usize * v_ldv);
    let mut k_s = SharedMemory::<Vector<F, NV>>::new(comptime!((2 * k_len).max(1)));
    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * v_len));
    if comptime!(!given) {
        stage_query_rows::<F, NV>(
            q,
            &mut q_s,
            &group,
            r0,
            head_dim,
            rows_per_cube,
            c.head_dim,
            units,
        );
    }
    stage_query_rows::<F, NV>(
        d_out,
        &mut o_s,
        &group,
        r0,
        value_dim,
        rows_per_cube,
        c.value_dim,
        units,
    );

    // This lane's rows: g and g + 8 of the plane's 16.
    let mut row_ok = Array::<bool>::new(2usize);
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_delta = Array::<f32>::new(2usize);
    let mut row_at = Array::<usize>::new(2usize);
    let mut ds_at = Array::<usize>::new(2usize);
    // With `write_p` (given scores, `dX` stored as vectors): where each row of `P` starts.
    let mut p_at = Array::<usize>::new(2usize);
    // The (batch, query head) pair of each row: the dropout generator's key.
    let mut row_pair = Array::<usize>::new(2usize);
    let mut refs = new_refs(2usize);
    // Given scores: where each of this lane's rows starts in X, and two steps of its scores
    // ([`crate::flash::forward::mma::load_scores()`]: 8 consecutive keys per chunk).
    let mut x_rows = Array::<usize>::new(2usize);
    let x_len = comptime!(if given { 2 * chunks as usize } else { 1usize });
    let mut xr = Array::<Vector<F, NV>>::new(x_len);
    let mut xn = Array::<Vector<F, NV>>::new(x_len);
    #[unroll]
    for h in 0..2usize {
        let row = r0 + plane as usize * MMA_M as usize + g + 8 * h;
        let head = group.head(row);
        let pos = group.pos(row);
        x_rows[h] = group.offset(q, row);
        row_pair[h] = batch * q.shape(1) + head;
        set_row(&mut refs, h, inputs, &group, row, seq_k, &args, c);
        row_lse[h] = lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
        // A row without a visible key (lse = −inf) has P = 0.
        row_ok[h] = row < rows && row_lse[h] > f32::min_value();
        row_delta[h] = delta[(batch * q.shape(1) + head) * seq_q + pos];
        row_at[h] = batch * dq.stride(0) + head * dq.stride(1) + pos * dq.stride(2);
        ds_at[h] = 0usize;
        if comptime!(write_ds) {
            ds_at[h] = batch * ds.stride(0) + head * ds.stride(1) + pos * ds.stride(2);
        }
        p_at[h] = 0usize;
        if comptime!(write_p) {
            p_at[h] = batch * p_out.stride(0) + head * p_out.stride(1) + pos * p_out.stride(2);
        }
    }
    let mut acc = zero_accumulators(comptime!(c.head_dim / MMA_N));
    let kv = KvRows {
        k_base: batch * k.stride(0) + hkv * k.stride(1),
        v_base: batch * v.stride(0) + hkv * v.stride(1),
        ks: k.stride(2),
        vs: v.stride(2),
        kv_start: keys.start,
        kv_end,
        head_dim,
        v_cols: value_dim,
    };
    let bk = comptime!(c.block_k as usize);
    let steps = (kv_end - usize::min(keys.start, kv_end)).div_ceil(bk);
    // K and V blocks stream through two buffers: step j + 1's copies run while step j computes.
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    // Given scores: V's rows in the operand order of the lanes' consecutive keys
    // ([`crate::flash::forward::mma::key_of()`]), so that `dP`'s fragments line up with the X vectors.
    start_kv::<F, NV>(
        inputs, &mut k_s, &mut v_s, &mut xr, &x_rows, &bar0, steps, &kv, seq_k, c, units,
    );
    // The Q and dO tiles (plain stores) are visible to every plane.
    sync_cube();
    for st in 0..steps {
        let j0 = keys.start + st * bk;
        let parity = st % 2;
        advance_kv::<F, NV>(
            inputs, &mut k_s, &mut v_s, &mut xn, &x_rows, &bar0, &bar1, st, steps, &kv, seq_k, c,
            units,
        );
        let (k_buf, v_buf) = (parity * k_len, parity * v_len);
        let mut s = zero_accumulators(key_tiles);
        let mut dp = zero_accumulators(key_tiles);
        // Given scores: this step's dX values of the lane's runs of 8 keys (two rows).
        let mut dx_run = Array::<f32>::new(comptime!(if write_ds && ds_vectors {
            2 * chunks as usize * NV8
        } else {
            1
        }));
        // With `write_p`: this step's `P` of the same runs, stored beside `dX` for the dK/dV
        // kernel (the P-buffer plan).
        let mut p_run = Array::<f32>::new(comptime!(if write_p {
            2 * chunks as usize * NV8
        } else {
            1
        }));
        if comptime!(!given) {
            step_scores::<F, NV>(&q_s, &k_s, k_buf, &mut s, c);
        }
        step_scores::<F, NV>(&o_s, &v_s, v_buf, &mut dp, cv);
        // dR = scale · P ⊙ (dP − δ) ⊙ softcap', as A fragments of 16 keys.
        let mut a = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for kc in 0..comptime!(c.block_k / 16) {
            let mut frag = Array::<Vector<F, Const<2>>>::new(4usize);
            #[unroll]
            for i in 0..4u32 {
                let j = comptime!(2 * kc + i / 2);
                let h = comptime!((i % 2) as usize);
                let raw = s.index(j as usize)[h];
                let dpv = dp.index(j as usize)[h];
                let mut pair = Vector::<F, Const<2>>::empty();
                #[unroll]
                for n in 0..2u32 {
                    let key = j0 + key_of(j, quad, n, c);
                    let mut x = 0.0f32;
                    let mut fac = scale;
                    let mut ok = row_ok[h];
                    if comptime!(given) {
                        // Element 2·(j % 4) + n of the row's vector of chunk j / 4.
                        let vec = xr[comptime!((h as u32 * chunks + j / 4) as usize)];
                        x = f32::cast_from(vec[comptime!((2 * (j % 4) + n) as usize)]);
                        fac = 1.0f32;
                        ok = ok && key < seq_k;
                    } else {
                        let sc = capped(raw[n as usize], &args, c);
                        x = add_bias::<F>(bias, &refs, h, sc, key, seq_k, c);
                        x = filled::<F>(mask, &refs, h, x, key, seq_k, c);
                        fac = scale * cap_slope(sc, &args, c);
                        ok = ok && visible::<F>(mask, &refs, h, key, seq_q, seq_k, c, true);
                    }
                    let p = select(ok, f32::exp(x - row_lse[h]), 0.0f32);
                    let mut dpz = dpv[n as usize];
                    if comptime!(c.rules.dropout) {
                        // dP̃ = dO·Vᵀ reaches P through the forward's mask: dP ⊙ Z.
                        dpz *= keep_weight(
                            drop.seed_lo,
                            drop.seed_hi,
                            drop.threshold,
                            drop.inv_keep,
                            row_pair[h],
                            refs.pos[h],
                            key,
                            true,
                        );
                    }
                    let mut d_score = p * (dpz - row_delta[h]);
                    if comptime!(c.fills() && !crate::mutation::fill_grad()) {
                        // A masked key's fill score is a constant.
                        if !live_score::<F>(mask, &refs, h, key, seq_k, c) {
                            d_score = 0.0f32;
                        }
                    }
                    pair[n as usize] = F::cast_from(d_score * fac);
                    let mut val = d_score;
                    if comptime!(given && crate::mutation::zero_dx()) {
                        val = 0.0f32;
                    }
                    if comptime!(write_ds && ds_vectors) {
                        // Element 2·(j % 4) + n of the lane's 8 consecutive keys of chunk
                        // j / 4 (the layout `load_scores` read them in), stored below.
                        dx_run[comptime!((h as u32 * chunks + j / 4) * NV8 as u32 + 2 * (j % 4) + n)
                            as usize] = val;
                        if comptime!(write_p) {
                            p_run[comptime!(
                                (h as u32 * chunks + j / 4) * NV8 as u32 + 2 * (j % 4) + n
                            ) as usize] = p;
                        }
                    } else if comptime!(write_ds) {
                        let row = r0 + plane as usize * MMA_M as usize + g + 8 * h;
                        if row < rows && key < seq_k {
                            ds[ds_at[h] + key * ds.stride(3)] = Vector::new(F::cast_from(val));
                        }
                    }
                }
                frag[i as usize] = pair;
            }
            a.push(frag);
        }
        if comptime!(write_ds && ds_vectors) {
            // Each lane's 8 consecutive keys of a chunk as one 16-byte vector (`Sk` is a
            // multiple of 8: a run is wholly inside or outside).
            #[unroll]
            for h in 0..2u32 {
                let row = r0 + plane as usize * MMA_M as usize + g + 8 * h as usize;
                #[unroll]
                for ch in 0..chunks {
                    let key = j0 + (ch * CHUNK) as usize + quad * NV8;
                    if row < rows && key < seq_k {
                        let run = comptime!(((h * chunks + ch) as usize) * NV8);
                        store_run::<F, ND>(ds, (ds_at[h as usize] + key) / NV8, &dx_run, run);
                        if comptime!(write_p) {
                            store_run::<F, ND>(p_out, (p_at[h as usize] + key) / NV8, &p_run, run);
                        }
                    }
                }
            }
        }
        if comptime!(!given) {
            product_trans::<F, NV>(
                &a,
                &k_s,
                k_buf,
                &mut acc,
                d_ldv,
                comptime!(c.block_k / 16),
                comptime!(c.head_dim / 16),
            );
        }
        end_step::<F, NV>(&mut xr, &xn, c, x_len);
    }
    if steps == 0 {
        // The prologue's copies complete before the cube exits.
        wait_step(&bar0, &bar1, 0);
    }
    if comptime!(write_ds && !ds_vectors) {
        // Keys outside the steps (before every row's window, after every row's causal
        // diagonal or window): dS = 0, each row's by its 4 lanes. (Never with vectors: given
        // scores have no key range.)
        let done = keys.start + steps * bk;
        #[unroll]
        for h in 0..2usize {
            let row = r0 + plane as usize * MMA_M as usize + g + 8 * h;
            if row < rows {
                let mut key = quad;
                while key < seq_k {
                    if key < keys.start || key >= done {
                        ds[ds_at[h] + key * ds.stride(3)] = Vector::new(F::cast_from(0.0f32));
                    }
                    key += 4;
                }
            }
        }
    }
    if comptime!(!given) {
        let mut ok = Array::<bool>::new(2usize);
        #[unroll]
        for h in 0..2usize {
            let row = r0 + plane as usize * MMA_M as usize + g + 8 * h;
            ok[h] = row < rows;
        }
        store_tiles::<F>(
            dq,
            &acc,
            &row_at,
            &ok,
            head_dim,
            comptime!(c.head_dim / MMA_N),
            comptime!(crate::mutation::zero_dq()),
        );
    }
}
