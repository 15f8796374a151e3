//! The attention forward on plain units (every runtime, every float type; f32 arithmetic).
//!
//! One cube of [`UNITS`] units (a 16 × 16 grid) per block of [`BLOCK_Q`] query rows of one
//! (batch, key/value head), rows running over the group's query heads as in [`super::mma`].
//! Unit `(ty, tx)` owns rows `4·ty .. 4·ty + 4` of the block: their online-softmax state and
//! their output columns `tx + 16·c` of every 64-column chunk of `Dv`. Per step of
//! [`BLOCK_K`] keys:
//!
//! 1. `S = Q·Kᵀ`, register-tiled (4 rows × 2 keys per unit), over `D` in chunks of
//!    [`D_CHUNK`] staged in shared memory;
//! 2. the finished scores ([`super::scores`]), the row maxima through shared memory, the
//!    online-softmax update ([`crate::flash`]) and `P` into shared memory;
//! 3. `O += P·V`, register-tiled, over `Dv` in chunks of [`V_CHUNK`] columns.
//!
//! Causal: the key blocks after every row's diagonal are skipped.

use cubecl::prelude::*;

use super::AttnConfig;
use super::scores::{causal_end, new_refs, score, set_row, visible};
use crate::flash::{inverse_sum, log_sum_exp, next_reference, probability, rescale_factor};

/// Units per cube.
pub const UNITS: u32 = 256;
/// Query rows per cube.
pub const BLOCK_Q: u32 = 64;
/// Keys per step.
pub const BLOCK_K: u32 = 32;
/// Head dims per staged chunk of `Q` and `K`.
pub const D_CHUNK: u32 = 32;
/// Value columns per staged chunk of `V`.
pub const V_CHUNK: u32 = 64;

const GRID: u32 = 16;
const ROWS: u32 = BLOCK_Q / GRID;
const QK_LD: u32 = D_CHUNK + 1;
const P_LD: u32 = BLOCK_K + 1;
/// Offsets in the one shared f32 array: `Q` and `K` chunks (the `V` chunk reuses their
/// space), `P`, and the row partials.
const Q_AT: u32 = 0;
const K_AT: u32 = BLOCK_Q * QK_LD;
const V_AT: u32 = 0;
const P_AT: u32 = K_AT + BLOCK_K * QK_LD;
const RED_AT: u32 = P_AT + BLOCK_Q * P_LD;
const SHARED: u32 = RED_AT + BLOCK_Q * GRID;

/// Shared memory of [`attention_forward_units()`], in bytes.
pub fn shared_bytes() -> usize {
    SHARED as usize * 4
}

/// `out`, `lse` as [`super::mma::attention_forward_mma()`], for any float type and layout.
/// `c.head_dim` is `D` rounded up to [`D_CHUNK`], `c.value_dim` is `Dv` rounded up to
/// [`V_CHUNK`]; `c.block_q`, `c.block_k` are [`BLOCK_Q`], [`BLOCK_K`]. Grid:
/// `(row blocks of G·Sq, B·Hkv)`, [`UNITS`] units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_units<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    softcap: f32,
    #[comptime] c: AttnConfig,
    #[define(F)] _dtype: StorageType,
) {
    let v_chunks = comptime!(c.value_dim / V_CHUNK);
    let bk = BLOCK_K as usize;
    let seq_q = q.shape(2);
    let seq_k = k.shape(2);
    let head_dim = q.shape(3);
    let value_dim = out.shape(3);
    let heads_kv = k.shape(1);
    let group = q.shape(1) / heads_kv;
    let rows = group * seq_q;
    let batch = CUBE_POS_Y as usize / heads_kv;
    let hkv = CUBE_POS_Y as usize % heads_kv;
    let head0 = hkv * group;
    let row0 = (CUBE_POS_X * BLOCK_Q) as usize;
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;

    let last = usize::min(row0 + BLOCK_Q as usize, rows) - 1;
    let one_head = row0 / seq_q == last / seq_q;
    let mut kv_end = seq_k;
    let mut full_end = seq_k;
    if comptime!(c.causal) {
        let pos_hi = select(one_head, last % seq_q, seq_q - 1);
        let pos_lo = select(one_head, row0 % seq_q, 0);
        kv_end = causal_end(pos_hi, seq_q, seq_k);
        full_end = causal_end(pos_lo, seq_q, seq_k);
    }
    let steps = kv_end.div_ceil(bk);
    let full_steps = full_end / bk;
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1);

    let mut sh = SharedMemory::<f32>::new(SHARED as usize);
    let mut refs = new_refs(ROWS as usize);
    let mut m = Array::<f32>::new(ROWS as usize);
    let mut l = Array::<f32>::new(ROWS as usize);
    #[unroll]
    for i in 0..ROWS as usize {
        set_row::<F>(
            &mut refs,
            i,
            mask,
            bias,
            batch,
            head0,
            row0 + ty as usize * 4 + i,
            rows,
            seq_q,
            c,
        );
        m[i] = f32::min_value();
        l[i] = 0.0f32;
    }
    let mut acc = Array::<f32>::new(comptime!(v_chunks as usize * 16));
    #[unroll]
    for i in 0..comptime!(v_chunks as usize * 16) {
        acc[i] = 0.0f32;
    }

    for st in 0..steps {
        let j0 = st * bk;
        // -- 1. S = Q·Kᵀ --
        let mut sacc = Array::<f32>::new(8usize);
        #[unroll]
        for i in 0..8usize {
            sacc[i] = 0.0f32;
        }
        for dc in 0..comptime!(c.head_dim / D_CHUNK) {
            let d0 = (dc * D_CHUNK) as usize;
            #[unroll]
            for e in 0..comptime!(BLOCK_Q * D_CHUNK / UNITS) {
                let idx = UNIT_POS + e * UNITS;
                let (r, d) = ((idx / D_CHUNK) as usize, (idx % D_CHUNK) as usize);
                let row = row0 + r;
                let rr = usize::min(row, rows - 1);
                let mut val = 0.0f32;
                if row < rows && d0 + d < head_dim {
                    let at = batch * q.stride(0)
                        + (head0 + rr / seq_q) * q.stride(1)
                        + (rr % seq_q) * q.stride(2)
                        + (d0 + d) * q.stride(3);
                    val = f32::cast_from(q[at]);
                }
                sh[(Q_AT + (idx / D_CHUNK) * QK_LD) as usize + d] = val;
            }
            #[unroll]
            for e in 0..comptime!(BLOCK_K * D_CHUNK / UNITS) {
                let idx = UNIT_POS + e * UNITS;
                let (key, d) = ((idx / D_CHUNK) as usize, (idx % D_CHUNK) as usize);
                let mut val = 0.0f32;
                if j0 + key < kv_end && d0 + d < head_dim {
                    val = f32::cast_from(
                        k[k_base + (j0 + key) * k.stride(2) + (d0 + d) * k.stride(3)],
                    );
                }
                sh[(K_AT + (idx / D_CHUNK) * QK_LD) as usize + d] = val;
            }
            sync_cube();
            for d in 0..D_CHUNK {
                let mut a = Array::<f32>::new(ROWS as usize);
                #[unroll]
                for i in 0..ROWS {
                    a[i as usize] = sh[(Q_AT + (ty * ROWS + i) * QK_LD + d) as usize];
                }
                #[unroll]
                for cc in 0..2u32 {
                    let b = sh[(K_AT + (tx + GRID * cc) * QK_LD + d) as usize];
                    #[unroll]
                    for i in 0..ROWS {
                        sacc[(i * 2 + cc) as usize] += a[i as usize] * b;
                    }
                }
            }
            sync_cube();
        }

        // -- 2. finished scores, row maxima, the online update, P --
        let mut vis = Array::<bool>::new(8usize);
        #[unroll]
        for i in 0..ROWS as usize {
            let mut pmax = f32::min_value();
            #[unroll]
            for cc in 0..2usize {
                let key = j0 + tx as usize + 16 * cc;
                let at = i * 2 + cc;
                let x = score::<F>(bias, &refs, i, sacc[at], key, seq_k, scale, softcap, c);
                let ok = visible::<F>(mask, &refs, i, key, seq_q, seq_k, c, false)
                    && (st < full_steps
                        || visible::<F>(mask, &refs, i, key, seq_q, seq_k, c, true));
                sacc[at] = x;
                vis[at] = ok;
                pmax = select(ok, f32::max(pmax, x), pmax);
            }
            sh[(RED_AT + (ty * ROWS) * GRID) as usize + i * GRID as usize + tx as usize] = pmax;
        }
        sync_cube();
        let mut alpha = Array::<f32>::new(ROWS as usize);
        #[unroll]
        for i in 0..ROWS as usize {
            let base = (RED_AT + ty * ROWS * GRID) as usize + i * GRID as usize;
            let mut rmax = f32::min_value();
            #[unroll]
            for t in 0..GRID as usize {
                rmax = f32::max(rmax, sh[base + t]);
            }
            let m_new = next_reference(m[i], rmax, false);
            alpha[i] = rescale_factor(m[i], m_new);
            m[i] = m_new;
        }
        sync_cube();
        #[unroll]
        for i in 0..ROWS as usize {
            let mut psum = 0.0f32;
            #[unroll]
            for cc in 0..2usize {
                let at = i * 2 + cc;
                let p = probability(sacc[at], m[i], vis[at]);
                sh[(P_AT + ty * ROWS * P_LD) as usize
                    + i * P_LD as usize
                    + tx as usize
                    + 16 * cc] = p;
                psum += p;
            }
            sh[(RED_AT + ty * ROWS * GRID) as usize + i * GRID as usize + tx as usize] = psum;
            #[unroll]
            for j in 0..comptime!(v_chunks as usize * 4) {
                let at = (j / 4) * 16 + i * 4 + j % 4;
                acc[at] *= alpha[i];
            }
        }
        sync_cube();
        #[unroll]
        for i in 0..ROWS as usize {
            let base = (RED_AT + ty * ROWS * GRID) as usize + i * GRID as usize;
            let mut total = 0.0f32;
            #[unroll]
            for t in 0..GRID as usize {
                total += sh[base + t];
            }
            l[i] = alpha[i] * l[i] + total;
        }

        // -- 3. O += P·V --
        #[unroll]
        for vc in 0..v_chunks {
            let c0 = (vc * V_CHUNK) as usize;
            #[unroll]
            for e in 0..comptime!(BLOCK_K * V_CHUNK / UNITS) {
                let idx = UNIT_POS + e * UNITS;
                let (key, col) = ((idx / V_CHUNK) as usize, (idx % V_CHUNK) as usize);
                let mut val = 0.0f32;
                if j0 + key < kv_end && c0 + col < value_dim {
                    val = f32::cast_from(
                        v[v_base + (j0 + key) * v.stride(2) + (c0 + col) * v.stride(3)],
                    );
                }
                sh[(V_AT + idx) as usize] = val;
            }
            sync_cube();
            for kk in 0..BLOCK_K {
                let mut a = Array::<f32>::new(ROWS as usize);
                #[unroll]
                for i in 0..ROWS {
                    a[i as usize] = sh[(P_AT + (ty * ROWS + i) * P_LD + kk) as usize];
                }
                #[unroll]
                for cc in 0..4u32 {
                    let b = sh[(V_AT + kk * V_CHUNK + tx + GRID * cc) as usize];
                    #[unroll]
                    for i in 0..ROWS {
                        let at = (vc * 16 + i * 4 + cc) as usize;
                        acc[at] += a[i as usize] * b;
                    }
                }
            }
            sync_cube();
        }
    }

    // -- normalise and store --
    #[unroll]
    for i in 0..ROWS as usize {
        let row = row0 + ty as usize * ROWS as usize + i;
        if row < rows {
            let head = head0 + row / seq_q;
            let pos = row % seq_q;
            if tx == 0 {
                let at = batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2);
                lse[at] = log_sum_exp(m[i], l[i]);
            }
            let inv = inverse_sum(l[i]);
            let o_base = batch * out.stride(0) + head * out.stride(1) + pos * out.stride(2);
            #[unroll]
            for j in 0..comptime!(v_chunks as usize * 4) {
                let col = (j / 4) * V_CHUNK as usize + tx as usize + 16 * (j % 4);
                if col < value_dim {
                    out[o_base + col * out.stride(3)] =
                        F::cast_from(acc[(j / 4) * 16 + i * 4 + j % 4] * inv);
                }
            }
        }
    }
}
