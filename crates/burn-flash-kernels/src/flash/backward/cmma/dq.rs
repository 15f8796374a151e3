//! The `dQ` (and `dS`) kernel of the cooperative-matrix backward: one cube per block of query
//! rows, looping over the keys ([`super`]).

use super::*;

/// 4 planes, two cubes per SM. Known spills on CUDA's `wmma` (forced only, bf16): RESULTS §15.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DQ_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(2, 192);

/// [`DQ_OCCUPANCY`] on TF32 operands ([`crate::attention::AttentionOptions::tf32`]): a TF32
/// `A` fragment spans 8 columns where a 16-bit one spans 16, so the plane's `Q` and `dO`
/// fragments take twice the registers; at D 128 NVRTC 13.5 spills up to 868 + 608 B
/// (sm_90a, causal with dropout). Held by `cargo xtask cuda-check`.
pub const DQ_TF32_OCCUPANCY: crate::occupancy::Occupancy =
    crate::occupancy::Occupancy::spilling(2, 1536);

/// `dQ` of one block of `PLANES·m` query rows (module docs), and with `write_ds` the score
/// gradient `dS` of every (row, key) into `ds` (`[B, Hq, Sq, Sk]`; with given scores, `dX`,
/// and no `dQ`). Grid: `(row blocks of G·Sq, y, z)`, `y·z ≥ B·Hkv`; `(plane, PLANES)` units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dq_cmma<F: Float, M: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dq: &mut Tensor<F>,
    ds: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] f: Fragment,
    #[comptime] write_ds: bool,
    #[define(F, M)] _dtypes: [StorageType; 2],
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

    let mut sh = SharedMemory::<M>::new_aligned(len, 32usize);
    let mut ss = SharedMemory::<f32>::new_aligned(comptime!((c.block_q * sl) as usize), 32usize);

    // The block's `Q` and `dO` rows, once, as the planes' `A` fragments.
    if comptime!(!given) {
        stage_group_rows::<F, M, NV>(
            q, &mut sh, &group, r0, 0, head_dim, 0u32, dl, c.block_q, c.head_dim, units,
        );
    }
    stage_group_rows::<F, M, NV>(
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
    let qf = a_fragments::<M>(&sh, plane * f.m as usize * dl as usize, dl, q_width, f);
    let of = a_fragments::<M>(
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
            store_rows::<F, M, NV>(&pre_k, &mut sh, 0u32, dl, STEP, c.head_dim, units);
        }
        store_rows::<F, M, NV>(&pre_v, &mut sh, v_at, vl, STEP, c.value_dim, units);
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
            product_abt::<M>(&qf, &sh, &mut ss, 0, s_at, dl, sl, c.head_dim, STEP, f);
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
        product_abt::<M>(
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
                    sh[pw_at + r * wl as usize + first + e] = M::cast_from(g * w.fac);
                }
            }
        }
        // -- dQ += dR·K --
        if comptime!(!given) {
            sync_plane();
            product_wb::<M>(&acc, &sh, pw_at, 0, wl, dl, c.head_dim, STEP, f);
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
    let f = fragment(client, dtype, c.tf32)
        .expect("a plan picks the cooperative matrices only where they exist");
    let dtypes = [dtype, f.operand(dtype)];
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
                dtypes,
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
                dtypes,
            );
        }
    }
}
