//! The matrix-unit `dK`/`dV` kernel with each key tile's work split between two planes
//! (computed scores; the schedule of [`super::mma_dkv`] otherwise).
//!
//! A cube owns `keys` keys ([`SPLIT_KEYS`]: 64 or 128): tiles of 16, each served by a **score
//! plane** (the first `keys / 16` planes) and a **gradient plane** (the rest). Per block of
//! query rows:
//!
//! 1. the score plane computes `Sᵀ = K·Qᵀ` and the weights ([`super::mma_dkv::key_weight()`]):
//!    it keeps `P·Z` and writes `P·fac` to shared memory (negated where dropout dropped the
//!    weight); the gradient plane computes `dPᵀ = V·dOᵀ`;
//! 2. one barrier; the next block's copies start (into the buffers of the block before, which
//!    every plane is done with);
//! 3. the score plane adds `dV += (P·Z)ᵀ·dO`; the gradient plane reads its tile's `P·fac`, makes
//!    `dRᵀ = P·fac·(dP·Z − δ)` and adds `dK += dRᵀ·Q`.
//!
//! Each plane holds one accumulator set (`dV` or `dK` of its 16 keys) and one step's score
//! fragments: the registers of [`super::mma_dkv::flash_backward_dkv_mma()`]'s plane, which holds
//! both, halved, so that twice the planes fit a multiprocessor. The `P·fac` exchange is
//! double-buffered by step parity, so one barrier per block orders it and the copies.

use cubecl::{ir::FastMath, prelude::barrier::Barrier, prelude::*};

use crate::flash::args::{GradInputs, ScoreArgs, ScoreInputs};
use crate::flash::backward::mma::*;
use crate::flash::backward::mma_dkv::key_weight;
use crate::flash::block::{pair_block, pair_group};
use crate::flash::config::FlashConfig;
use crate::flash::forward::mma::{NV8, step_scores_of};
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, zero_accumulators};
use crate::staging::{commit_next, wait_step};

/// The keys per cube [`flash_backward_dkv_split()`] is built for.
pub const SPLIT_KEYS: [u32; 2] = [64, 128];

/// Planes per cube of [`flash_backward_dkv_split()`] with `keys` keys: a score plane and a
/// gradient plane per key tile of 16.
pub const fn split_planes(keys: u32) -> u32 {
    2 * keys / MMA_M
}

/// Shared memory of [`flash_backward_dkv_split()`] for `c` (`c.block_k` query rows per step)
/// and `keys` keys per cube, in bytes: the `K` and `V` tiles, two buffers of `Q` and `dO`, two
/// of the `P·fac` exchange, and the rows' statistics.
pub fn split_shared_bytes(c: FlashConfig, keys: u32) -> usize {
    let (bk, keys, pad) = (c.block_k as usize, keys as usize, V_PAD as usize);
    let (d, dv) = (c.head_dim as usize + pad, c.value_dim as usize + pad);
    let tiles = (keys + 2 * bk) * (d + dv) * 2;
    let exchange = 2 * keys * bk * 4;
    let rows = if c.rules.mask || c.rules.bias || c.rules.dropout {
        8
    } else {
        4
    };
    tiles + exchange + rows * bk * 4
}

/// `dK`, `dV` of `keys` keys (one of [`SPLIT_KEYS`]) of one (batch, key/value head) (module
/// docs), summed over every query row of the group. `c.block_k` query rows per step,
/// `c.head_dim`, `c.value_dim` = `D`, `Dv` rounded up to 16, computed scores. Grid:
/// `(key blocks, y, z)`, `y·z ≥ B·Hkv`; [`split_planes`]`(keys)` planes.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dkv_split<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    grads: &GradInputs<Vector<F, NV>>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] keys: u32,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (d_out, lse, delta) = (&grads.d_out, &grads.lse, &grads.delta);
    let tiles = comptime!(keys / MMA_M);
    let units = comptime!(split_planes(keys) * PLANE);
    let d_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let bq = comptime!(c.block_k as usize);
    let row_len = comptime!(if c.rules.mask || c.rules.bias || c.rules.dropout {
        4 * bq
    } else {
        1usize
    });
    let mut row_s = SharedMemory::<u32>::new(row_len);
    let q_tiles = comptime!(c.block_k / MMA_N);
    let k_steps = comptime!(c.block_k / 16);
    let cv = comptime!(FlashConfig {
        head_dim: c.value_dim,
        ..c
    });
    let blk = pair_block(q, k, v, c);
    let group = pair_group(&blk);
    let (seq_q, seq_k, head_dim, value_dim) = (blk.seq_q, blk.seq_k, blk.head_dim, blk.value_dim);
    let rows = blk.rows;
    let (batch, hkv) = (blk.batch, blk.hkv);
    let key0 = CUBE_POS_X as usize * keys as usize;
    let plane = UNIT_POS / PLANE;
    let tile = plane % tiles;
    let grad_plane = plane >= tiles;
    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;

    let mut k_s = SharedMemory::<Vector<F, NV>>::new(comptime!(keys as usize * d_ldv));
    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(keys as usize * v_ldv));
    let q_len = comptime!(bq * d_ldv);
    let o_len = comptime!(bq * v_ldv);
    let mut q_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * q_len));
    let mut o_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * o_len));
    let mut stat_s = SharedMemory::<f32>::new(comptime!(4 * bq));
    // Per step parity, per key tile, 16 weights per lane, lane-minor (conflict-free).
    let w_len = comptime!((tiles * 4 * q_tiles * PLANE) as usize);
    let mut w_s = SharedMemory::<f32>::new(comptime!(2 * w_len));
    let w_lane = tile as usize * comptime!((4 * q_tiles * PLANE) as usize) + lane;
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1);
    stage_key_rows::<F, NV>(
        k, &mut k_s, k_base, key0, seq_k, head_dim, keys, c.head_dim, units,
    );
    stage_key_rows::<F, NV>(
        v,
        &mut v_s,
        v_base,
        key0,
        seq_k,
        value_dim,
        keys,
        c.value_dim,
        units,
    );

    // This lane's keys: g and g + 8 of its tile's 16.
    let mut key = Array::<usize>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        key[h] = key0 + tile as usize * MMA_M as usize + g + 8 * h;
    }
    // `dV` on a score plane, `dK` on a gradient plane.
    let mut acc = zero_accumulators(comptime!(u32::max(c.head_dim, c.value_dim) / MMA_N));
    let key_last = usize::min(key0 + keys as usize, seq_k) - 1;
    // The query blocks to visit, as in `flash_backward_dkv_mma`: causal with whole blocks per
    // head visits only those whose last position sees the cube's first key.
    let blocks = rows.div_ceil(bq);
    let mut per_head = blocks;
    let mut first = 0usize;
    let mut live_per_head = blocks;
    if comptime!(c.rules.causal) {
        if seq_q % bq == 0 {
            per_head = seq_q / bq;
            let sees = key0 + seq_q;
            if sees > seq_k {
                first = usize::min((sees - seq_k) / bq, per_head);
            }
            live_per_head = per_head - first;
        }
    }
    let n_live = (blocks / per_head) * live_per_head;
    // Step i's block `qb` and its rank among its head's live blocks, advanced without a
    // division: after a head's last live block come the next head's `first` dead ones.
    let mut qb = first;
    let mut rank = 0usize;
    if n_live > 0 {
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
            qb * bq,
            0,
            head_dim,
            0,
            value_dim,
            c,
            units,
        );
    }
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    bar0.commit_copy_async();
    let _token = bar0.arrive();
    // The K and V tiles (plain stores) are visible to all.
    sync_cube();
    let quad = lane % 4;
    for i in 0..n_live {
        let parity = i % 2;
        wait_step(&bar0, &bar1, i);
        let r0 = qb * bq;
        let last = usize::min(r0 + bq, rows) - 1;
        // Causal: the block's largest position must see the cube's first key.
        let mut live = true;
        if comptime!(c.rules.causal) {
            let pos_hi = select(r0 / seq_q == last / seq_q, last % seq_q, seq_q - 1);
            live = key0 + seq_q <= pos_hi + seq_k;
        }
        let (q_buf, o_buf, sb) = (parity * q_len, parity * o_len, parity * 2 * bq);
        let w_at = parity * w_len + w_lane;
        // Score plane: S, then P·Z in place; gradient plane: dP.
        let mut sd = zero_accumulators(q_tiles);
        if live {
            if grad_plane {
                step_scores_of::<F, NV>(&v_s, &o_s, o_buf, &mut sd, tile, cv);
            } else {
                step_scores_of::<F, NV>(&k_s, &q_s, q_buf, &mut sd, tile, c);
                #[unroll]
                for j in 0..q_tiles {
                    #[unroll]
                    for h in 0..2usize {
                        let mut pz = Vector::<f32, Const<2>>::empty();
                        #[unroll]
                        for n in 0..2usize {
                            let col = comptime!((j * MMA_N) as usize) + quad * 2 + n;
                            let raw = sd.index(j as usize)[h][n];
                            let w = key_weight::<F, NV>(
                                inputs, &blk, &args, raw, key[h], key_last, r0, col, sb, &stat_s,
                                &row_s, c,
                            );
                            pz[n] = w.p * w.z;
                            let pf = w.p * w.fac;
                            let e = comptime!((j as usize * 2 + h) * 2 + n);
                            w_s[w_at + e * PLANE as usize] = select(w.z == 0.0f32, -pf, pf);
                        }
                        sd.index_mut(j as usize)[h] = pz;
                    }
                }
            }
        }
        // Every plane is past step i - 1: its buffers take step i + 1's block, whose copies
        // run under this step's products.
        sync_cube();
        let wraps = rank + 1 == live_per_head;
        let nb = qb + 1 + select(wraps, first, 0);
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
                0,
                head_dim,
                0,
                value_dim,
                c,
                units,
            );
        }
        commit_next(&bar0, &bar1, i);
        if live {
            // The products' A fragments: register i of 16 step rows `kc` is key g + 8·(i % 2),
            // step rows 16·kc + 8·(i / 2) + 2·quad + n, i.e. tile 2·kc + i / 2, half i % 2.
            let mut fa = Sequence::<Array<Vector<F, Const<2>>>>::new();
            #[unroll]
            for kc in 0..k_steps {
                let mut frag = Array::<Vector<F, Const<2>>>::new(4usize);
                #[unroll]
                for r in 0..4u32 {
                    let j = comptime!(2 * kc + r / 2);
                    let h = comptime!((r % 2) as usize);
                    let x = sd.index(j as usize)[h];
                    let mut out = Vector::<F, Const<2>>::empty();
                    #[unroll]
                    for n in 0..2usize {
                        if grad_plane {
                            let col = comptime!((j * MMA_N) as usize) + quad * 2 + n;
                            let e = comptime!((j as usize * 2 + h) * 2 + n);
                            let pf = w_s[w_at + e * PLANE as usize];
                            let mut dpz = x[n];
                            if comptime!(c.rules.dropout) {
                                dpz = select(pf < 0.0f32, 0.0f32, x[n] * args.dropout.inv_keep);
                            }
                            out[n] = F::cast_from(f32::abs(pf) * (dpz - stat_s[sb + bq + col]));
                        } else {
                            out[n] = F::cast_from(x[n]);
                        }
                    }
                    frag[r as usize] = out;
                }
                fa.push(frag);
            }
            if grad_plane {
                product_trans::<F, NV>(
                    &fa,
                    &q_s,
                    q_buf,
                    &mut acc,
                    d_ldv,
                    k_steps,
                    comptime!(c.head_dim / 16),
                );
            } else {
                product_trans::<F, NV>(
                    &fa,
                    &o_s,
                    o_buf,
                    &mut acc,
                    v_ldv,
                    k_steps,
                    comptime!(c.value_dim / 16),
                );
            }
        }
        qb = nb;
        rank = select(wraps, 0, rank + 1);
    }
    if n_live == 0 {
        // The prologue's (empty) copies complete before the cube exits.
        wait_step(&bar0, &bar1, 0);
    }
    let mut ok = Array::<bool>::new(2usize);
    let mut at = Array::<usize>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        ok[h] = key[h] < seq_k;
        if grad_plane {
            at[h] = batch * dk.stride(0) + hkv * dk.stride(1) + key[h] * dk.stride(2);
        } else {
            at[h] = batch * dv.stride(0) + hkv * dv.stride(1) + key[h] * dv.stride(2);
        }
    }
    if grad_plane {
        store_tiles::<F>(
            dk,
            &acc,
            &at,
            &ok,
            head_dim,
            comptime!(c.head_dim / MMA_N),
            comptime!(crate::mutation::zero_dk()),
        );
    } else {
        store_tiles::<F>(
            dv,
            &acc,
            &at,
            &ok,
            value_dim,
            comptime!(c.value_dim / MMA_N),
            false,
        );
    }
}
