//! The flash backward on the matrix units (f16/bf16, `mma` m16n8k16 with f32 accumulators,
//! `ldmatrix`; CUDA sm_80+): the schedule of [`super::backward`] with every product on the
//! matrix units and every intermediate in registers.
//!
//! - [`flash_backward_dq_mma()`]: a cube owns [`DQ_ROWS`] query rows (a plane 16; given
//!   scores: [`WIDE_DX_ROWS`] where they fit, `softmax_matmul::mma_dx_rows`), their `Q`
//!   and `dO` tiles staged once; per block of keys it stages `K` and `V`, computes `S = Q·Kᵀ`
//!   and `dP = dO·Vᵀ` into accumulator fragments, turns them into `dS` (the forward's score
//!   rules, `P = e^(S − lse)`, `dS = P ⊙ (dP − δ)`, the softcap's derivative, the scale) in
//!   registers, and `dQ += dS·K` takes `dS` as its `A` operand straight from those registers
//!   (the accumulator fragments of two adjacent 8-key tiles are the `A` fragment of their 16
//!   keys, as `P` is in the forward) and `K` by `ldmatrix.trans`.
//! - [`flash_backward_dkv_mma()`]: a cube owns [`DKV_KEYS`] keys (a plane 16), their `K` and
//!   `V` tiles staged once; per block of query rows (the group's query heads, summed in the
//!   kernel) it stages `Q`, `dO`, `lse` and `δ`, computes the transposed scores `Sᵀ = K·Qᵀ`
//!   and `dPᵀ = V·dOᵀ`, so that `Pᵀ` and `dSᵀ` are `A` fragments in registers for
//!   `dV += Pᵀ·dO` and `dK += dSᵀ·Q` (`dO`, `Q` by `ldmatrix.trans`).
//!
//! - With `fused_dq` ([`dq_split()`] decides where it applies), the dK/dV kernel also computes
//!   `dQ`, FlashAttention-2's way: each step's `dS` (the transpose of its `dSᵀ` fragments) goes
//!   to shared memory, the planes compute `dQ += dS·K` of the step's query rows over the cube's
//!   keys, each plane a slice, and add it to an f32 accumulator `[B, Hq, Sq, D]` in global
//!   memory with atomics ([`flash_dq_accum()`] zeroes it before and converts it into `dQ`
//!   after). Five products per step instead of seven over the two kernels, at the cost of the
//!   atomics and an f32 scratch of `dQ`'s size.
//!
//! Both kernels apply the forward's score rules ([`super::scores`]): scale, softcap, the bool
//! mask, causal (bottom-right), the additive bias. The dQ kernel, whose fragments hold rows of
//! scores, reads them with the forward's per-row references and writes `dS` (a tracked bias's
//! gradient) where asked; the dK/dV kernel, whose fragments hold columns, reads each query
//! row's head and position from shared memory, staged with the row's `lse` and `δ`.
//!
//! **Given scores** (`softmax_matmul`'s backward, [`ScoreSource::Given`]): `X` stands in for
//! `Q` and the same two kernels skip what has no meaning without `Q` and `K`.
//! - The dQ kernel becomes the `dX` kernel: each lane reads its rows' scores from `X` as
//!   16-byte vectors (8 consecutive keys per quad member, the forward's
//!   `load_scores`, the next step's in flight), `V`'s rows are staged in the
//!   matching operand order (`key_of`), and `dS = P ⊙ (dP − δ)` is stored as
//!   `dX`; no `dQ`. It holds all of `Dv` (the plan checks that `dO` and two steps of `V` fit).
//! - The dK/dV kernel stages the block's `X` columns of its keys in place of `Q` and takes
//!   `Pᵀ` straight from them (`ldmatrix.trans`); no `dP`, no `dK`. `Dv` of any width is
//!   split into column tiles of [`GIVEN_COL_TILE`] over the grid.
//!
//! **Dropout** (computed scores): both kernels draw the forward's mask again
//! ([`crate::dropout::keep_weight()`], keyed by each weight's (batch, query head, position,
//! key)): `dV += (P ⊙ Z)ᵀ·dO` and `dS = P ⊙ (dP ⊙ Z − δ)`, as in [`super::backward`].
//!
//! Scope (the plans send the rest to the plain-unit kernels): `D`, `Dv` up to 128 with
//! computed scores; 16-byte aligned rows of `q` (`X`), `k`, `v` and `dO`.

use cubecl::{
    cmma::MmaDefinition,
    ir::{FastMath, MatrixIdent},
    prelude::barrier::Barrier,
    prelude::*,
};

use super::FlashConfig;
#[cfg(doc)]
use super::ScoreSource;
use super::backward::{Dropout, cube_count, pair_index, row_of_group};
use super::mma::{CHUNK, NV8, key_of, load_scores, stage_rows, step_scores};
use super::scores::{add_bias, capped, causal_end, filled, live_score, new_refs, set_row, visible};
use crate::dropout::keep_weight;
use crate::fragment::{MMA_M, MMA_N, PLANE, V_PAD, load_b_pair, mma_v_pair, zero_accumulators};
use crate::staging::{commit_next, copy_vec, wait_step};

/// Planes per cube of both kernels.
pub const PLANES: u32 = 4;
/// Query rows per cube of [`flash_backward_dq_mma()`] (attention's, and given scores' where
/// [`WIDE_DX_ROWS`] does not fit).
pub const DQ_ROWS: u32 = PLANES * MMA_M;
/// Rows per cube of the `dX` kernel (given scores) where its shared memory fits: 8 planes share
/// each `V` block, twice the warps of [`DQ_ROWS`] on a multiprocessor that holds one cube (the
/// `dO` tile of all of `Dv` and two `V` blocks: 133 KB at `Dv` 512 with 64 rows, 200 KB with
/// 128).
pub const WIDE_DX_ROWS: u32 = 2 * DQ_ROWS;
/// Keys per cube of [`flash_backward_dkv_mma()`].
pub const DKV_KEYS: u32 = PLANES * MMA_M;
/// Largest head dim (`D` and `Dv`) the kernels take (their accumulators' registers).
pub const MAX_DIM: u32 = 128;

/// Columns of `dV` one cube of the dK/dV kernel holds with given scores: `Dv` (`d3` of
/// `softmax_matmul`, any size) is split into column tiles of this along the grid's x axis.
pub const GIVEN_COL_TILE: u32 = MAX_DIM;

/// The dK/dV kernel's configuration for `c` (the dQ kernel's but for `block_q`): with given
/// scores, a column tile of `Dv` ([`GIVEN_COL_TILE`]) instead of all of it.
pub fn dkv_config(c: FlashConfig) -> FlashConfig {
    FlashConfig {
        block_q: DKV_KEYS,
        value_dim: if c.given() {
            c.value_dim.min(GIVEN_COL_TILE)
        } else {
            c.value_dim
        },
        ..c
    }
}

/// Cubes along x of the dK/dV kernel for `seq_k` keys and `value_dim` columns of `dV`: key
/// blocks, times `Dv`'s column tiles with given scores.
pub fn dkv_blocks(seq_k: usize, value_dim: usize, given: bool) -> usize {
    let tiles = if given {
        value_dim.div_ceil(GIVEN_COL_TILE as usize).max(1)
    } else {
        1
    };
    seq_k.div_ceil(DKV_KEYS as usize) * tiles
}

/// Row pitch, in elements, of the shared `dS` tile of the fused `dQ` (16-byte rows, and 8 rows
/// of an `ldmatrix` on distinct banks).
const DS_LD: u32 = DKV_KEYS + V_PAD;

/// How the 4 planes share a step's `dQ` tile in the fused schedule (`step` query rows by `d`
/// columns, both multiples of 16): `(row groups, column groups)` with product 4, each plane
/// taking whole 16-row tiles and whole pairs of 8-column tiles; `None` where no split is even
/// (`d` of 80 or 112 at 32-row steps).
pub fn dq_split(step: u32, d: u32) -> Option<(u32, u32)> {
    let (tiles, pairs) = (step / MMA_M, d / 16);
    if tiles.is_multiple_of(4) {
        Some((4, 1))
    } else if tiles.is_multiple_of(2) && pairs.is_multiple_of(2) {
        Some((2, 2))
    } else if pairs.is_multiple_of(4) {
        Some((1, 4))
    } else {
        None
    }
}

/// Keys (dQ kernel) or query rows (dK/dV kernel) per step for head dims `d`, `dv` (rounded
/// up to 16): 32 at every head dim. Measured on an H100 (bf16, S 4096, fwd+bwd device
/// TFLOP/s; NOTES.md, session 12): at D 64, 32-row steps beat 64-row ones (161.4 / 131.3
/// causal against 158.5 / 119.1: fewer live score fragments per step) and 16-row ones (157.2
/// / 120.5); at D 128, 32 beats 16 (173.5 / 143.4 against 149.2 / 121.9).
pub fn step_len(_d: u32, _dv: u32) -> u32 {
    32
}

/// Shared memory of the dQ kernel (`c.block_q` rows, `c.block_k` keys per step), in bytes:
/// the `Q` and `dO` tiles and two buffers of `K` and `V` (given scores: `dO` and `V` only).
pub fn dq_shared_bytes(c: FlashConfig) -> usize {
    let d = if c.given() {
        0
    } else {
        (c.head_dim + V_PAD) as usize
    };
    let dv = (c.value_dim + V_PAD) as usize;
    (c.block_q as usize + 2 * c.block_k as usize) * (d + dv) * 2
}

/// Shared memory of the dK/dV kernel ([`DKV_KEYS`] keys, `c.block_k` query rows per step), in
/// bytes: the `K` and `V` tiles and two buffers of `Q` and `dO` (given scores: two buffers of
/// the `X` block and of `dO`'s column tile).
pub fn dkv_shared_bytes(c: FlashConfig, fused_dq: bool) -> usize {
    let (bk, keys, pad) = (c.block_k as usize, DKV_KEYS as usize, V_PAD as usize);
    let (d, dv) = (c.head_dim as usize + pad, c.value_dim as usize + pad);
    let tiles = if c.given() {
        2 * bk * (keys + pad + dv)
    } else {
        (keys + 2 * bk) * (d + dv)
    };
    let ds = if fused_dq { bk * DS_LD as usize } else { 0 };
    // lse, δ and (with a mask, bias or dropout) each row's head and position, in two buffers.
    let rows = if c.mask || c.bias || c.dropout { 8 } else { 4 };
    (tiles + ds) * 2 + rows * bk * 4
}

/// Width, in elements, of the rows the dK/dV kernel stages per step in place of `Q`: the head
/// dim, or with given scores the `X` block's [`DKV_KEYS`] keys.
fn step_width(c: FlashConfig) -> u32 {
    if c.given() { DKV_KEYS } else { c.head_dim }
}

/// Synchronous copies of `n_rows × width` elements into `dst` (row pitch `width + V_PAD`):
/// tile row `r` is query row `r0 + r` of the group of key/value head `head0 / G` (head
/// `head0 + row / Sq`, position `row % Sq`), zeros past `rows` and `cols`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_rows<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    batch: usize,
    head0: usize,
    r0: usize,
    rows: usize,
    seq_q: usize,
    cols: usize,
    #[comptime] n_rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let per_row = comptime!(width as usize / NV8);
    let ldv = comptime!((width + V_PAD) as usize / NV8);
    let total = comptime!(n_rows as usize * per_row);
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units as usize)) {
        let idx = UNIT_POS as usize + e * units as usize;
        if idx < total {
            let (r, cv) = (idx / per_row, idx % per_row);
            let row = r0 + r;
            let col = cv * NV8;
            let rr = usize::min(row, rows - 1);
            let src = batch * t.stride(0)
                + (head0 + rr / seq_q) * t.stride(1)
                + (rr % seq_q) * t.stride(2)
                + col;
            let mut val = Vector::<F, NV>::new(F::from_int(0));
            if row < rows && col < cols {
                val = t[src / NV8];
            }
            dst[r * ldv + cv] = val;
        }
    }
}

/// Asynchronous copies (`cp.async`) of `n_rows × width` elements, columns `col0..`, into
/// `dst` at `buf`, tile row `r` being query row `r0 + r` of the group as in
/// [`stage_query_rows()`]; zeros past `rows` and `cols`. `(h0, p0)` is `r0`'s (head, position),
/// `(r0 / Sq, r0 % Sq)`: a block inside one head (the common case) addresses its rows from
/// them, without a division per vector.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_rows_async<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    buf: usize,
    batch: usize,
    head0: usize,
    r0: usize,
    h0: usize,
    p0: usize,
    rows: usize,
    seq_q: usize,
    col0: usize,
    cols: usize,
    #[comptime] n_rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let per_row = comptime!(width as usize / NV8);
    let ldv = comptime!((width + V_PAD) as usize / NV8);
    let total = comptime!(n_rows as usize * per_row);
    // Every row of the block is a row of head `h0` (so none is past `rows`, a multiple of Sq).
    let inside = p0 + n_rows as usize <= seq_q;
    let row_stride = t.stride(2);
    // (Expanded at comptime: without the mutation, only the second branch exists.)
    let lead = if comptime!(crate::mutation::stage_head_start()) {
        batch * t.stride(0) + (head0 + h0) * t.stride(1)
    } else {
        batch * t.stride(0) + (head0 + h0) * t.stride(1) + p0 * row_stride
    };
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units as usize)) {
        let idx = UNIT_POS as usize + e * units as usize;
        if idx < total {
            let (r, cv) = (idx / per_row, idx % per_row);
            let col = col0 + cv * NV8;
            let mut src = lead + r * row_stride + col;
            let mut ok = col < cols;
            if !inside {
                let row = r0 + r;
                let rr = usize::min(row, rows - 1);
                src = batch * t.stride(0)
                    + (head0 + rr / seq_q) * t.stride(1)
                    + (rr % seq_q) * row_stride
                    + col;
                ok = ok && row < rows;
            }
            copy_vec::<F, NV>(t, dst, select(ok, src / NV8, 0), buf + r * ldv + cv, ok);
        }
    }
}

/// Stages one block of `c.block_k` query rows `r0..` into buffer `buf` (0 or 1) of the dK/dV
/// kernel: `Q` (given scores: `X`'s columns `key0..key0 + DKV_KEYS`) and `dO` (columns
/// `o_col0..`) asynchronously, `lse` (`f32::MAX` for a row past the end or without a visible
/// key, so that its `P` is 0) and `δ` by plain stores into `stat_s`, and with a mask or bias
/// each row's head and position into `row_s`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_block<F: Float, NV: Size>(
    q: &Tensor<Vector<F, NV>>,
    d_out: &Tensor<Vector<F, NV>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    q_s: &mut SharedMemory<Vector<F, NV>>,
    o_s: &mut SharedMemory<Vector<F, NV>>,
    stat_s: &mut SharedMemory<f32>,
    row_s: &mut SharedMemory<u32>,
    buf: usize,
    batch: usize,
    head0: usize,
    r0: usize,
    rows: usize,
    seq_q: usize,
    q_col0: usize,
    q_cols: usize,
    o_col0: usize,
    o_cols: usize,
    #[comptime] c: FlashConfig,
    #[comptime] units: u32,
) {
    let bq = comptime!(c.block_k as usize);
    let q_len = comptime!(bq * (step_width(c) + V_PAD) as usize / NV8);
    let o_len = comptime!(bq * (c.value_dim + V_PAD) as usize / NV8);
    // The block's first row's (head, position): one division per block, not per vector.
    let (h0, p0) = (r0 / seq_q, r0 % seq_q);
    stage_query_rows_async::<F, NV>(
        q,
        q_s,
        buf * q_len,
        batch,
        head0,
        r0,
        h0,
        p0,
        rows,
        seq_q,
        q_col0,
        q_cols,
        c.block_k,
        comptime!(step_width(c)),
        units,
    );
    stage_query_rows_async::<F, NV>(
        d_out,
        o_s,
        buf * o_len,
        batch,
        head0,
        r0,
        h0,
        p0,
        rows,
        seq_q,
        o_col0,
        o_cols,
        c.block_k,
        c.value_dim,
        units,
    );
    if UNIT_POS < c.block_k {
        let row = r0 + UNIT_POS as usize;
        let mut head = head0 + h0;
        let mut pos = p0 + UNIT_POS as usize;
        if p0 + bq > seq_q {
            let rr = usize::min(row, rows - 1);
            head = head0 + rr / seq_q;
            pos = rr % seq_q;
        }
        let l = lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
        let at = buf * 2 * bq + UNIT_POS as usize;
        stat_s[at] = select(row < rows && l > f32::min_value(), l, f32::max_value());
        stat_s[at + bq] = delta[(batch * q.shape(1) + head) * seq_q + pos];
        if comptime!(c.mask || c.bias || c.dropout) {
            row_s[at] = head as u32;
            row_s[at + bq] = pos as u32;
        }
    }
}

/// Synchronous copies of `n_rows × width` elements of rows `j0..` of one (batch, head) of `t`
/// (offset `base`) into `dst`, zeros past `valid` rows and `cols` columns.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_key_rows<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    base: usize,
    j0: usize,
    valid: usize,
    cols: usize,
    #[comptime] n_rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let per_row = comptime!(width as usize / NV8);
    let ldv = comptime!((width + V_PAD) as usize / NV8);
    let total = comptime!(n_rows as usize * per_row);
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units as usize)) {
        let idx = UNIT_POS as usize + e * units as usize;
        if idx < total {
            let (r, cv) = (idx / per_row, idx % per_row);
            let row = j0 + r;
            let col = cv * NV8;
            let mut val = Vector::<F, NV>::new(F::from_int(0));
            if row < valid && col < cols {
                val = t[(base + row * t.stride(2) + col) / NV8];
            }
            dst[r * ldv + cv] = val;
        }
    }
}

/// `acc[nt] += A·B` over `k_steps·16` reduction indices for `n_pairs·2` output tiles of 8
/// columns: `A` is given as one `mma` `A` fragment per 16 reduction indices (`a[kc]`), `B` is
/// read from `b_s` at `b_buf` (rows = reduction index, pitch `ldv` vectors) by
/// `ldmatrix.x4.trans`.
#[cube]
fn product_trans<F: Float, NV: Size>(
    a: &Sequence<Array<Vector<F, Const<2>>>>,
    b_s: &SharedMemory<Vector<F, NV>>,
    b_buf: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] ldv: usize,
    #[comptime] k_steps: u32,
    #[comptime] n_pairs: u32,
) {
    let lane = UNIT_POS_PLANE;
    let mat = lane / 8;
    let mat_row = lane % 8;
    let b_lane = b_buf + ((mat % 2) * 8 + mat_row) as usize * ldv + (mat / 2) as usize;
    #[unroll]
    for kc in 0..k_steps {
        let a_kc = a.index(kc as usize);
        #[unroll]
        for np in 0..n_pairs {
            let start = b_lane + comptime!((kc * 16) as usize * ldv + np as usize * 2);
            mma_v_pair::<F, NV>(a_kc, b_s, start, acc, np);
        }
    }
}

/// Stores accumulator tiles `acc` (16 rows of this plane, `tiles` tiles of 8 columns) as
/// `F`: lane `4g + t` holds rows `g`, `g + 8` (`row_at[h]`, skipped unless `row_ok[h]`),
/// columns `8·nt + 2t + n` (up to `cols`).
#[cube]
fn store_tiles<F: Float>(
    out: &mut Tensor<F>,
    acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    row_at: &Array<usize>,
    row_ok: &Array<bool>,
    cols: usize,
    #[comptime] tiles: u32,
    #[comptime] zero: bool,
) {
    let quad = (UNIT_POS_PLANE % 4) as usize;
    #[unroll]
    for nt in 0..tiles {
        let frag = acc.index(nt as usize);
        #[unroll]
        for h in 0..2usize {
            if row_ok[h] {
                let vec = frag[h];
                #[unroll]
                for n in 0..2usize {
                    let col = comptime!((nt * MMA_N) as usize) + quad * 2 + n;
                    if col < cols {
                        let mut val = vec[n];
                        if comptime!(zero) {
                            val = 0.0f32;
                        }
                        let at = row_at[h] + col * out.stride(3);
                        out[at] = F::cast_from(val);
                    }
                }
            }
        }
    }
}

/// The fused `dQ` of one step for this plane (module docs): `acc` gets
/// `dS·K` for its `rts` row tiles from `rt0` and `2·pairs` column tiles from `d0`, the
/// reduction over the cube's [`DKV_KEYS`] keys; `dS` is read from `ds_s` (rows = the step's
/// query rows, pitch [`DS_LD`]) by `ldmatrix`, `K` from `k_s` by `ldmatrix.trans`, each `K`
/// fragment feeding every row tile.
#[cube]
fn fused_dq_step<F: Float, NV: Size>(
    ds_s: &SharedMemory<F>,
    k_s: &SharedMemory<Vector<F, NV>>,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    rt0: usize,
    d0: usize,
    #[comptime] d_ldv: usize,
    #[comptime] rts: u32,
    #[comptime] pairs: u32,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let mat = lane / 8;
    let mat_row = lane % 8;
    // ldmatrix rows of this lane: dS row (matrices 1, 3: + 8), key + 8 for matrices 2, 3;
    // K key (matrices 1, 3: + 8), column + 8 for matrices 2, 3.
    let a_lane = (rt0 * MMA_M as usize + ((mat % 2) * 8 + mat_row) as usize) * DS_LD as usize
        + (mat / 2) as usize * 8;
    let b_lane = ((mat % 2) * 8 + mat_row) as usize * d_ldv + (mat / 2) as usize + d0 / NV8;
    #[unroll]
    for kc in 0..comptime!(DKV_KEYS / 16) {
        let mut a = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for rt in 0..rts {
            let at = a_lane + comptime!((rt * MMA_M * DS_LD + kc * 16) as usize);
            a.push(def.load_matrix::<F, Const<2>>(
                &ds_s.slice(at, at + 1),
                MatrixIdent::A,
                4usize,
                false,
            ));
        }
        #[unroll]
        for np in 0..pairs {
            let start = b_lane + comptime!((kc * 16) as usize * d_ldv + np as usize * 2);
            let b = load_b_pair::<F, NV>(k_s, start, true);
            #[unroll]
            for rt in 0..rts {
                let a_rt = a.index(rt as usize);
                let t = comptime!(rt * 2 * pairs + 2 * np);
                def.execute_inplace(a_rt, b.index(0usize), acc.index_mut(t as usize));
                def.execute_inplace(
                    a_rt,
                    b.index(1usize),
                    acc.index_mut(comptime!(t + 1) as usize),
                );
            }
        }
    }
}

/// Adds the fused `dQ` tiles of [`fused_dq_step()`] to the f32 accumulator `dq_acc`
/// (contiguous `[B, Hq, Sq, D]`, `D` = `d_pitch`): tile row `r` is query row `r0 + r` of the
/// group of head `head0`; rows past `rows` are skipped.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_dq_tiles(
    dq_acc: &mut Tensor<Atomic<f32>>,
    acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    batch: usize,
    heads_q: usize,
    head0: usize,
    r0: usize,
    rows: usize,
    seq_q: usize,
    rt0: usize,
    d0: usize,
    #[comptime] d_pitch: u32,
    #[comptime] rts: u32,
    #[comptime] pairs: u32,
) {
    let lane = UNIT_POS_PLANE;
    let quad = (lane % 4) as usize;
    let g = (lane / 4) as usize;
    #[unroll]
    for rt in 0..rts {
        #[unroll]
        for h in 0..2usize {
            let row = r0 + (rt0 + rt as usize) * MMA_M as usize + g + 8 * h;
            if row < rows {
                let head = head0 + row / seq_q;
                let base = ((batch * heads_q + head) * seq_q + row % seq_q) * d_pitch as usize
                    + d0
                    + quad * 2;
                #[unroll]
                for t in 0..comptime!(2 * pairs) {
                    let vals = acc.index(comptime!(rt * 2 * pairs + t) as usize)[h];
                    #[unroll]
                    for n in 0..2usize {
                        let at = base + comptime!((t * MMA_N) as usize) + n;
                        dq_acc[at].fetch_add(vals[n]);
                    }
                }
            }
        }
    }
}

/// The fused `dQ`'s f32 accumulator (contiguous `[B, Hq, Sq, D]`, `D` = `acc.shape(3)`):
/// zeroed (`convert` false, before [`flash_backward_dkv_mma()`]) or converted into `dq`
/// (`convert`, after). 32 units per row, 8 rows per cube, cubes along x then y (as
/// [`super::backward::flash_delta()`]).
#[cube(launch_unchecked)]
pub fn flash_dq_accum<F: Float>(
    acc: &mut Tensor<f32>,
    dq: &mut Tensor<F>,
    #[comptime] convert: bool,
    #[define(F)] _dtype: StorageType,
) {
    let heads = acc.shape(1);
    let seq_q = acc.shape(2);
    let width = acc.shape(3);
    let rows = acc.shape(0) * heads * seq_q;
    let lane = (UNIT_POS % 32) as usize;
    let r = row_of_group();
    if r < rows {
        let (b, h, p) = (r / (heads * seq_q), (r / seq_q) % heads, r % seq_q);
        let dq_row = b * dq.stride(0) + h * dq.stride(1) + p * dq.stride(2);
        for s in 0..width.div_ceil(32) {
            let col = s * 32 + lane;
            if comptime!(convert) {
                if col < dq.shape(3) {
                    let mut val = acc[r * width + col];
                    if comptime!(crate::mutation::zero_dq()) {
                        val = 0.0f32;
                    }
                    dq[dq_row + col * dq.stride(3)] = F::cast_from(val);
                }
            } else if col < width {
                acc[r * width + col] = 0.0f32;
            }
        }
    }
}

/// `dQ` of `c.block_q` query rows of the group of one (batch, key/value head) (module docs).
/// `c.block_q` = [`DQ_ROWS`] (or [`WIDE_DX_ROWS`] with given scores), `c.block_k` keys per
/// step, `c.head_dim`, `c.value_dim` = `D`, `Dv` rounded up to 16. Grid: `(row blocks of
/// G·Sq, y, z)`, `y·z ≥ B·Hkv` ([`super::backward::fold_pairs`]); one plane per 16 rows.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
// `x` is assigned in both comptime branches; a comptime `if` stays apart from the runtime one
// inside it (joined, the branch would be expanded for computed scores too).
#[allow(clippy::too_many_arguments, unused_assignments, clippy::collapsible_if)]
pub fn flash_backward_dq_mma<F: Float, NV: Size, ND: Size>(
    q: &Tensor<Vector<F, NV>>,
    k: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<Vector<F, NV>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    ds: &mut Tensor<Vector<F, ND>>,
    p_out: &mut Tensor<Vector<F, ND>>,
    scale: f32,
    softcap: f32,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    inv_keep: f32,
    #[comptime] c: FlashConfig,
    #[comptime] write_ds: bool,
    #[comptime] ds_vectors: bool,
    #[comptime] write_p: bool,
    #[define(F)] _dtype: StorageType,
) {
    // One plane per 16 rows: `c.block_q` is [`DQ_ROWS`] or, for given scores, [`WIDE_DX_ROWS`].
    let rows_per_cube = comptime!(c.block_q);
    let units = comptime!(rows_per_cube / MMA_M * PLANE);
    let given = comptime!(c.given());
    let drop = Dropout {
        seed_lo,
        seed_hi,
        threshold,
        inv_keep,
    };
    let chunks = comptime!(c.block_k / CHUNK);
    let d_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let key_tiles = comptime!(c.block_k / MMA_N);
    let cv = comptime!(FlashConfig {
        head_dim: c.value_dim,
        ..c
    });
    let mut heads_kv = k.shape(1);
    let mut seq_k = k.shape(2);
    if comptime!(c.given()) {
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
    let block_step = comptime!(if crate::mutation::dx_narrow_blocks() {
        DQ_ROWS
    } else {
        rows_per_cube
    });
    let r0 = (CUBE_POS_X * block_step) as usize;
    let last = usize::min(r0 + rows_per_cube as usize, rows) - 1;
    let mut kv_end = seq_k;
    if comptime!(c.causal) {
        let pos_hi = select(r0 / seq_q == last / seq_q, last % seq_q, seq_q - 1);
        kv_end = causal_end(pos_hi, seq_q, seq_k);
    }
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
            batch,
            head0,
            r0,
            rows,
            seq_q,
            head_dim,
            rows_per_cube,
            c.head_dim,
            units,
        );
    }
    stage_query_rows::<F, NV>(
        d_out,
        &mut o_s,
        batch,
        head0,
        r0,
        rows,
        seq_q,
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
    // ([`super::mma::load_scores()`]: 8 consecutive keys per chunk).
    let mut x_rows = Array::<usize>::new(2usize);
    let x_len = comptime!(if given { 2 * chunks as usize } else { 1usize });
    let mut xr = Array::<Vector<F, NV>>::new(x_len);
    let mut xn = Array::<Vector<F, NV>>::new(x_len);
    #[unroll]
    for h in 0..2usize {
        let row = r0 + plane as usize * MMA_M as usize + g + 8 * h;
        let rr = usize::min(row, rows - 1);
        let head = head0 + rr / seq_q;
        let pos = rr % seq_q;
        x_rows[h] = batch * q.stride(0) + head * q.stride(1) + pos * q.stride(2);
        row_pair[h] = batch * q.shape(1) + head;
        set_row::<F>(&mut refs, h, mask, bias, batch, head0, row, rows, seq_q, c);
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
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1);
    let bk = comptime!(c.block_k as usize);
    let steps = kv_end.div_ceil(bk);
    let (ks, vs) = (k.stride(2), v.stride(2));
    // K and V blocks stream through two buffers: step j + 1's copies run while step j computes.
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    if comptime!(!given) {
        stage_rows::<F, NV>(
            k, &mut k_s, 0, 0, k_base, ks, kv_end, head_dim, c.block_k, c.head_dim, units, false,
        );
    }
    // Given scores: V's rows in the operand order of the lanes' consecutive keys
    // ([`super::mma::key_of()`]), so that `dP`'s fragments line up with the X vectors.
    stage_rows::<F, NV>(
        v,
        &mut v_s,
        0,
        0,
        v_base,
        vs,
        kv_end,
        value_dim,
        c.block_k,
        c.value_dim,
        units,
        given,
    );
    bar0.commit_copy_async();
    let _token = bar0.arrive();
    if comptime!(given) {
        if steps > 0 {
            load_scores::<F, NV>(q, &mut xr, &x_rows, 0, seq_k, c);
        }
    }
    // The Q and dO tiles (plain stores) are visible to every plane.
    sync_cube();
    for st in 0..steps {
        let j0 = st * bk;
        let parity = st % 2;
        let next = st + 1;
        if next < steps {
            let nb = 1 - parity;
            if comptime!(!given) {
                stage_rows::<F, NV>(
                    k,
                    &mut k_s,
                    nb * k_len,
                    next * bk,
                    k_base,
                    ks,
                    kv_end,
                    head_dim,
                    c.block_k,
                    c.head_dim,
                    units,
                    false,
                );
            }
            stage_rows::<F, NV>(
                v,
                &mut v_s,
                nb * v_len,
                next * bk,
                v_base,
                vs,
                kv_end,
                value_dim,
                c.block_k,
                c.value_dim,
                units,
                given,
            );
        }
        commit_next(&bar0, &bar1, st);
        if comptime!(given) {
            // The next step's scores (the last step's again at the end: never used).
            let j_next = usize::min(next, steps - 1) * bk;
            load_scores::<F, NV>(q, &mut xn, &x_rows, j_next, seq_k, c);
        }
        wait_step(&bar0, &bar1, st);
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
                        let sc = capped(raw[n as usize], scale, softcap, c);
                        x = add_bias::<F>(bias, &refs, h, sc, key, seq_k, c);
                        x = filled::<F>(mask, &refs, h, x, key, seq_k, c);
                        if comptime!(c.softcap) {
                            let t = sc / softcap;
                            fac = scale * (1.0f32 - t * t);
                        }
                        ok = ok && visible::<F>(mask, &refs, h, key, seq_q, seq_k, c, true);
                    }
                    let p = select(ok, f32::exp(x - row_lse[h]), 0.0f32);
                    let mut dpz = dpv[n as usize];
                    if comptime!(c.dropout) {
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
        // Every plane is done with this buffer before step + 2's copies overwrite it.
        sync_cube();
        if comptime!(given) {
            #[unroll]
            for i in 0..x_len {
                xr[i] = xn[i];
            }
        }
    }
    if steps == 0 {
        // The prologue's copies complete before the cube exits.
        wait_step(&bar0, &bar1, 0);
    }
    if comptime!(write_ds && !ds_vectors) {
        // Keys past the last step (after every row's causal diagonal): dS = 0, each row's by
        // its 4 lanes. (Never with vectors: given scores have no causal end.)
        #[unroll]
        for h in 0..2usize {
            let row = r0 + plane as usize * MMA_M as usize + g + 8 * h;
            if row < rows {
                let mut key = steps * bk + quad;
                while key < seq_k {
                    ds[ds_at[h] + key * ds.stride(3)] = Vector::new(F::cast_from(0.0f32));
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
    q: &Tensor<Vector<F, NV>>,
    k: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<Vector<F, NV>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<f32>>,
    scale: f32,
    softcap: f32,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    inv_keep: f32,
    #[comptime] c: FlashConfig,
    #[comptime] fused_dq: bool,
    #[comptime] p_given: bool,
    #[define(F)] _dtype: StorageType,
) {
    let units = comptime!(PLANES * PLANE);
    let given = comptime!(c.given());
    let drop = Dropout {
        seed_lo,
        seed_hi,
        threshold,
        inv_keep,
    };
    let d_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let x_ldv = comptime!((step_width(c) + V_PAD) as usize / NV8);
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let bq = comptime!(c.block_k as usize);
    // The fused dQ's split of a step's tile over the planes (module docs).
    let row_groups = comptime!(dq_split(c.block_k, c.head_dim).map_or(4, |s| s.0));
    let col_groups = comptime!(dq_split(c.block_k, c.head_dim).map_or(1, |s| s.1));
    let dq_rts = comptime!(c.block_k / MMA_M / row_groups);
    let dq_pairs = comptime!(c.head_dim / 16 / col_groups);
    let ds_len = comptime!(if fused_dq {
        bq * DS_LD as usize
    } else {
        1usize
    });
    // 16-byte aligned: ldmatrix reads its rows.
    let mut ds_s = SharedMemory::<F>::new_aligned(ds_len, 16usize);
    let row_len = comptime!(if c.mask || c.bias || c.dropout {
        4 * bq
    } else {
        1usize
    });
    let mut row_s = SharedMemory::<u32>::new(row_len);
    let q_tiles = comptime!(c.block_k / MMA_N);
    let cv = comptime!(FlashConfig {
        head_dim: c.value_dim,
        ..c
    });
    let mut heads_kv = k.shape(1);
    let mut seq_k = k.shape(2);
    if comptime!(c.given()) {
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
    // The query blocks to visit. Causal with whole blocks per head (`Sq` a multiple of the
    // step): only the blocks whose last position sees the cube's first key, `first..` of each
    // head's; otherwise every block (a causal one past every diagonal computes nothing).
    let blocks = rows.div_ceil(bq);
    let mut per_head = blocks;
    let mut first = 0usize;
    let mut live_per_head = blocks;
    if comptime!(c.causal) {
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
            batch,
            head0,
            r0,
            rows,
            seq_q,
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
    // division: after a head's last live block come the next head's `first` dead ones.
    let mut qb = first;
    let mut rank = 0usize;
    for i in 0..n_live {
        let parity = i % 2;
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
                batch,
                head0,
                nb * bq,
                rows,
                seq_q,
                x_col0,
                x_cols,
                c0,
                value_dim,
                c,
                units,
            );
        }
        commit_next(&bar0, &bar1, i);
        wait_step(&bar0, &bar1, i);
        let r0 = qb * bq;
        let last = usize::min(r0 + bq, rows) - 1;
        // Causal: the block's largest position must see the cube's first key.
        let mut live = true;
        if comptime!(c.causal) {
            let pos_hi = select(r0 / seq_q == last / seq_q, last % seq_q, seq_q - 1);
            live = key0 + seq_q <= pos_hi + seq_k;
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
                        let row = r0 + col;
                        let sc = capped(raw[n], scale, softcap, c);
                        let mut x = sc;
                        let mut fac = scale;
                        if comptime!(c.softcap) {
                            let t = sc / softcap;
                            fac = scale * (1.0f32 - t * t);
                        }
                        let mut ok = key[h] <= key_last;
                        // 0 where a masked key took the fill score (a constant: no dS).
                        let mut gate = 1.0f32;
                        if comptime!(c.mask || c.bias) {
                            // The row's head and position, staged with its lse and δ.
                            let head = row_s[sb + col] as usize;
                            let pos = row_s[sb + bq + col] as usize;
                            let kk = usize::min(key[h], seq_k - 1);
                            if comptime!(c.causal) {
                                ok = ok && key[h] + seq_q <= pos + seq_k;
                            }
                            if comptime!(c.mask) {
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
                            if comptime!(c.bias) {
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
                        if comptime!(c.causal && !(c.mask || c.bias)) {
                            let pos = usize::min(row, rows - 1) % seq_q;
                            ok = ok && key[h] + seq_q <= pos + seq_k;
                        }
                        let p = select(ok, f32::exp(x - stat_s[sb + col]), 0.0f32);
                        let mut z = 1.0f32;
                        if comptime!(c.dropout) {
                            // The forward's mask of this weight: its row's (head, position).
                            let head = row_s[sb + col] as usize;
                            let pos = row_s[sb + bq + col] as usize;
                            z = keep_weight(
                                drop.seed_lo,
                                drop.seed_hi,
                                drop.threshold,
                                drop.inv_keep,
                                batch * q.shape(1) + head,
                                pos,
                                key[h],
                                true,
                            );
                        }
                        pp[n] = F::cast_from(p * z);
                        if comptime!(c.fills() && !crate::mutation::fill_grad()) {
                            fac *= gate;
                        }
                        let ds = F::cast_from(p * (dpv[n] * z - stat_s[sb + bq + col]) * fac);
                        dd[n] = ds;
                        if comptime!(fused_dq) {
                            // dS row `col`, key `16·plane + g + 8h` of the cube.
                            ds_s[col * DS_LD as usize
                                + plane as usize * MMA_M as usize
                                + g
                                + 8 * h] = ds;
                        }
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
            if comptime!(fused_dq) {
                // Every plane's dS is in shared memory.
                sync_cube();
                let rt0 = (plane / col_groups) as usize * dq_rts as usize;
                let d0 = (plane % col_groups) as usize * dq_pairs as usize * 16;
                let mut acc_dq = zero_accumulators(comptime!(dq_rts * 2 * dq_pairs));
                fused_dq_step::<F, NV>(&ds_s, &k_s, &mut acc_dq, rt0, d0, d_ldv, dq_rts, dq_pairs);
                add_dq_tiles(
                    dq_acc,
                    &acc_dq,
                    batch,
                    q.shape(1),
                    head0,
                    r0,
                    rows,
                    seq_q,
                    rt0,
                    d0,
                    c.head_dim,
                    dq_rts,
                    dq_pairs,
                );
            }
        }
        // Every plane is done with this buffer (and dS) before block + 2's copies overwrite it.
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

/// Runs the matrix-unit backward: `δ` ([`super::backward::flash_delta()`]), then
/// [`flash_backward_dkv_mma()`] on `dkv_cubes` and [`flash_backward_dq_mma()`] on `dq_cubes`
/// (none: not launched); with `fused_dq`, `dQ` comes from the dK/dV kernel through an f32
/// accumulator ([`flash_dq_accum()`] on `dq_cubes`, a grid of one row per 32 units).
/// `rows` is the number of query rows, `B·Hq·Sq`; `c` is the dQ kernel's configuration but
/// for `block_q`, which is `dq_rows` ([`DQ_ROWS`], or [`WIDE_DX_ROWS`] for given scores where
/// [`dq_shared_bytes()`] fits; the dK/dV kernel's is [`dkv_config()`]). Given scores
/// (`softmax_matmul`): `t.q` is `X`, `t.ds` its gradient, `write_ds` true.
///
/// # Safety
/// The operands' shapes and strides describe their buffers; the rows of `q`, `k`, `v` and
/// `d_out` are 16-byte aligned (the kernels' vector); the grids are the kernels' (key blocks,
/// times `Dv`'s column tiles of `c.value_dim` for given scores; row blocks of `dq_rows`;
/// pairs folded by [`super::backward::fold_pairs`]).
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_backward_mma<R: Runtime>(
    client: &ComputeClient<R>,
    t: &super::backward::BackwardOperands,
    rows: usize,
    dkv_cubes: Option<(usize, usize, usize)>,
    dq_cubes: Option<(usize, usize, usize)>,
    scale: f32,
    softcap: f32,
    dropout: crate::dropout::DropoutParams,
    c: FlashConfig,
    dq_rows: u32,
    write_ds: bool,
    fused_dq: bool,
    p_buffer: Option<&super::backward::Operand>,
    dtype: StorageType,
) {
    let d = dropout;
    use super::backward::{DELTA_ROWS, Operand, launch_delta};
    // Given scores store `dX` as 16-byte vectors where its rows allow (`dS` of attention, for
    // a tracked bias, an element at a time).
    let ds_vector = if c.given() && write_ds && rows_of_vectors(&t.ds, NV8) {
        NV8
    } else {
        1
    };
    let units = cubecl::CubeDim::new_1d(PLANES * PLANE);
    // SAFETY (every launch below): the caller's.
    unsafe {
        let delta = launch_delta(client, &t.out, &t.d_out, rows, dtype);
        // The fused dQ's f32 accumulator, `[B, Hq, Sq, D]` contiguous (`D` rounded up to 16);
        // without it, `δ` stands in (never read).
        let acc = if fused_dq {
            let (batch, heads_q, seq_q) = (t.q.shape[0], t.q.shape[1], t.q.shape[2]);
            let d16 = c.head_dim as usize;
            Operand {
                handle: client.empty(rows.max(1) * d16 * 4),
                shape: vec![batch, heads_q, seq_q, d16],
                strides: vec![heads_q * seq_q * d16, seq_q * d16, d16, 1],
            }
        } else {
            delta.clone()
        };
        let accum = |cubes, convert: bool| {
            flash_dq_accum::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                cubecl::CubeDim::new_1d(32 * DELTA_ROWS),
                acc.arg(),
                t.dq.arg(),
                convert,
                dtype,
            )
        };
        if let (true, Some(cubes)) = (fused_dq, dq_cubes) {
            accum(cubes, false);
        }
        let launch_dkv = || {
            let Some(cubes) = dkv_cubes else { return };
            flash_backward_dkv_mma::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                units,
                NV8,
                p_buffer.map_or(t.q.arg(), |p| p.arg()),
                t.k.arg(),
                t.v.arg(),
                t.mask.arg(),
                t.bias.arg(),
                t.d_out.arg(),
                t.lse.arg(),
                delta.arg(),
                t.dk.arg(),
                t.dv.arg(),
                acc.arg(),
                scale,
                softcap,
                d.seed_lo,
                d.seed_hi,
                d.threshold,
                d.inv_keep(),
                dkv_config(c),
                fused_dq,
                p_buffer.is_some(),
                dtype,
            );
        };
        let launch_dq = || match (fused_dq, dq_cubes) {
            (true, Some(cubes)) => accum(cubes, true),
            (false, Some(cubes)) => flash_backward_dq_mma::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                cubecl::CubeDim::new_1d(dq_rows / MMA_M * PLANE),
                NV8,
                ds_vector,
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
                p_buffer.map_or(t.ds.arg(), |p| p.arg()),
                scale,
                softcap,
                d.seed_lo,
                d.seed_hi,
                d.threshold,
                d.inv_keep(),
                FlashConfig {
                    block_q: dq_rows,
                    ..c
                },
                write_ds,
                ds_vector == NV8,
                p_buffer.is_some(),
                dtype,
            ),
            (_, None) => {}
        };
        // The P-buffer plan: the dX kernel writes `P`, which the dK/dV kernel then reads.
        if p_buffer.is_some() {
            launch_dq();
            launch_dkv();
        } else {
            launch_dkv();
            launch_dq();
        }
    }
}

/// Whether `t`'s rows are whole, aligned vectors of `n` elements: a contiguous last dimension
/// of a multiple of `n`, and every other stride a multiple of `n`.
fn rows_of_vectors(t: &super::backward::Operand, n: usize) -> bool {
    let d = t.shape.len();
    d > 0
        && t.strides[d - 1] == 1
        && t.shape[d - 1].is_multiple_of(n)
        && t.strides[..d - 1].iter().all(|s| s.is_multiple_of(n))
}

/// Stores the run of [`NV8`] values of `values` from `first` as one vector of `out` at `at`
/// (in vectors), each cast to `F`: a lane's 8 consecutive keys of a chunk (`dX`, and `P` in
/// the P-buffer plan).
#[cube]
fn store_run<F: Float, ND: Size>(
    out: &mut Tensor<Vector<F, ND>>,
    at: usize,
    values: &Array<f32>,
    #[comptime] first: usize,
) {
    let mut o = Vector::<F, ND>::empty();
    #[unroll]
    for e in 0..comptime!(NV8) {
        o[e] = F::cast_from(values[first + e]);
    }
    out[at] = o;
}
