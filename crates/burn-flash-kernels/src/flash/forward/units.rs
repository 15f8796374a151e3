//! The flash forward on plain units (every runtime, every float type; f32 arithmetic), with
//! the score source a comptime choice ([`crate::flash::ScoreSource`]).
//!
//! One cube of [`UNITS`] units (a 16 × 16 grid) per block of `block_q` query rows of one
//! (batch, key/value head) and one tile of `value_dim` output columns, rows running over the
//! group's query heads as in [`super::mma`]. Unit `(ty, tx)` owns rows
//! `R·ty .. R·ty + R` of the block (`R = block_q / 16`): their online-softmax state and their
//! output columns `tx + 16·c` of every 64-column chunk of the tile. Per step of `block_k` keys
//! (`K = block_k / 16` per unit):
//!
//! 1. the scores of `R` rows × `K` keys per unit: given (read from `X`), or `S = Q·Kᵀ`,
//!    register-tiled over `D` in chunks of [`D_CHUNK`] staged in shared memory;
//! 2. the finished scores ([`crate::flash::scores`]), the row maxima through shared memory, the
//!    online-softmax update ([`crate::flash::online`]) and `P` into shared memory;
//! 3. `O += P·V`, register-tiled, over the tile in chunks of [`V_CHUNK`] columns.
//!
//! Causal: the key blocks after every row's diagonal are skipped.

use cubecl::prelude::*;

use crate::dropout::keep_weight;
use crate::flash::args::{ForwardOutputs, ScoreArgs, ScoreInputs};
use crate::flash::block::{cube_block, cube_group};
use crate::flash::config::FlashConfig;
use crate::flash::online::{
    inverse_sum, next_reference, output_sum, probability, rescale_factor, row_lse,
};
use crate::flash::scores::{new_refs, score, set_row, visible};

/// Units per cube.
pub const UNITS: u32 = 256;
/// Query rows per cube of attention (and the most of any launch).
pub const BLOCK_Q: u32 = 64;
/// Keys per step of attention (and the most of any launch).
pub const BLOCK_K: u32 = 32;
/// Head dims per staged chunk of `Q` and `K`.
pub const D_CHUNK: u32 = 32;
/// Value columns per staged chunk of `V`.
pub const V_CHUNK: u32 = 64;
/// Units across the grid of a cube (and down it).
pub const GRID: u32 = 16;

const QK_LD: u32 = D_CHUNK + 1;

/// Offsets in the one shared f32 array of a cube, and its length. A scratch area at 0 holds,
/// in turn, the `Q` and `K` chunks (computed scores), the row partials and the `V` chunk;
/// `P` follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedLayout {
    /// Start of the `K` chunk (`Q` starts at 0).
    pub k_at: u32,
    /// Start of `P`.
    pub p_at: u32,
    /// Keys of `V` staged at a time.
    pub v_keys: u32,
    /// Length, in f32.
    pub len: u32,
}

/// The shared layout of `c` (its rows, keys per step and score source).
pub fn layout(c: FlashConfig) -> SharedLayout {
    let k_at = c.block_q * QK_LD;
    let qk = if c.given() {
        0
    } else {
        k_at + c.block_k * QK_LD
    };
    let v_keys = c.block_k.min(32);
    let p_at = qk.max(v_keys * V_CHUNK).max(c.block_q * GRID);
    SharedLayout {
        k_at,
        p_at,
        v_keys,
        len: p_at + c.block_q * (c.block_k + 1),
    }
}

/// Shared memory of [`flash_forward_units()`] for `c`, in bytes.
pub fn shared_bytes(c: FlashConfig) -> usize {
    layout(c).len as usize * 4
}

/// Whether `c` fits the kernel: 16, 32 or 64 rows and keys per step, whole chunks of `D` and
/// of the output tile.
pub fn fits(c: FlashConfig) -> bool {
    [16, 32, 64].contains(&c.block_q)
        && [16, 32, 64].contains(&c.block_k)
        && c.head_dim.is_multiple_of(D_CHUNK)
        && c.value_dim.is_multiple_of(V_CHUNK)
        && c.value_dim > 0
}

/// Stages keys `j0 .. j0 + n_keys` × columns `c0 .. c0 + width` of `t` (the rows of one
/// (batch, head) from `base`) into `sh` from `at`, row pitch `ld`, as f32; zeros past `kv_end`
/// keys and `cols` columns.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_keys<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<f32>,
    base: usize,
    j0: usize,
    kv_end: usize,
    c0: usize,
    cols: usize,
    #[comptime] at: u32,
    #[comptime] ld: u32,
    #[comptime] n_keys: u32,
    #[comptime] width: u32,
) {
    #[unroll]
    for e in 0..comptime!(n_keys * width / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (key, col) = ((idx / width) as usize, (idx % width) as usize);
        let mut val = 0.0f32;
        if j0 + key < kv_end && c0 + col < cols {
            val = f32::cast_from(t[base + (j0 + key) * t.stride(2) + (c0 + col) * t.stride(3)]);
        }
        sh[(at + (idx / width) * ld) as usize + col] = val;
    }
}

/// 256 threads, a row's keys per thread group: one cube per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

/// `out`, `lse` as [`super::mma::flash_forward_mma()`] (same tensors for each score source),
/// for any float type and layout. `c.head_dim` is `D` rounded up to [`D_CHUNK`], `c.value_dim`
/// the output tile, a multiple of [`V_CHUNK`]; `c.block_q`, `c.block_k` are 16, 32 or 64.
/// Grid: `(column tiles of Dv, row blocks of G·Sq, B·Hkv)`, [`UNITS`] units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_units<F: Float>(
    inputs: &ScoreInputs<F, F>,
    outputs: &mut ForwardOutputs<F>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (out, lse) = (&mut outputs.out, &mut outputs.lse);
    let drop = args.dropout;
    let given = comptime!(c.given());
    let v_chunks = comptime!(c.value_dim / V_CHUNK);
    // Rows and keys per unit.
    let rows_u = comptime!(c.block_q / GRID);
    let keys_u = comptime!(c.block_k / GRID);
    let sc = comptime!(rows_u * keys_u) as usize;
    let lay = comptime!(layout(c));
    let (k_at, p_at, v_keys) = (
        comptime!(lay.k_at),
        comptime!(lay.p_at),
        comptime!(lay.v_keys),
    );
    // The row partials live in the scratch area.
    let red_at = 0u32;
    let p_ld = comptime!(c.block_k + 1);

    let blk = cube_block(q, k, &inputs.seqs, &args, c);
    let group = cube_group(&blk);
    let (seq_q, seq_k, rows) = (blk.seq_q, blk.seq_k, blk.rows);
    let (batch, hkv, head0, row0) = (blk.batch, blk.hkv, blk.head0, blk.row0);
    let kv_end = blk.kv_end;
    let head_dim = q.shape(3);
    let value_dim = out.shape(3);
    let col0 = blk.col0;
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;
    let steps = blk.steps(c);
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1);

    let mut sh = SharedMemory::<f32>::new(comptime!(lay.len as usize));
    let mut refs = new_refs(rows_u as usize);
    let mut m = Array::<f32>::new(rows_u as usize);
    let mut l = Array::<f32>::new(rows_u as usize);
    // Where each of the unit's rows starts in `X` (given scores).
    let mut x_rows = Array::<usize>::new(rows_u as usize);
    // The (batch, query head) pair of each row: the dropout generator's key.
    let mut pairs = Array::<usize>::new(rows_u as usize);
    #[unroll]
    for i in 0..rows_u as usize {
        let row = row0 + ty as usize * rows_u as usize + i;
        set_row(&mut refs, i, inputs, &group, row, seq_k, &args, c);
        pairs[i] = batch * q.shape(1) + group.head(row);
        x_rows[i] = group.offset(q, row);
        m[i] = f32::min_value();
        l[i] = 0.0f32;
    }
    let mut acc = Array::<f32>::new(comptime!(v_chunks as usize * 4 * rows_u as usize));
    #[unroll]
    for i in 0..comptime!(v_chunks as usize * 4 * rows_u as usize) {
        acc[i] = 0.0f32;
    }

    for st in 0..steps {
        let j0 = blk.step_key(st, c);
        let full = blk.full_step(st, c);
        // -- 1. the scores: unit (ty, tx) holds row i, key tx + 16·cc at sacc[i·K + cc] --
        let mut sacc = Array::<f32>::new(sc);
        #[unroll]
        for i in 0..sc {
            sacc[i] = 0.0f32;
        }
        if comptime!(given) {
            #[unroll]
            for i in 0..rows_u as usize {
                #[unroll]
                for cc in 0..keys_u as usize {
                    let key = j0 + tx as usize + 16 * cc;
                    if key < seq_k {
                        sacc[i * keys_u as usize + cc] =
                            f32::cast_from(q[x_rows[i] + key * q.stride(3)]);
                    }
                }
            }
        } else {
            for dc in 0..comptime!(c.head_dim / D_CHUNK) {
                let d0 = (dc * D_CHUNK) as usize;
                #[unroll]
                for e in 0..comptime!(c.block_q * D_CHUNK / UNITS) {
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
                    sh[((idx / D_CHUNK) * QK_LD) as usize + d] = val;
                }
                stage_keys::<F>(
                    k, &mut sh, k_base, j0, kv_end, d0, head_dim, k_at, QK_LD, c.block_k, D_CHUNK,
                );
                sync_cube();
                for d in 0..D_CHUNK {
                    let mut a = Array::<f32>::new(rows_u as usize);
                    #[unroll]
                    for i in 0..rows_u {
                        a[i as usize] = sh[((ty * rows_u + i) * QK_LD + d) as usize];
                    }
                    #[unroll]
                    for cc in 0..keys_u {
                        let b = sh[(k_at + (tx + GRID * cc) * QK_LD + d) as usize];
                        #[unroll]
                        for i in 0..rows_u {
                            sacc[(i * keys_u + cc) as usize] += a[i as usize] * b;
                        }
                    }
                }
                sync_cube();
            }
        }

        // -- 2. finished scores, row maxima, the online update, P --
        let mut vis = Array::<bool>::new(sc);
        #[unroll]
        for i in 0..rows_u as usize {
            let mut pmax = f32::min_value();
            #[unroll]
            for cc in 0..keys_u as usize {
                let key = j0 + tx as usize + 16 * cc;
                let at = i * keys_u as usize + cc;
                let mut x = sacc[at];
                if comptime!(!given) {
                    x = score::<F>(mask, bias, &refs, i, x, key, seq_k, &args, c);
                }
                let ok = visible::<F>(mask, &refs, i, key, seq_q, seq_k, c, false)
                    && (full || visible::<F>(mask, &refs, i, key, seq_q, seq_k, c, true));
                sacc[at] = x;
                vis[at] = ok;
                pmax = select(ok, f32::max(pmax, x), pmax);
            }
            sh[(red_at + ty * rows_u * GRID) as usize + i * GRID as usize + tx as usize] = pmax;
        }
        sync_cube();
        let mut alpha = Array::<f32>::new(rows_u as usize);
        #[unroll]
        for i in 0..rows_u as usize {
            let base = (red_at + ty * rows_u * GRID) as usize + i * GRID as usize;
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
        for i in 0..rows_u as usize {
            let mut psum = 0.0f32;
            #[unroll]
            for cc in 0..keys_u as usize {
                let at = i * keys_u as usize + cc;
                let p = probability(sacc[at], m[i], vis[at]);
                // The row sum takes every weight; `P·V` the kept ones, scaled.
                let mut kept = p;
                if comptime!(c.rules.dropout) {
                    let key = j0 + tx as usize + 16 * cc;
                    kept *= keep_weight(
                        drop.seed_lo,
                        drop.seed_hi,
                        drop.threshold,
                        drop.inv_keep,
                        pairs[i],
                        refs.pos[i],
                        key,
                        false,
                    );
                }
                sh[(p_at + ty * rows_u * p_ld) as usize
                    + i * p_ld as usize
                    + tx as usize
                    + 16 * cc] = kept;
                psum += p;
            }
            sh[(red_at + ty * rows_u * GRID) as usize + i * GRID as usize + tx as usize] = psum;
            #[unroll]
            for j in 0..comptime!(v_chunks as usize * 4) {
                let at = (j / 4) * comptime!(4 * rows_u as usize) + i * 4 + j % 4;
                acc[at] *= alpha[i];
            }
        }
        sync_cube();
        #[unroll]
        for i in 0..rows_u as usize {
            let base = (red_at + ty * rows_u * GRID) as usize + i * GRID as usize;
            let mut total = 0.0f32;
            #[unroll]
            for t in 0..GRID as usize {
                total += sh[base + t];
            }
            l[i] = alpha[i] * l[i] + total;
        }
        // The partials are read before the scratch area takes `V`.
        sync_cube();

        // -- 3. O += P·V, `V` staged `v_keys` keys at a time --
        #[unroll]
        for vh in 0..comptime!(c.block_k / v_keys) {
            #[unroll]
            for vc in 0..v_chunks {
                let c0 = col0 + (vc * V_CHUNK) as usize;
                let k0 = j0 + (vh * v_keys) as usize;
                stage_keys::<F>(
                    v, &mut sh, v_base, k0, kv_end, c0, value_dim, 0u32, V_CHUNK, v_keys, V_CHUNK,
                );
                sync_cube();
                for kk in 0..v_keys {
                    let mut a = Array::<f32>::new(rows_u as usize);
                    #[unroll]
                    for i in 0..rows_u {
                        a[i as usize] =
                            sh[(p_at + (ty * rows_u + i) * p_ld + vh * v_keys + kk) as usize];
                    }
                    #[unroll]
                    for cc in 0..4u32 {
                        let b = sh[(kk * V_CHUNK + tx + GRID * cc) as usize];
                        #[unroll]
                        for i in 0..rows_u {
                            let at = (vc * 4 * rows_u + i * 4 + cc) as usize;
                            acc[at] += a[i as usize] * b;
                        }
                    }
                }
                sync_cube();
            }
        }
    }

    // -- normalise and store --
    #[unroll]
    for i in 0..rows_u as usize {
        let row = row0 + ty as usize * rows_u as usize + i;
        if row < rows {
            let head = head0 + row / seq_q;
            let pos = row % seq_q;
            if tx == 0 && blk.first_tile {
                let at = batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2);
                lse[at] = row_lse(m[i], l[i], refs.sink[i], c);
            }
            let inv = inverse_sum(output_sum(m[i], l[i], refs.sink[i], c));
            let o_base = batch * out.stride(0) + head * out.stride(1) + pos * out.stride(2);
            #[unroll]
            for j in 0..comptime!(v_chunks as usize * 4) {
                let col = col0 + (j / 4) * V_CHUNK as usize + tx as usize + 16 * (j % 4);
                if col < value_dim {
                    let at = (j / 4) * comptime!(4 * rows_u as usize) + i * 4 + j % 4;
                    out[o_base + col * out.stride(3)] = F::cast_from(acc[at] * inv);
                }
            }
        }
    }
}
