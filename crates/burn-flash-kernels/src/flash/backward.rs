//! The flash backward on plain units (every runtime, every float type; f32 arithmetic):
//! FlashAttention-2's schedule, nothing of size `Sq × Sk` kept.
//!
//! With the forward's row log-sum-exp `lse` and `δ = rowsum(dO ⊙ O)` ([`flash_delta()`]), a
//! block of scores is rebuilt exactly as the forward made it ([`super::scores`]: scale,
//! softcap, mask, causal, bias) and
//!
//! ```text
//! P  = e^(S − lse)            (0 where the key is invisible or the row has none)
//! Z  = keep / (1 − p)         (dropout, the forward's mask drawn again; 1 without)
//! dV += (P ⊙ Z)ᵀ·dO
//! dP = dO·Vᵀ
//! dS = P ⊙ (dP ⊙ Z − δ)       (the gradient of the final score: dBias)
//! dR = dS ⊙ (1 − (s_c / c)²)  (through the softcap, s_c the capped score)
//! dQ += scale·dR·K,  dK += scale·dRᵀ·Q
//! ```
//!
//! Two kernels, each owning its output so that nothing is accumulated across cubes:
//! - [`flash_backward_dkv()`]: one cube per block of [`BLOCK_KEYS`] keys of one (batch,
//!   key/value head), looping over every query row of the head's group (`G·Sq` rows, the
//!   query heads of a group summed in the kernel, nothing repeated), blocks above a causal
//!   diagonal skipped;
//! - [`flash_backward_dq()`]: one cube per block of [`BLOCK_ROWS`] query rows, looping over
//!   the keys the rows see (up to the causal diagonal); it also writes `dS` where the bias
//!   needs a gradient.
//!
//! Unit `(ty, tx)` of the 16 × 16 grid holds scores of rows `2·ty + i` and keys `tx + 16·j`
//! (`i, j < 2`); products run through shared memory in chunks of [`CHUNK`] head dims. The
//! grid is `(blocks, y, z)` with `y·z ≥ B·Hkv` (`B·Hkv` folded over two axes: any number of
//! heads runs).

use cubecl::prelude::*;

use super::FlashConfig;
use crate::dropout::keep_weight;

/// The dropout arguments of a launch ([`crate::dropout::DropoutParams`]).
#[derive(CubeType)]
pub struct Dropout {
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub threshold: u32,
    pub inv_keep: f32,
}
use super::scores::{RowRefs, add_bias, capped, causal_end, new_refs, set_row, visible};

/// Units per cube.
pub const UNITS: u32 = 256;
/// Units across the grid of a cube (and down it).
pub const GRID: u32 = 16;
/// Query rows per block.
pub const BLOCK_ROWS: u32 = 32;
/// Keys per block.
pub const BLOCK_KEYS: u32 = 32;
/// Head dims (and value dims) per staged chunk.
pub const CHUNK: u32 = 32;
/// Row pitch of the shared tiles (one pad column: conflict-free column reads).
const LD: u32 = CHUNK + 1;
/// Shared tiles of a cube: operand A, operand B, `P`, `dS`, each `32 × LD`.
const TILE: u32 = 32 * LD;
/// Shared memory of either kernel, in bytes.
pub const SHARED_BYTES: usize = (4 * TILE * 4) as usize;

/// Most columns of `dV` one cube of [`flash_backward_dkv()`] accumulates (its registers):
/// attention's `Dv ≤ 256` in one tile, wider given-score `V`s in tiles of this.
pub const MAX_VALUE_TILE: u32 = 256;

/// Rows of `δ` per cube of [`flash_delta()`].
pub const DELTA_ROWS: u32 = 8;

/// The (batch, key/value head) pair of this cube, from the grid's `(y, z)` axes; `None`-like
/// `pairs` bound checked by the caller.
#[cube]
pub(crate) fn pair_index() -> usize {
    (CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y) as usize
}

/// The query head of index `g` in the group of key/value head `hkv` (`G = Hq / Hkv` heads).
#[cube]
fn group_head(hkv: usize, g: usize, group: usize, heads_kv: usize) -> usize {
    let mut head = hkv * group + g;
    if comptime!(crate::mutation::gqa_modulo()) {
        head = hkv + heads_kv * g;
    }
    head
}

/// Offset of `t[b, h, p, 0]`.
#[cube]
fn row_at<F: CubePrimitive>(t: &Tensor<F>, b: usize, h: usize, p: usize) -> usize {
    b * t.stride(0) + h * t.stride(1) + p * t.stride(2)
}

/// Stages `32 × CHUNK` elements of a 4-D tensor into `sh[at..]` (pitch [`LD`]), f32: row `r`
/// of the tile is the tensor row at `bases[r]` (0 past `valid` rows), columns `c0..`.
#[cube]
fn stage<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<f32>,
    at: u32,
    base: usize,
    pitch: usize,
    valid: usize,
    c0: usize,
    cols: usize,
) {
    #[unroll]
    for e in 0..comptime!(32 * CHUNK / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (r, c) = (idx / CHUNK, idx % CHUNK);
        let mut val = 0.0f32;
        if (r as usize) < valid && c0 + (c as usize) < cols {
            val = f32::cast_from(t[base + r as usize * pitch + (c0 + c as usize) * t.stride(3)]);
        }
        sh[(at + r * LD + c) as usize] = val;
    }
}

/// Stages `32 × CHUNK` elements of query rows `r0..` of a key/value head's group (row `r` is
/// head `group_head(r / Sq)`, position `r % Sq`) into `sh[at..]`, f32, 0 past the rows.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<f32>,
    at: u32,
    batch: usize,
    hkv: usize,
    group: usize,
    heads_kv: usize,
    r0: usize,
    rows: usize,
    seq_q: usize,
    c0: usize,
    cols: usize,
) {
    #[unroll]
    for e in 0..comptime!(32 * CHUNK / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (r, c) = (idx / CHUNK, idx % CHUNK);
        let row = r0 + r as usize;
        let mut val = 0.0f32;
        if row < rows && c0 + (c as usize) < cols {
            let head = group_head(hkv, row / seq_q, group, heads_kv);
            let base = row_at(t, batch, head, row % seq_q);
            val = f32::cast_from(t[base + (c0 + c as usize) * t.stride(3)]);
        }
        sh[(at + r * LD + c) as usize] = val;
    }
}

/// The given scores of the unit's 2 × 2 elements (rows `r0 + 2·ty + i`, keys `j0 + tx + 16·j`)
/// from `x` (`[B, H, Sq, Sk]`, rows over the group as in [`stage_rows()`]); 0 past the edges.
#[cube]
#[allow(clippy::too_many_arguments)]
fn read_scores<F: Float>(
    x: &Tensor<F>,
    raw: &mut Array<f32>,
    batch: usize,
    hkv: usize,
    group: usize,
    heads_kv: usize,
    r0: usize,
    rows: usize,
    seq_q: usize,
    j0: usize,
    seq_k: usize,
    ty: u32,
    tx: u32,
) {
    #[unroll]
    for i in 0..2u32 {
        let row = r0 + (2 * ty + i) as usize;
        #[unroll]
        for j in 0..2u32 {
            let key = j0 + (tx + GRID * j) as usize;
            if row < rows && key < seq_k {
                let head = group_head(hkv, row / seq_q, group, heads_kv);
                let at = row_at(x, batch, head, row % seq_q) + key * x.stride(3);
                raw[(i * 2 + j) as usize] = f32::cast_from(x[at]);
            }
        }
    }
}

/// `acc[i·2 + j] += Σ_d a[2·ty + i][d] · b[tx + 16·j][d]` over one chunk: the unit's 2 × 2
/// block of `A·Bᵀ` (`A`, `B` row-major tiles of pitch [`LD`]).
#[cube]
fn product_abt(
    sh: &SharedMemory<f32>,
    a_at: u32,
    b_at: u32,
    acc: &mut Array<f32>,
    ty: u32,
    tx: u32,
) {
    for d in 0..CHUNK {
        let a0 = sh[(a_at + (2 * ty) * LD + d) as usize];
        let a1 = sh[(a_at + (2 * ty + 1) * LD + d) as usize];
        let b0 = sh[(b_at + tx * LD + d) as usize];
        let b1 = sh[(b_at + (tx + GRID) * LD + d) as usize];
        acc[0] += a0 * b0;
        acc[1] += a0 * b1;
        acc[2] += a1 * b0;
        acc[3] += a1 * b1;
    }
}

/// `acc[at + i·2 + j] += Σ_r a[r][2·ty + i] · b[r][tx + 16·j]` over 32 rows: the unit's 2 × 2
/// block of `Aᵀ·B` (`A`, `B` row-major tiles of pitch [`LD`]).
#[cube]
fn product_atb(
    sh: &SharedMemory<f32>,
    a_at: u32,
    b_at: u32,
    acc: &mut Array<f32>,
    at: usize,
    ty: u32,
    tx: u32,
) {
    for r in 0..32u32 {
        let a0 = sh[(a_at + r * LD + 2 * ty) as usize];
        let a1 = sh[(a_at + r * LD + 2 * ty + 1) as usize];
        let b0 = sh[(b_at + r * LD + tx) as usize];
        let b1 = sh[(b_at + r * LD + tx + GRID) as usize];
        acc[at] += a0 * b0;
        acc[at + 1] += a0 * b1;
        acc[at + 2] += a1 * b0;
        acc[at + 3] += a1 * b1;
    }
}

/// `acc[at + i·2 + j] += Σ_k a[2·ty + i][k] · b[k][tx + 16·j]` over 32 columns of `A`: the
/// unit's 2 × 2 block of `A·B`.
#[cube]
fn product_ab(
    sh: &SharedMemory<f32>,
    a_at: u32,
    b_at: u32,
    acc: &mut Array<f32>,
    at: usize,
    ty: u32,
    tx: u32,
) {
    for k in 0..32u32 {
        let a0 = sh[(a_at + (2 * ty) * LD + k) as usize];
        let a1 = sh[(a_at + (2 * ty + 1) * LD + k) as usize];
        let b0 = sh[(b_at + k * LD + tx) as usize];
        let b1 = sh[(b_at + k * LD + tx + GRID) as usize];
        acc[at] += a0 * b0;
        acc[at + 1] += a0 * b1;
        acc[at + 2] += a1 * b0;
        acc[at + 3] += a1 * b1;
    }
}

/// The weights of a block, rebuilt from the raw products `raw` of the unit's 2 × 2 elements:
/// `P` (`p`, before dropout), the softcap's derivative (`dfac`) and the dropout factor `z`
/// (`keep / (1 − p)`, 1 without dropout), the forward's own mask drawn again.
#[cube]
#[allow(clippy::too_many_arguments)]
fn rebuild<F: Float>(
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    refs: &RowRefs,
    raw: &Array<f32>,
    row_ok: &Array<bool>,
    row_lse: &Array<f32>,
    j0: usize,
    tx: u32,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    softcap: f32,
    drop: &Dropout,
    row_pair: &Array<usize>,
    p: &mut Array<f32>,
    dfac: &mut Array<f32>,
    z: &mut Array<f32>,
    #[comptime] c: FlashConfig,
) {
    #[unroll]
    for i in 0..2usize {
        #[unroll]
        for j in 0..2usize {
            let at = i * 2 + j;
            let key = j0 + tx as usize + 16 * j;
            let sc = capped(raw[at], scale, softcap, c);
            let mut fac = 1.0f32;
            if comptime!(c.softcap) {
                let t = sc / softcap;
                fac = 1.0f32 - t * t;
            }
            let s = add_bias::<F>(bias, refs, i, sc, key, seq_k, c);
            let ok = row_ok[i] && visible::<F>(mask, refs, i, key, seq_q, seq_k, c, true);
            // A row without a visible key has lse = −inf (and every P = 0).
            let live = ok && row_lse[i] > f32::min_value();
            p[at] = select(live, f32::exp(s - row_lse[i]), 0.0f32);
            dfac[at] = fac;
            z[at] = 1.0f32;
            if comptime!(c.dropout) {
                z[at] = keep_weight(
                    drop.seed_lo,
                    drop.seed_hi,
                    drop.threshold,
                    drop.inv_keep,
                    row_pair[i],
                    refs.pos[i],
                    key,
                    true,
                );
            }
        }
    }
}

/// `δ[b, h, i] = Σ_c dO[b, h, i, c] · O[b, h, i, c]` (f32) for every query row: 32 units per
/// row, [`DELTA_ROWS`] rows per cube; `delta` is contiguous `[B, Hq, Sq]`. Grid: row groups
/// along x then y.
#[cube(launch_unchecked)]
pub fn flash_delta<F: Float>(
    d_out: &Tensor<F>,
    out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let heads = out.shape(1);
    let seq_q = out.shape(2);
    let dv = out.shape(3);
    let rows = out.shape(0) * heads * seq_q;
    let lane = (UNIT_POS % 32) as usize;
    let group = UNIT_POS / 32;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let r = cube * DELTA_ROWS as usize + group as usize;
    let mut partial = 0.0f32;
    if r < rows {
        let (b, h, p) = (r / (heads * seq_q), (r / seq_q) % heads, r % seq_q);
        let g_base = row_at(d_out, b, h, p);
        let o_base = row_at(out, b, h, p);
        for s in 0..dv.div_ceil(32) {
            let col = s * 32 + lane;
            if col < dv {
                partial += f32::cast_from(d_out[g_base + col * d_out.stride(3)])
                    * f32::cast_from(out[o_base + col * out.stride(3)]);
            }
        }
    }
    let mut part_s = SharedMemory::<f32>::new(comptime!((32 * DELTA_ROWS) as usize));
    part_s[UNIT_POS as usize] = partial;
    sync_cube();
    if lane == 0 && r < rows {
        let mut sum = 0.0f32;
        for q in 0..32u32 {
            sum += part_s[(group * 32 + q) as usize];
        }
        if comptime!(crate::mutation::drop_delta()) {
            sum = 0.0f32;
        }
        delta[r] = sum;
    }
}

/// `dK` and `dV` of one block of [`BLOCK_KEYS`] keys (module docs); given scores
/// (`softmax(X)·V`): `dV` alone. `c.head_dim` is `D` rounded up to [`CHUNK`] (0 for given
/// scores), `c.value_dim` the columns of `dV` per cube, a multiple of [`CHUNK`]: all of `Dv`
/// with computed scores, a column tile of it with given ones. Grid: `(key blocks × column
/// tiles, y, z)`, `y·z ≥ B·Hkv`; [`UNITS`] units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dkv<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    inv_keep: f32,
    #[comptime] c: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let d_chunks = comptime!(c.head_dim / CHUNK);
    let v_chunks = comptime!(c.value_dim / CHUNK);
    let (a_at, b_at, p_at, ds_at) = (0u32, TILE, 2 * TILE, 3 * TILE);
    let given = comptime!(c.given());
    let mut heads_kv = k.shape(1);
    let mut seq_k = k.shape(2);
    if comptime!(given) {
        // The scores `X` stand in for the queries: `[B, H, Sq, Sk]`.
        heads_kv = v.shape(1);
        seq_k = q.shape(3);
    }
    let seq_q = q.shape(2);
    let head_dim = q.shape(3);
    let value_dim = v.shape(3);
    let group = q.shape(1) / heads_kv;
    let rows = group * seq_q;
    let pair = pair_index();
    if pair >= q.shape(0) * heads_kv {
        terminate!();
    }
    let (batch, hkv) = (pair / heads_kv, pair % heads_kv);
    let head0 = hkv * group;
    // x runs over (key block, column tile of dV): given scores with a wide V take dV in tiles
    // of `c.value_dim` columns (one tile for attention, `Dv ≤ 256`).
    let tiles = value_dim.div_ceil(comptime!(c.value_dim as usize));
    let col_base = (CUBE_POS_X as usize % tiles) * comptime!(c.value_dim as usize);
    let j0 = (CUBE_POS_X as usize / tiles) * BLOCK_KEYS as usize;
    let keys = usize::min(seq_k - j0, BLOCK_KEYS as usize);
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;
    let k_base = row_at(k, batch, hkv, j0);
    let v_base = row_at(v, batch, hkv, j0);

    let mut sh = SharedMemory::<f32>::new(comptime!((4 * TILE) as usize));
    let mut acc_dk = Array::<f32>::new(comptime!((d_chunks * 4).max(1) as usize));
    let mut acc_dv = Array::<f32>::new(comptime!((v_chunks * 4) as usize));
    #[unroll]
    for n in 0..comptime!((d_chunks * 4) as usize) {
        acc_dk[n] = 0.0f32;
    }
    #[unroll]
    for n in 0..comptime!((v_chunks * 4) as usize) {
        acc_dv[n] = 0.0f32;
    }
    let mut refs = new_refs(2usize);
    let mut row_ok = Array::<bool>::new(2usize);
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_delta = Array::<f32>::new(2usize);
    let mut row_pair = Array::<usize>::new(2usize);
    let mut raw = Array::<f32>::new(4usize);
    let mut dp = Array::<f32>::new(4usize);
    let mut p = Array::<f32>::new(4usize);
    let mut dfac = Array::<f32>::new(4usize);
    let mut z = Array::<f32>::new(4usize);
    let drop = Dropout {
        seed_lo,
        seed_hi,
        threshold,
        inv_keep,
    };

    let blocks = rows.div_ceil(BLOCK_ROWS as usize);
    for qb in 0..blocks {
        let r0 = qb * BLOCK_ROWS as usize;
        let last = usize::min(r0 + BLOCK_ROWS as usize, rows) - 1;
        // Causal: the block's largest position must see the first key.
        let mut live = true;
        if comptime!(c.causal) {
            let pos_hi = select(r0 / seq_q == last / seq_q, last % seq_q, seq_q - 1);
            live = j0 + seq_q <= pos_hi + seq_k;
            if comptime!(crate::mutation::causal_top_left()) {
                live = j0 <= pos_hi;
            }
        }
        if live {
            #[unroll]
            for i in 0..2usize {
                let row = r0 + (2 * ty) as usize + i;
                set_row::<F>(&mut refs, i, mask, bias, batch, head0, row, rows, seq_q, c);
                let rr = usize::min(row, rows - 1);
                let head = group_head(hkv, rr / seq_q, group, heads_kv);
                let pos = rr % seq_q;
                row_ok[i] = row < rows;
                row_lse[i] =
                    lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
                row_delta[i] = delta[(batch * q.shape(1) + head) * seq_q + pos];
                row_pair[i] = batch * q.shape(1) + head;
            }
            // S = Q·Kᵀ, or the given scores
            #[unroll]
            for n in 0..4usize {
                raw[n] = 0.0f32;
                dp[n] = 0.0f32;
            }
            if comptime!(given) {
                read_scores::<F>(
                    q, &mut raw, batch, hkv, group, heads_kv, r0, rows, seq_q, j0, seq_k, ty, tx,
                );
            }
            for dc in 0..d_chunks {
                let c0 = (dc * CHUNK) as usize;
                stage_rows::<F>(
                    q, &mut sh, a_at, batch, hkv, group, heads_kv, r0, rows, seq_q, c0, head_dim,
                );
                stage::<F>(k, &mut sh, b_at, k_base, k.stride(2), keys, c0, head_dim);
                sync_cube();
                product_abt(&sh, a_at, b_at, &mut raw, ty, tx);
                sync_cube();
            }
            rebuild::<F>(
                mask, bias, &refs, &raw, &row_ok, &row_lse, j0, tx, seq_q, seq_k, scale, softcap,
                &drop, &row_pair, &mut p, &mut dfac, &mut z, c,
            );
            // dV takes the weights the forward's `P·V` took: kept and scaled.
            #[unroll]
            for i in 0..2u32 {
                #[unroll]
                for j in 0..2u32 {
                    let at = (i * 2 + j) as usize;
                    sh[(p_at + (2 * ty + i) * LD + tx + GRID * j) as usize] = p[at] * z[at];
                }
            }
            // dP = dO·Vᵀ and dV += Pᵀ·dO, one chunk of dO for both.
            for vc in 0..v_chunks {
                let c0 = col_base + (vc * CHUNK) as usize;
                stage_rows::<F>(
                    d_out, &mut sh, a_at, batch, hkv, group, heads_kv, r0, rows, seq_q, c0,
                    value_dim,
                );
                stage::<F>(v, &mut sh, b_at, v_base, v.stride(2), keys, c0, value_dim);
                sync_cube();
                if comptime!(!given) {
                    product_abt(&sh, a_at, b_at, &mut dp, ty, tx);
                }
                product_atb(&sh, p_at, a_at, &mut acc_dv, (vc * 4) as usize, ty, tx);
                sync_cube();
            }
            // dR = P ⊙ (dP − δ) ⊙ softcap' (given scores: no dK)
            if comptime!(!given) {
                #[unroll]
                for i in 0..2u32 {
                    #[unroll]
                    for j in 0..2u32 {
                        let at = (i * 2 + j) as usize;
                        let ds = p[at] * (dp[at] * z[at] - row_delta[i as usize]) * dfac[at];
                        sh[(ds_at + (2 * ty + i) * LD + tx + GRID * j) as usize] = ds;
                    }
                }
            }
            // dK += dRᵀ·Q
            for dc in 0..d_chunks {
                let c0 = (dc * CHUNK) as usize;
                stage_rows::<F>(
                    q, &mut sh, a_at, batch, hkv, group, heads_kv, r0, rows, seq_q, c0, head_dim,
                );
                sync_cube();
                product_atb(&sh, ds_at, a_at, &mut acc_dk, (dc * 4) as usize, ty, tx);
                sync_cube();
            }
        }
    }

    // Unit (ty, tx) owns keys j0 + 2·ty + i, columns tx + 16·j of every chunk.
    #[unroll]
    for i in 0..2u32 {
        let key = j0 + (2 * ty + i) as usize;
        if key < seq_k {
            let dk_base = row_at(dk, batch, hkv, key);
            let dv_base = row_at(dv, batch, hkv, key);
            #[unroll]
            for dc in 0..comptime!(if given { 0 } else { d_chunks }) {
                #[unroll]
                for j in 0..2u32 {
                    let col = (dc * CHUNK + tx + GRID * j) as usize;
                    if col < head_dim {
                        let val = scale * acc_dk[(dc * 4 + i * 2 + j) as usize];
                        dk[dk_base + col * dk.stride(3)] = F::cast_from(val);
                    }
                }
            }
            #[unroll]
            for vc in 0..v_chunks {
                #[unroll]
                for j in 0..2u32 {
                    let col = col_base + (vc * CHUNK + tx + GRID * j) as usize;
                    if col < value_dim {
                        let val = acc_dv[(vc * 4 + i * 2 + j) as usize];
                        dv[dv_base + col * dv.stride(3)] = F::cast_from(val);
                    }
                }
            }
        }
    }
}

/// `dQ` of one block of [`BLOCK_ROWS`] query rows (module docs), and with `write_ds` the
/// score gradient `dS` of every (row, key) into `ds` (`[B, Hq, Sq, Sk]`: what a bias's
/// gradient is made of; with given scores, `dX`, and no `dQ`). Grid: `(row blocks of G·Sq, y, z)`, `y·z ≥ B·Hkv`; [`UNITS`] units.
#[cube(launch_unchecked)]
// A comptime `if` stays apart from the runtime one inside it: joined, the branch would be
// expanded when `write_ds` is off too.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_dq<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    ds: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    inv_keep: f32,
    #[comptime] c: FlashConfig,
    #[comptime] write_ds: bool,
    #[define(F)] _dtype: StorageType,
) {
    let d_chunks = comptime!(c.head_dim / CHUNK);
    let (a_at, b_at, ds_at) = (0u32, TILE, 3 * TILE);
    let given = comptime!(c.given());
    let mut heads_kv = k.shape(1);
    let mut seq_k = k.shape(2);
    if comptime!(given) {
        // The scores `X` stand in for the queries: `[B, H, Sq, Sk]`.
        heads_kv = v.shape(1);
        seq_k = q.shape(3);
    }
    let seq_q = q.shape(2);
    let head_dim = q.shape(3);
    let value_dim = v.shape(3);
    let group = q.shape(1) / heads_kv;
    let rows = group * seq_q;
    let pair = pair_index();
    if pair >= q.shape(0) * heads_kv {
        terminate!();
    }
    let (batch, hkv) = (pair / heads_kv, pair % heads_kv);
    let head0 = hkv * group;
    let r0 = (CUBE_POS_X * BLOCK_ROWS) as usize;
    let last = usize::min(r0 + BLOCK_ROWS as usize, rows) - 1;
    let mut kv_end = seq_k;
    if comptime!(c.causal) {
        let pos_hi = select(r0 / seq_q == last / seq_q, last % seq_q, seq_q - 1);
        kv_end = causal_end(pos_hi, seq_q, seq_k);
    }
    let ty = UNIT_POS / GRID;
    let tx = UNIT_POS % GRID;

    let mut sh = SharedMemory::<f32>::new(comptime!((4 * TILE) as usize));
    let mut acc = Array::<f32>::new(comptime!((d_chunks * 4).max(1) as usize));
    #[unroll]
    for n in 0..comptime!((d_chunks * 4) as usize) {
        acc[n] = 0.0f32;
    }
    let mut refs = new_refs(2usize);
    let mut row_ok = Array::<bool>::new(2usize);
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_delta = Array::<f32>::new(2usize);
    let mut row_ds = Array::<usize>::new(2usize);
    let mut row_pair = Array::<usize>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        let row = r0 + (2 * ty) as usize + i;
        set_row::<F>(&mut refs, i, mask, bias, batch, head0, row, rows, seq_q, c);
        let rr = usize::min(row, rows - 1);
        let head = head0 + rr / seq_q;
        let pos = rr % seq_q;
        row_ok[i] = row < rows;
        row_lse[i] = lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
        row_delta[i] = delta[(batch * q.shape(1) + head) * seq_q + pos];
        row_ds[i] = row_at(ds, batch, head, pos);
        row_pair[i] = batch * q.shape(1) + head;
    }
    let mut raw = Array::<f32>::new(4usize);
    let mut dp = Array::<f32>::new(4usize);
    let mut p = Array::<f32>::new(4usize);
    let mut dfac = Array::<f32>::new(4usize);
    let mut z = Array::<f32>::new(4usize);
    let drop = Dropout {
        seed_lo,
        seed_hi,
        threshold,
        inv_keep,
    };

    let steps = kv_end.div_ceil(BLOCK_KEYS as usize);
    for st in 0..steps {
        let j0 = st * BLOCK_KEYS as usize;
        let keys = usize::min(seq_k - j0, BLOCK_KEYS as usize);
        let k_base = row_at(k, batch, hkv, j0);
        let v_base = row_at(v, batch, hkv, j0);
        #[unroll]
        for n in 0..4usize {
            raw[n] = 0.0f32;
            dp[n] = 0.0f32;
        }
        if comptime!(given) {
            read_scores::<F>(
                q, &mut raw, batch, hkv, group, heads_kv, r0, rows, seq_q, j0, seq_k, ty, tx,
            );
        }
        for dc in 0..d_chunks {
            let c0 = (dc * CHUNK) as usize;
            stage_rows::<F>(
                q, &mut sh, a_at, batch, hkv, group, heads_kv, r0, rows, seq_q, c0, head_dim,
            );
            stage::<F>(k, &mut sh, b_at, k_base, k.stride(2), keys, c0, head_dim);
            sync_cube();
            product_abt(&sh, a_at, b_at, &mut raw, ty, tx);
            sync_cube();
        }
        // Over all of `Dv` (`c.value_dim` is a column tile of `dV` only).
        for vc in 0..value_dim.div_ceil(CHUNK as usize) {
            let c0 = vc * CHUNK as usize;
            stage_rows::<F>(
                d_out, &mut sh, a_at, batch, hkv, group, heads_kv, r0, rows, seq_q, c0, value_dim,
            );
            stage::<F>(v, &mut sh, b_at, v_base, v.stride(2), keys, c0, value_dim);
            sync_cube();
            product_abt(&sh, a_at, b_at, &mut dp, ty, tx);
            sync_cube();
        }
        rebuild::<F>(
            mask, bias, &refs, &raw, &row_ok, &row_lse, j0, tx, seq_q, seq_k, scale, softcap,
            &drop, &row_pair, &mut p, &mut dfac, &mut z, c,
        );
        #[unroll]
        for i in 0..2u32 {
            #[unroll]
            for j in 0..2u32 {
                let at = (i * 2 + j) as usize;
                let g = p[at] * (dp[at] * z[at] - row_delta[i as usize]);
                let key = j0 + (tx + GRID * j) as usize;
                if comptime!(write_ds) {
                    if row_ok[i as usize] && key < seq_k {
                        let mut val = g;
                        if comptime!(given && crate::mutation::zero_dx()) {
                            val = 0.0f32;
                        }
                        ds[row_ds[i as usize] + key * ds.stride(3)] = F::cast_from(val);
                    }
                }
                sh[(ds_at + (2 * ty + i) * LD + tx + GRID * j) as usize] = g * dfac[at];
            }
        }
        // dQ += dR·K (given scores: `dS` is the result)
        for dc in 0..comptime!(if given { 0 } else { d_chunks }) {
            let c0 = (dc * CHUNK) as usize;
            stage::<F>(k, &mut sh, b_at, k_base, k.stride(2), keys, c0, head_dim);
            sync_cube();
            product_ab(&sh, ds_at, b_at, &mut acc, (dc * 4) as usize, ty, tx);
            sync_cube();
        }
    }
    // Keys past the causal diagonal of every row: dS = 0 there.
    if comptime!(write_ds) {
        let from = steps * BLOCK_KEYS as usize;
        #[unroll]
        for i in 0..2usize {
            if row_ok[i] {
                let mut key = from + UNIT_POS as usize % GRID as usize;
                while key < seq_k {
                    ds[row_ds[i] + key * ds.stride(3)] = F::cast_from(0.0f32);
                    key += GRID as usize;
                }
            }
        }
    }

    #[unroll]
    for i in 0..comptime!(if given { 0u32 } else { 2u32 }) {
        let row = r0 + (2 * ty + i) as usize;
        if row < rows {
            let head = head0 + row / seq_q;
            let base = row_at(dq, batch, head, row % seq_q);
            #[unroll]
            for dc in 0..d_chunks {
                #[unroll]
                for j in 0..2u32 {
                    let col = (dc * CHUNK + tx + GRID * j) as usize;
                    if col < head_dim {
                        let mut val = scale * acc[(dc * 4 + i * 2 + j) as usize];
                        if comptime!(crate::mutation::zero_dq()) {
                            val = 0.0f32;
                        }
                        dq[base + col * dq.stride(3)] = F::cast_from(val);
                    }
                }
            }
        }
    }
}

/// A tensor of a backward launch, as the kernels index it: its buffer, shape and strides
/// (zeros along broadcast dimensions).
#[derive(Debug, Clone)]
pub struct Operand {
    /// The buffer.
    pub handle: cubecl::server::Handle,
    /// The shape the kernels see.
    pub shape: Vec<usize>,
    /// The strides the kernels use.
    pub strides: Vec<usize>,
}

impl Operand {
    pub(crate) fn arg<R: Runtime>(&self) -> TensorArg<R> {
        // SAFETY: the shape and strides describe the buffer (the launcher's caller's contract);
        // zero strides only make every index along them read the same element.
        unsafe {
            TensorArg::from_raw_parts(
                self.handle.clone(),
                self.strides.clone().into(),
                self.shape.clone().into(),
            )
        }
    }
}

/// The tensors of [`launch_backward`], 4-D in attention's terms (given scores: `x` as `q` and
/// `k`, `dX` as `ds`, stand-ins for what the configuration never reads or writes).
#[derive(Debug, Clone)]
pub struct BackwardOperands {
    pub q: Operand,
    pub k: Operand,
    pub v: Operand,
    pub mask: Operand,
    pub bias: Operand,
    pub out: Operand,
    pub d_out: Operand,
    pub lse: Operand,
    pub dq: Operand,
    pub dk: Operand,
    pub dv: Operand,
    pub ds: Operand,
}

/// `B·Hkv` (`pairs`) over the grid's y and z axes, as [`flash_backward_dkv()`] and
/// [`flash_backward_dq()`] read it (`z·count_y + y`).
pub fn fold_pairs(pairs: usize, max_y: u32) -> (usize, usize) {
    let y = pairs.clamp(1, max_y as usize);
    (y, pairs.div_ceil(y).max(1))
}

/// Runs the backward: `δ` ([`flash_delta()`], into a scratch of one f32 per query row), then
/// [`flash_backward_dkv()`] on `dkv_cubes` (none: not launched) and [`flash_backward_dq()`]
/// on `dq_cubes` (none: not launched). `rows` is the number of query rows, `B·Hq·Sq`.
///
/// # Safety
/// The operands' shapes and strides describe their buffers, the grids are the kernels' (key
/// blocks × column tiles, row blocks; pairs folded by [`fold_pairs`]), and `c` is a
/// configuration the kernels take (chunks of [`CHUNK`]).
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    t: &BackwardOperands,
    rows: usize,
    dkv_cubes: Option<(usize, usize, usize)>,
    dq_cubes: Option<(usize, usize, usize)>,
    scale: f32,
    softcap: f32,
    dropout: crate::dropout::DropoutParams,
    c: FlashConfig,
    write_ds: bool,
    dtype: StorageType,
) {
    // SAFETY: the caller's (below).
    let delta = unsafe { launch_delta(client, &t.out, &t.d_out, rows, dtype) };
    let count =
        |c: (usize, usize, usize)| cubecl::CubeCount::Static(c.0 as u32, c.1 as u32, c.2 as u32);
    let units = cubecl::CubeDim::new_1d(UNITS);
    let d = dropout;
    // SAFETY: the caller's (above).
    unsafe {
        if let Some(cubes) = dkv_cubes {
            flash_backward_dkv::launch_unchecked::<R>(
                client,
                count(cubes),
                units,
                t.q.arg(),
                t.k.arg(),
                t.v.arg(),
                t.mask.arg(),
                t.bias.arg(),
                t.d_out.arg(),
                t.lse.arg(),
                delta.arg(),
                t.dk.arg(),
                t.dv.arg(),
                scale,
                softcap,
                d.seed_lo,
                d.seed_hi,
                d.threshold,
                d.inv_keep(),
                c,
                dtype,
            );
        }
        if let Some(cubes) = dq_cubes {
            flash_backward_dq::launch_unchecked::<R>(
                client,
                count(cubes),
                units,
                t.q.arg(),
                t.k.arg(),
                t.v.arg(),
                t.mask.arg(),
                t.bias.arg(),
                t.d_out.arg(),
                t.lse.arg(),
                delta.arg(),
                t.dq.arg(),
                t.ds.arg(),
                scale,
                softcap,
                d.seed_lo,
                d.seed_hi,
                d.threshold,
                d.inv_keep(),
                c,
                write_ds,
                dtype,
            );
        }
    }
}

/// `δ = rowsum(dO ⊙ O)` of the `rows` query rows of `out` and `d_out` (4-D, `[B, H, Sq, Dv]`)
/// into a new contiguous f32 buffer of `rows` elements (row `(b·H + h)·Sq + i`), returned.
///
/// # Safety
/// The operands' shapes and strides describe their buffers.
pub unsafe fn launch_delta<R: Runtime>(
    client: &ComputeClient<R>,
    out: &Operand,
    d_out: &Operand,
    rows: usize,
    dtype: StorageType,
) -> Operand {
    let delta = Operand {
        handle: client.empty(rows.max(1) * 4),
        shape: vec![rows.max(1)],
        strides: vec![1],
    };
    let cubes = rows.div_ceil(DELTA_ROWS as usize).max(1);
    let x = cubes.min(65535);
    if rows > 0 {
        // SAFETY: the caller's; every index is bounds-checked against `out`'s shape.
        unsafe {
            flash_delta::launch_unchecked::<R>(
                client,
                cubecl::CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1),
                cubecl::CubeDim::new_1d(32 * DELTA_ROWS),
                d_out.arg(),
                out.arg(),
                delta.arg(),
                dtype,
            );
        }
    }
    delta
}
