//! The `dK`/`dV` kernel of the cooperative-matrix backward: one cube per block of keys, looping
//! over the query rows of the group ([`super`]).

use super::*;

/// 4 planes, two cubes per SM. Known spills on CUDA's `wmma` (forced only): f16 D 128
/// with score rules, bf16 on sm_80 (RESULTS §15).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DKV_OCCUPANCY: crate::occupancy::Occupancy =
    crate::occupancy::Occupancy::spilling(2, 12_288);

/// [`DKV_OCCUPANCY`] on TF32 operands ([`crate::attention::AttentionOptions::tf32`]): the
/// plane's `K` and `V` fragments take twice the registers of 16-bit ones (8 columns a
/// fragment); at D 128 NVRTC 13.5 spills up to 11 048 + 11 468 B (sm_80, causal varlen).
/// Held by `cargo xtask cuda-check`.
pub const DKV_TF32_OCCUPANCY: crate::occupancy::Occupancy =
    crate::occupancy::Occupancy::spilling(2, 24_576);

/// `dK` and `dV` of one block of `PLANES·m` keys (module docs); given scores: `dV` alone.
/// `c` is the dQ kernel's configuration. Grid: `(key blocks, y, z)`, `y·z ≥ B·Hkv`;
/// `(plane, PLANES)` units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dkv_cmma<F: Float, M: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] f: Fragment,
    #[define(F, M)] _dtypes: [StorageType; 2],
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

    let mut sh = SharedMemory::<M>::new_aligned(len, 32usize);
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
        store_rows::<F, M, NV>(&pre_k, &mut sh, 0u32, dl, keys_n, c.head_dim, units);
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
        store_rows::<F, M, NV>(
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
    let kf = a_fragments::<M>(&sh, plane * f.m as usize * dl as usize, dl, k_width, f);
    let vf = a_fragments::<M>(
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
                stage_group_rows::<F, M, NV>(
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
                stage_group_rows::<F, M, NV>(
                    q, &mut sh, &group, r0, 0, head_dim, 0u32, dl, STEP, c.head_dim, units,
                );
            }
            stage_group_rows::<F, M, NV>(
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
                product_abt::<M>(&kf, &sh, &mut ss, 0, s_at, dl, sl, c.head_dim, STEP, f);
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
                product_abt::<M>(&vf, &sh, &mut ss, o_at, s_at, vl, sl, c.value_dim, STEP, f);
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
                sh[pw_at + r * wl as usize + i * lanes as usize + cl] = M::cast_from(w.p * w.z);
            }
            sync_plane();
            product_wb::<M>(&acc_dv, &sh, pw_at, o_at, wl, vl, c.value_dim, STEP, f);
            if comptime!(!given) {
                sync_plane();
                #[unroll]
                for i in 0..cols_l {
                    sh[pw_at + r * wl as usize + i * lanes as usize + cl] = M::cast_from(g[i]);
                }
                sync_plane();
                product_wb::<M>(&acc_dk, &sh, pw_at, 0, wl, dl, c.head_dim, STEP, f);
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
