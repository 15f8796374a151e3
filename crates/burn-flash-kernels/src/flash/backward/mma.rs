//! The flash backward on the matrix units (f16/bf16, `mma` m16n8k16 with f32 accumulators,
//! `ldmatrix`; CUDA sm_80+): the schedule of [`crate::flash::backward::units`] with every product on the
//! matrix units and every intermediate in registers.
//!
//! - [`flash_backward_dq_mma()`](fn@super::mma_dq::flash_backward_dq_mma): a cube owns [`DQ_ROWS`] query rows (a plane 16; given
//!   scores: [`WIDE_DX_ROWS`] where they fit, `softmax_matmul::mma_dx_rows`), their `Q`
//!   and `dO` tiles staged once; per block of keys it stages `K` and `V`, computes `S = Q·Kᵀ`
//!   and `dP = dO·Vᵀ` into accumulator fragments, turns them into `dS` (the forward's score
//!   rules, `P = e^(S − lse)`, `dS = P ⊙ (dP − δ)`, the softcap's derivative, the scale) in
//!   registers, and `dQ += dS·K` takes `dS` as its `A` operand straight from those registers
//!   (the accumulator fragments of two adjacent 8-key tiles are the `A` fragment of their 16
//!   keys, as `P` is in the forward) and `K` by `ldmatrix.trans`.
//! - [`flash_backward_dkv_mma()`](fn@super::mma_dkv::flash_backward_dkv_mma): a cube owns [`DKV_KEYS`] keys (a plane 16), their `K` and
//!   `V` tiles staged once; per block of query rows (the group's query heads, summed in the
//!   kernel) it stages `Q`, `dO`, `lse` and `δ`, computes the transposed scores `Sᵀ = K·Qᵀ`
//!   and `dPᵀ = V·dOᵀ`, so that `Pᵀ` and `dSᵀ` are `A` fragments in registers for
//!   `dV += Pᵀ·dO` and `dK += dSᵀ·Q` (`dO`, `Q` by `ldmatrix.trans`).
//!
//! Both kernels apply the forward's score rules ([`crate::flash::scores`]): scale, softcap, the bool
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
//! key)): `dV += (P ⊙ Z)ᵀ·dO` and `dS = P ⊙ (dP ⊙ Z − δ)`, as in [`crate::flash::backward::units`].
//!
//! Scope (the plans send the rest to the plain-unit kernels): `D`, `Dv` up to 128 with
//! computed scores; 16-byte aligned rows of `q` (`X`), `k`, `v` and `dO`.

use cubecl::prelude::*;

use crate::flash::block::QueryGroup;
use crate::flash::config::FlashConfig;
#[cfg(doc)]
use crate::flash::config::ScoreSource;
use crate::flash::forward::mma::NV8;
use crate::fragment::{MMA_M, MMA_N, V_PAD, mma_v_pair};
use crate::staging::copy_vec;

/// Planes per cube of both kernels.
pub const PLANES: u32 = 4;
/// Query rows per cube of [`flash_backward_dq_mma()`](fn@super::mma_dq::flash_backward_dq_mma) (attention's, and given scores' where
/// [`WIDE_DX_ROWS`] does not fit).
pub const DQ_ROWS: u32 = PLANES * MMA_M;
/// Rows per cube of the `dX` kernel (given scores) where its shared memory fits: 8 planes share
/// each `V` block, twice the warps of [`DQ_ROWS`] on a multiprocessor that holds one cube (the
/// `dO` tile of all of `Dv` and two `V` blocks: 133 KB at `Dv` 512 with 64 rows, 200 KB with
/// 128).
pub const WIDE_DX_ROWS: u32 = 2 * DQ_ROWS;
/// Keys per cube of [`flash_backward_dkv_mma()`](fn@super::mma_dkv::flash_backward_dkv_mma).
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

/// Keys (dQ kernel) or query rows (dK/dV kernel) per step for head dims `d`, `dv` (rounded
/// up to 16): 32 at every head dim. A step's score fragments (`S`, `dP`, `Pᵀ`, `dSᵀ`) are what
/// fills the dK/dV kernel's registers; 64- and 16-row steps were slower (RESULTS.md).
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
pub fn dkv_shared_bytes(c: FlashConfig) -> usize {
    let (bk, keys, pad) = (c.block_k as usize, DKV_KEYS as usize, V_PAD as usize);
    let (d, dv) = (c.head_dim as usize + pad, c.value_dim as usize + pad);
    let tiles = if c.given() {
        2 * bk * (keys + pad + dv)
    } else {
        (keys + 2 * bk) * (d + dv)
    };
    // lse, δ and (with a mask, bias or dropout) each row's head and position, in two buffers.
    let rows = if c.rules.mask || c.rules.bias || c.rules.dropout {
        8
    } else {
        4
    };
    tiles * 2 + rows * bk * 4
}

/// Width, in elements, of the rows the dK/dV kernel stages per step in place of `Q`: the head
/// dim, or with given scores the `X` block's [`DKV_KEYS`] keys.
pub(crate) fn step_width(c: FlashConfig) -> u32 {
    if c.given() { DKV_KEYS } else { c.head_dim }
}

/// Synchronous copies of `n_rows × width` elements into `dst` (row pitch `width + V_PAD`):
/// tile row `r` is row `r0 + r` of the [`QueryGroup`], zeros past its rows and `cols`.
#[cube]
pub(crate) fn stage_query_rows<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    group: &QueryGroup,
    r0: usize,
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
            // The clamped row's address outside the branch, so that only the load is
            // conditional and the stride reads stay hoisted out of the unrolled loop.
            let src = group.offset(t, row) + col;
            let mut val = Vector::<F, NV>::new(F::from_int(0));
            if row < group.rows && col < cols {
                val = t[src / NV8];
            }
            dst[r * ldv + cv] = val;
        }
    }
}

/// Asynchronous copies (`cp.async`) of `n_rows × width` elements, columns `col0..`, into
/// `dst` at `buf`, tile row `r` being row `r0 + r` of the [`QueryGroup`] as in
/// [`stage_query_rows()`]; zeros past its rows and `cols`. `(h0, p0)` is `r0`'s (head, position),
/// `(r0 / Sq, r0 % Sq)`: a block inside one head (the common case) addresses its rows from
/// them, without a division per vector.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_query_rows_async<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    buf: usize,
    group: &QueryGroup,
    r0: usize,
    h0: usize,
    p0: usize,
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
    let inside = p0 + n_rows as usize <= group.seq_q;
    let row_stride = t.stride(2);
    let head = group.batch * t.stride(0) + (group.head0 + h0) * t.stride(1);
    // (Expanded at comptime: without the mutation, only the second branch exists.)
    let lead = if comptime!(crate::mutation::stage_head_start()) {
        head
    } else {
        head + p0 * row_stride
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
                src = group.offset(t, row) + col;
                ok = ok && row < group.rows;
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
pub(crate) fn stage_query_block<F: Float, NV: Size>(
    q: &Tensor<Vector<F, NV>>,
    d_out: &Tensor<Vector<F, NV>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    q_s: &mut SharedMemory<Vector<F, NV>>,
    o_s: &mut SharedMemory<Vector<F, NV>>,
    stat_s: &mut SharedMemory<f32>,
    row_s: &mut SharedMemory<u32>,
    buf: usize,
    group: &QueryGroup,
    r0: usize,
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
    let seq_q = group.seq_q;
    let (h0, p0) = (r0 / seq_q, r0 % seq_q);
    stage_query_rows_async::<F, NV>(
        q,
        q_s,
        buf * q_len,
        group,
        r0,
        h0,
        p0,
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
        group,
        r0,
        h0,
        p0,
        o_col0,
        o_cols,
        c.block_k,
        c.value_dim,
        units,
    );
    if UNIT_POS < c.block_k {
        let row = r0 + UNIT_POS as usize;
        let mut head = group.head0 + h0;
        let mut pos = p0 + UNIT_POS as usize;
        if p0 + bq > seq_q {
            head = group.head(row);
            pos = group.pos(row);
        }
        let l = lse[group.batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
        let at = buf * 2 * bq + UNIT_POS as usize;
        stat_s[at] = select(
            row < group.rows && l > f32::min_value(),
            l,
            f32::max_value(),
        );
        stat_s[at + bq] = delta[(group.batch * q.shape(1) + head) * seq_q + pos];
        if comptime!(c.reads_row_terms()) {
            row_s[at] = head as u32;
            row_s[at + bq] = pos as u32;
        }
    }
}

/// Synchronous copies of `n_rows × width` elements of rows `j0..` of one (batch, head) of `t`
/// (offset `base`) into `dst`, zeros past `valid` rows and `cols` columns.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_key_rows<F: Float, NV: Size>(
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
pub(crate) fn product_trans<F: Float, NV: Size>(
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
pub(crate) fn store_tiles<F: Float>(
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

/// Stores the run of [`NV8`] values of `values` from `first` as one vector of `out` at `at`
/// (in vectors), each cast to `F`: a lane's 8 consecutive keys of a chunk (`dX`, and `P` in
/// the P-buffer plan).
#[cube]
pub(crate) fn store_run<F: Float, ND: Size>(
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
