//! The matrix-unit `dK`/`dV` kernel: the module docs of [`crate::flash::backward::mma`]
//! describe its schedule.

use cubecl::{
    cmma::MmaDefinition,
    ir::{FastMath, MatrixIdent},
    prelude::barrier::Barrier,
    prelude::*,
};

use crate::dropout::keep_weight;
use crate::flash::args::{GradInputs, ScoreArgs, ScoreInputs};
use crate::flash::backward::mma::*;
use crate::flash::block::{PairBlock, pair_block, pair_group, span_positions};
use crate::flash::config::FlashConfig;
use crate::flash::forward::mma::{NV8, step_scores};
use crate::flash::keys::{row_range, sees};
use crate::flash::scores::{alibi_term, cap_slope, capped};
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, zero_accumulators};
use crate::staging::{commit_next, wait_step};

/// 4 planes, two cubes per SM (8 warps). Known spills (D 80): RESULTS §15.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(2, 48);

/// `dK`, `dV` of [`DKV_KEYS`] keys of one (batch, key/value head) (module docs), summed over
/// every query row of the group. `c.block_q` = [`DKV_KEYS`], `c.block_k` query rows per step,
/// `c.head_dim`, `c.value_dim` = `D`, `Dv` rounded up to 16. Grid: `(key blocks, y, z)`,
/// `y·z ≥ B·Hkv`; [`PLANES`] planes.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
// `is_multiple_of` has no cube expansion, and a comptime `if` stays apart from the runtime
// one inside it (joined, the branch would be expanded without a causal mask too).
#[allow(
    clippy::too_many_arguments,
    clippy::collapsible_if,
    clippy::manual_is_multiple_of
)]
pub fn flash_backward_dkv_mma<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] p_given: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (d_out, lse, delta) = (&grads.d_out, &grads.lse, &grads.delta);
    let units = comptime!(PLANES * PLANE);
    let given = comptime!(c.given());
    let d_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let x_ldv = comptime!((step_width(c) + V_PAD) as usize / NV8);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let bq = comptime!(c.block_k as usize);
    let row_len = comptime!(if c.reads_row_terms() { 4 * bq } else { 1usize });
    let mut row_s = SharedMemory::<u32>::new(row_len);
    let q_tiles = comptime!(c.block_k / MMA_N);
    let cv = comptime!(FlashConfig {
        head_dim: c.value_dim,
        ..c
    });
    let blk = pair_block(q, k, v, c);
    let group = pair_group(&blk);
    let (seq_q, seq_k, head_dim, value_dim) = (blk.seq_q, blk.seq_k, blk.head_dim, blk.value_dim);
    let rows = blk.rows;
    let (batch, hkv) = (blk.batch, blk.hkv);
    // Given scores: `Dv` in column tiles of `c.value_dim`, the cube's tile `CUBE_POS_X % tiles`
    // of its key block; computed scores hold all of `Dv`.
    let mut col_tiles = 1usize;
    if comptime!(given) {
        col_tiles = value_dim.div_ceil(comptime!(c.value_dim as usize));
    }
    let key0 = (CUBE_POS_X as usize / col_tiles) * DKV_KEYS as usize;
    let c0 = (CUBE_POS_X as usize % col_tiles) * comptime!(c.value_dim as usize);
    // What stands in `Q`'s buffers: `Q`'s head dims, or the `X` block's keys.
    let mut x_col0 = 0usize;
    let mut x_cols = head_dim;
    if comptime!(given) {
        x_col0 = key0;
        x_cols = seq_k;
    }
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let quad = (lane % 4) as usize;
    let g = (lane / 4) as usize;

    let kv_len = comptime!(if given { 1usize } else { DKV_KEYS as usize });
    let mut k_s = SharedMemory::<Vector<F, NV>>::new(comptime!(kv_len * d_ldv));
    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(kv_len * v_ldv));
    let q_len = comptime!(bq * x_ldv);
    let o_len = comptime!(bq * v_ldv);
    // Q (or X), dO and the rows' (lse, δ) stream through two buffers.
    let mut q_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * q_len));
    let mut o_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * o_len));
    let mut stat_s = SharedMemory::<f32>::new(comptime!(4 * bq));
    if comptime!(!given) {
        let k_base = batch * k.stride(0) + hkv * k.stride(1);
        let v_base = batch * v.stride(0) + hkv * v.stride(1);
        stage_key_rows::<F, NV>(
            k, &mut k_s, k_base, key0, seq_k, head_dim, DKV_KEYS, c.head_dim, units,
        );
        stage_key_rows::<F, NV>(
            v,
            &mut v_s,
            v_base,
            key0,
            seq_k,
            value_dim,
            DKV_KEYS,
            c.value_dim,
            units,
        );
    }

    // This lane's keys: g and g + 8 of the plane's 16.
    let mut key = Array::<usize>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        key[h] = key0 + plane as usize * MMA_M as usize + g + 8 * h;
    }
    let mut acc_dk = zero_accumulators(comptime!(c.head_dim / MMA_N));
    let mut acc_dv = zero_accumulators(comptime!(c.value_dim / MMA_N));
    let key_last = usize::min(key0 + DKV_KEYS as usize, seq_k) - 1;
    // Given scores: this lane's `ldmatrix.x4.trans` row of the X block (stored [row][key]):
    // matrix `mat` covers step rows 8·(mat / 2).. and keys 16·plane + 8·(mat % 2)...
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let mat = (lane / 8) as usize;
    let mat_row = (lane % 8) as usize;
    let x_lane =
        ((mat / 2) * 8 + mat_row) * x_ldv + (plane as usize * MMA_M as usize + 8 * (mat % 2)) / NV8;
    // The query blocks to visit. Causal, windowed or packed, with whole blocks per head (`Sq` a
    // multiple of the step, or one query head per key/value head): only the blocks holding a
    // position that sees one of the cube's keys ([`row_range()`]), `first .. first +
    // live_per_head` of each head's; otherwise every block (one outside every row's range
    // computes nothing).
    let seen_by = row_range(&inputs.seqs, key0, key_last, seq_q, seq_k, &args, c);
    let blocks = rows.div_ceil(bq);
    let mut per_head = blocks;
    let mut first = 0usize;
    let mut live_per_head = blocks;
    if comptime!(c.ranged()) {
        if seq_q % bq == 0 || blk.group == 1 {
            per_head = seq_q.div_ceil(bq);
            first = usize::min(seen_by.start / bq, per_head);
            live_per_head = usize::max(seen_by.end.div_ceil(bq), first) - first;
        }
    }
    // After a head's last live block, the next head's first live one.
    let skip = per_head - live_per_head;
    let n_live = (blocks / per_head) * live_per_head;
    if n_live > 0 {
        let r0 = first * bq;
        stage_query_block::<F, NV>(
            q,
            d_out,
            lse,
            delta,
            &mut q_s,
            &mut o_s,
            &mut stat_s,
            &mut row_s,
            0,
            &group,
            r0,
            x_col0,
            x_cols,
            c0,
            value_dim,
            c,
            units,
        );
    }
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    bar0.commit_copy_async();
    let _token = bar0.arrive();
    // The K and V tiles and the first block's (lse, δ) (plain stores) are visible to all.
    sync_cube();
    // Step `i`'s block `qb` and its rank among its head's live blocks, advanced without a
    // division: after a head's last live block come `skip` dead ones.
    let mut qb = first;
    let mut rank = 0usize;
    for i in 0..n_live {
        let parity = i % 2;
        let wraps = rank + 1 == live_per_head;
        let nb = qb + 1 + select(wraps, skip, 0);
        if i + 1 < n_live {
            stage_query_block::<F, NV>(
                q,
                d_out,
                lse,
                delta,
                &mut q_s,
                &mut o_s,
                &mut stat_s,
                &mut row_s,
                1 - parity,
                &group,
                nb * bq,
                x_col0,
                x_cols,
                c0,
                value_dim,
                c,
                units,
            );
            commit_next(&bar0, &bar1, i);
        }
        wait_step(&bar0, &bar1, i);
        let r0 = qb * bq;
        let last = usize::min(r0 + bq, rows) - 1;
        // Causal: the block's largest position must see the cube's first key.
        let mut live = true;
        if comptime!(c.ranged()) {
            let span = span_positions(r0, last, seq_q);
            live = span.start < seen_by.end && span.end >= seen_by.start;
        }
        let (q_buf, o_buf, sb) = (parity * q_len, parity * o_len, parity * 2 * bq);
        if comptime!(given) {
            // Pᵀ = e^(Xᵀ − lse) as A fragments: `ldmatrix.x4.trans` of the X block (rows of
            // the step, the cube's keys), then `dV += Pᵀ·dO`.
            let mut pa = Sequence::<Array<Vector<F, Const<2>>>>::new();
            #[unroll]
            for kc in 0..comptime!(c.block_k / 16) {
                let start = q_buf + x_lane + comptime!((kc * 16) as usize * x_ldv);
                let xa = def.load_matrix::<Vector<F, NV>, Const<2>>(
                    &q_s.slice(start, start + 1),
                    MatrixIdent::A,
                    4usize,
                    true,
                );
                // Register i: key g + 8·(i % 2), step row 16·kc + 8·(i / 2) + 2·quad + n.
                let mut pfrag = Array::<Vector<F, Const<2>>>::new(4usize);
                #[unroll]
                for i in 0..4u32 {
                    let xs = xa[i as usize];
                    if comptime!(p_given) {
                        // The staged block is `P` itself (written by the dX kernel): its
                        // fragments are `Pᵀ`'s. A key past the end only reaches its own dV
                        // row, which is never stored; a row past the end was zero-filled.
                        pfrag[i as usize] = xs;
                    } else {
                        let mut pp = Vector::<F, Const<2>>::empty();
                        #[unroll]
                        for n in 0..2u32 {
                            let col = comptime!((16 * kc + 8 * (i / 2) + n) as usize) + quad * 2;
                            let ok = key[comptime!((i % 2) as usize)] <= key_last;
                            let x = f32::cast_from(xs[n as usize]);
                            pp[n as usize] =
                                F::cast_from(select(ok, f32::exp(x - stat_s[sb + col]), 0.0f32));
                        }
                        pfrag[i as usize] = pp;
                    }
                }
                pa.push(pfrag);
            }
            product_trans::<F, NV>(
                &pa,
                &o_s,
                o_buf,
                &mut acc_dv,
                v_ldv,
                comptime!(c.block_k / 16),
                comptime!(c.value_dim / 16),
            );
        } else if live {
            let mut s = zero_accumulators(q_tiles);
            let mut dp = zero_accumulators(q_tiles);
            step_scores::<F, NV>(&k_s, &q_s, q_buf, &mut s, c);
            step_scores::<F, NV>(&v_s, &o_s, o_buf, &mut dp, cv);
            let mut pa = Sequence::<Array<Vector<F, Const<2>>>>::new();
            let mut da = Sequence::<Array<Vector<F, Const<2>>>>::new();
            #[unroll]
            for kc in 0..comptime!(c.block_k / 16) {
                let mut pfrag = Array::<Vector<F, Const<2>>>::new(4usize);
                let mut dfrag = Array::<Vector<F, Const<2>>>::new(4usize);
                #[unroll]
                for i in 0..4u32 {
                    let j = comptime!(2 * kc + i / 2);
                    let h = comptime!((i % 2) as usize);
                    let raw = s.index(j as usize)[h];
                    let dpv = dp.index(j as usize)[h];
                    let mut pp = Vector::<F, Const<2>>::empty();
                    let mut dd = Vector::<F, Const<2>>::empty();
                    #[unroll]
                    for n in 0..2usize {
                        let col = comptime!((j * MMA_N) as usize) + quad * 2 + n;
                        let w = key_weight::<F, NV>(
                            inputs, &blk, &args, raw[n], key[h], key_last, r0, col, sb, &stat_s,
                            &row_s, c,
                        );
                        pp[n] = F::cast_from(w.p * w.z);
                        dd[n] = F::cast_from(w.p * (dpv[n] * w.z - stat_s[sb + bq + col]) * w.fac);
                    }
                    pfrag[i as usize] = pp;
                    dfrag[i as usize] = dd;
                }
                pa.push(pfrag);
                da.push(dfrag);
            }
            product_trans::<F, NV>(
                &pa,
                &o_s,
                o_buf,
                &mut acc_dv,
                v_ldv,
                comptime!(c.block_k / 16),
                comptime!(c.value_dim / 16),
            );
            product_trans::<F, NV>(
                &da,
                &q_s,
                q_buf,
                &mut acc_dk,
                d_ldv,
                comptime!(c.block_k / 16),
                comptime!(c.head_dim / 16),
            );
        }
        // Every plane is done with this buffer before block + 2's copies overwrite it.
        sync_cube();
        qb = nb;
        rank = select(wraps, 0, rank + 1);
    }
    if n_live == 0 {
        // The prologue's (empty) copies complete before the cube exits.
        wait_step(&bar0, &bar1, 0);
    }
    let mut ok = Array::<bool>::new(2usize);
    let mut at_k = Array::<usize>::new(2usize);
    let mut at_v = Array::<usize>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        ok[h] = key[h] < seq_k;
        at_k[h] = batch * dk.stride(0) + hkv * dk.stride(1) + key[h] * dk.stride(2);
        at_v[h] =
            batch * dv.stride(0) + hkv * dv.stride(1) + key[h] * dv.stride(2) + c0 * dv.stride(3);
    }
    if comptime!(!given) {
        store_tiles::<F>(
            dk,
            &acc_dk,
            &at_k,
            &ok,
            head_dim,
            comptime!(c.head_dim / MMA_N),
            false,
        );
    }
    store_tiles::<F>(
        dv,
        &acc_dv,
        &at_v,
        &ok,
        value_dim - c0,
        comptime!(c.value_dim / MMA_N),
        false,
    );
}

/// One transposed weight of the dK/dV kernel: `p` the forward's `P` (0 for an invisible key
/// or a row past the end), `z` its dropout factor (1 without dropout), `fac` the factor of
/// `dS` to `dR` (the scale, the softcap's derivative, and 0 where a masked key took the fill
/// score, a constant without gradient): `dV += p·z·dO` and `dR = p·(dP·z − δ)·fac`.
#[derive(CubeType)]
struct KeyWeight {
    p: f32,
    z: f32,
    fac: f32,
}

/// The [`KeyWeight`] of key `key` and the staged row `col` of buffer `sb` (block rows `r0..`)
/// from its raw score `raw` (`Q·Kᵀ`): the forward's score rules with the row's head and position
/// staged in `row_s`, its lse in `stat_s`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_weight<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    blk: &PairBlock,
    args: &ScoreArgs,
    raw: f32,
    key: usize,
    key_last: usize,
    r0: usize,
    col: usize,
    sb: usize,
    stat_s: &SharedMemory<f32>,
    row_s: &SharedMemory<u32>,
    #[comptime] c: FlashConfig,
) -> KeyWeight {
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (seq_q, seq_k, batch) = (blk.seq_q, blk.seq_k, blk.batch);
    let scale = args.scale;
    let bq = comptime!(c.block_k as usize);
    let sc = capped(raw, args, c);
    let mut x = sc;
    let mut fac = scale * cap_slope(sc, args, c);
    let mut ok = key <= key_last;
    // 0 where a masked key took the fill score (a constant: no dS).
    let mut gate = 1.0f32;
    if comptime!(c.rules.mask || c.rules.bias || c.rules.alibi || c.rules.window || c.rules.varlen)
    {
        // The row's head and position, staged with its lse and δ.
        let head = row_s[sb + col] as usize;
        let pos = row_s[sb + bq + col] as usize;
        let kk = usize::min(key, seq_k - 1);
        ok = ok && sees(&inputs.seqs, pos, key, seq_q, seq_k, args, c);
        x += alibi_term(
            &inputs.slopes,
            &inputs.seqs,
            head,
            pos,
            key,
            seq_q,
            seq_k,
            c,
        );
        if comptime!(c.rules.mask) {
            let at = batch * mask.stride(0)
                + head * mask.stride(1)
                + pos * mask.stride(2)
                + kk * mask.stride(3);
            let hit = f32::cast_from(mask[at]) != 0.0f32;
            if comptime!(c.fills()) {
                gate = select(hit, 0.0f32, 1.0f32);
            } else {
                ok = ok && !hit;
            }
        }
        if comptime!(c.rules.bias) {
            let at = batch * bias.stride(0)
                + head * bias.stride(1)
                + pos * bias.stride(2)
                + kk * bias.stride(3);
            x += f32::cast_from(bias[at]);
        }
        if comptime!(c.fills()) {
            x = select(gate == 0.0f32, f32::new(comptime!(c.fill_score())), x);
        }
    }
    if comptime!(
        c.rules.causal
            && !(c.rules.mask || c.rules.bias || c.rules.alibi || c.rules.window || c.rules.varlen)
    ) {
        let pos = usize::min(r0 + col, blk.rows - 1) % seq_q;
        ok = ok && sees(&inputs.seqs, pos, key, seq_q, seq_k, args, c);
    }
    let p = select(ok, f32::exp(x - stat_s[sb + col]), 0.0f32);
    let mut z = 1.0f32;
    if comptime!(c.rules.dropout) {
        // The forward's mask of this weight: its row's (head, position).
        let drop = args.dropout;
        let head = row_s[sb + col] as usize;
        let pos = row_s[sb + bq + col] as usize;
        z = keep_weight(
            drop.seed_lo,
            drop.seed_hi,
            drop.threshold,
            drop.inv_keep,
            batch * inputs.q.shape(1) + head,
            pos,
            key,
            true,
        );
    }
    if comptime!(c.fills() && !crate::mutation::fill_grad()) {
        fac *= gate;
    }
    KeyWeight { p, z, fac }
}
