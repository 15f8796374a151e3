//! The forward `mma` kernel's addressing and staging: which key an accumulator element holds
//! ([`key_of()`]), and the `cp.async` copies of the `K`/`V` blocks and of the `Q` tile into
//! shared memory, double-buffered across steps ([`crate::staging`]).

use cubecl::{prelude::barrier::Barrier, prelude::*};

use super::{CHUNK, NV8, load_scores};
use crate::flash::args::ScoreInputs;
use crate::flash::block::QueryGroup;
use crate::flash::config::FlashConfig;
use crate::fragment::{MMA_N, V_PAD};
use crate::staging::{commit_next, copy_vec, wait_step};

/// Key (score column) of element `n` of 8-key tile `j` of a lane of quad member `quad`,
/// counted from the step's first key: `8j + 2·quad + n` in the fragment layout; for given
/// scores, 8 consecutive columns per quad member in each [`CHUNK`] (module docs).
#[cube]
pub(crate) fn key_of(
    #[comptime] j: u32,
    quad: usize,
    #[comptime] n: u32,
    #[comptime] c: FlashConfig,
) -> usize {
    if comptime!(c.given()) {
        comptime!(((j / 4) * CHUNK + (j % 4) * 2 + n) as usize) + quad * NV8
    } else {
        comptime!((j * MMA_N + n) as usize) + quad * 2
    }
}

/// Row of the shared `V` buffer that row `p` of the step's `V` block is copied to, for given
/// scores: the operand position of key `p` (see [`key_of()`]). Key `32c + 8t + 4s + 2i + n`
/// (quad member `t`, `mma` step `2c + s`, operand half `i`, element `n`) sits in row
/// `32c + 16s + 8i + 2t + n`.
#[cube]
fn staged_row(p: usize) -> usize {
    let q = p % 32;
    (p - q) + 16 * ((q % 8) / 4) + 8 * ((q % 4) / 2) + 2 * (q / 8) + q % 2
}

/// Where a cube's keys and values come from: `K` and `V` rows of one (batch, key/value head)
/// (`k_base`, `v_base`, with row strides `ks`, `vs`), the keys it reads (`kv_start ..
/// kv_end`, in steps of `c.block_k` from `kv_start`), and the
/// columns of `K` and of `V` that exist (`head_dim`, `v_cols`; past them the tiles are zero).
#[derive(CubeType)]
pub(crate) struct KvRows {
    pub k_base: usize,
    pub v_base: usize,
    pub ks: usize,
    pub vs: usize,
    pub kv_start: usize,
    pub kv_end: usize,
    pub head_dim: usize,
    pub v_cols: usize,
}

/// Starts the copies of the key block at `j0` into buffer `buf` of `k_s` (computed scores
/// only) and of `v_s` (given scores: in the lanes' key order, [`key_of()`]), with
/// [`stage_rows()`]; each buffer holds `c.block_k` rows of the padded width.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_kv<F: Float, NV: Size>(
    k: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    k_s: &mut SharedMemory<Vector<F, NV>>,
    v_s: &mut SharedMemory<Vector<F, NV>>,
    buf: usize,
    j0: usize,
    at: &KvRows,
    #[comptime] c: FlashConfig,
    #[comptime] units: u32,
) {
    let k_len = comptime!(c.block_k as usize * (c.head_dim + V_PAD) as usize / NV8);
    let v_len = comptime!(c.block_k as usize * (c.value_dim + V_PAD) as usize / NV8);
    if comptime!(!c.given()) {
        stage_rows::<F, NV>(
            k,
            k_s,
            buf * k_len,
            j0,
            at.k_base,
            at.ks,
            at.kv_end,
            at.head_dim,
            c.block_k,
            c.head_dim,
            units,
            false,
        );
    }
    stage_rows::<F, NV>(
        v,
        v_s,
        buf * v_len,
        j0,
        at.v_base,
        at.vs,
        at.kv_end,
        at.v_cols,
        c.block_k,
        c.value_dim,
        units,
        c.given(),
    );
}

/// The K/V pipeline's prologue: step 0's `K` and `V` copies ([`stage_kv()`]) committed on
/// `bar0`, and, for given scores, step 0's scores into `xr`.
#[cube]
// A comptime `if` stays apart from the runtime one inside it (joined, the runtime test would be
// expanded for computed scores too).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub(crate) fn start_kv<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    k_s: &mut SharedMemory<Vector<F, NV>>,
    v_s: &mut SharedMemory<Vector<F, NV>>,
    xr: &mut Array<Vector<F, NV>>,
    x_rows: &Array<usize>,
    bar0: &Barrier,
    steps: usize,
    at: &KvRows,
    seq_k: usize,
    #[comptime] c: FlashConfig,
    #[comptime] units: u32,
) {
    stage_kv::<F, NV>(&inputs.k, &inputs.v, k_s, v_s, 0, at.kv_start, at, c, units);
    bar0.commit_copy_async();
    let _token = bar0.arrive();
    if comptime!(c.given()) {
        if steps > 0 {
            load_scores::<F, NV>(&inputs.q, xr, x_rows, at.kv_start, seq_k, c);
        }
    }
}

/// The K/V pipeline at step `st`: starts step `st + 1`'s copies into the other buffers (`K`
/// and `V`, [`stage_kv()`]; given scores: its scores into `xn`) where there is one, then
/// waits for step `st`'s.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn advance_kv<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    k_s: &mut SharedMemory<Vector<F, NV>>,
    v_s: &mut SharedMemory<Vector<F, NV>>,
    xn: &mut Array<Vector<F, NV>>,
    x_rows: &Array<usize>,
    bar0: &Barrier,
    bar1: &Barrier,
    st: usize,
    steps: usize,
    at: &KvRows,
    seq_k: usize,
    #[comptime] c: FlashConfig,
    #[comptime] units: u32,
) {
    let bk = comptime!(c.block_k as usize);
    let next = st + 1;
    if next < steps {
        stage_kv::<F, NV>(
            &inputs.k,
            &inputs.v,
            k_s,
            v_s,
            1 - st % 2,
            at.kv_start + next * bk,
            at,
            c,
            units,
        );
        commit_next(bar0, bar1, st);
    }
    if comptime!(c.given()) {
        // The next step's scores (the last step's again at the end: never used).
        let j_next = at.kv_start + usize::min(next, steps - 1) * bk;
        load_scores::<F, NV>(&inputs.q, xn, x_rows, j_next, seq_k, c);
    }
    wait_step(bar0, bar1, st);
}

/// The end of a K/V pipeline step: every plane is done with the step's buffers before
/// step + 2's copies overwrite them, and, for given scores, the next step's scores (`xn`, of
/// `x_len` vectors) become the current ones (`xr`).
#[cube]
pub(crate) fn end_step<F: Float, NV: Size>(
    xr: &mut Array<Vector<F, NV>>,
    xn: &Array<Vector<F, NV>>,
    #[comptime] c: FlashConfig,
    #[comptime] x_len: usize,
) {
    sync_cube();
    if comptime!(c.given()) {
        #[unroll]
        for i in 0..x_len {
            xr[i] = xn[i];
        }
    }
}

/// Issues the asynchronous copies of a `rows × width` tile (zeros past `valid_rows` and
/// `valid_cols`) into `dst` at `buf`, row `r` read from `src` at `base + (row0 + r)·row_stride`
/// and written to row `r`, or with `permute` to row [`staged_row()`]`(r)`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows<F: Float, NV: Size>(
    src: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    buf: usize,
    row0: usize,
    base: usize,
    row_stride: usize,
    valid_rows: usize,
    valid_cols: usize,
    #[comptime] rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
    #[comptime] permute: bool,
) {
    let per_row = comptime!(width as usize / NV8);
    let ldv = comptime!((width + V_PAD) as usize / NV8);
    let total = comptime!(rows as usize * per_row);
    let exact = comptime!(total.is_multiple_of(units as usize));
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units as usize)) {
        let idx = UNIT_POS as usize + e * units as usize;
        if exact || idx < total {
            let (r, cv) = (idx / per_row, idx % per_row);
            let row = row0 + r;
            let col = cv * NV8;
            let ok = row < valid_rows && col < valid_cols;
            let at = select(ok, (base + row * row_stride + col) / NV8, 0);
            let mut dst_row = r;
            if comptime!(permute) {
                dst_row = staged_row(r);
            }
            copy_vec::<F, NV>(src, dst, at, buf + dst_row * ldv + cv, ok);
        }
    }
}

/// Issues the copies of the `Q` tile: cube row `r` is row `row0 + r` of the [`QueryGroup`].
#[cube]
pub(super) fn stage_q<F: Float, NV: Size>(
    q: &Tensor<Vector<F, NV>>,
    q_s: &mut SharedMemory<Vector<F, NV>>,
    group: &QueryGroup,
    row0: usize,
    head_dim: usize,
    #[comptime] c: FlashConfig,
    #[comptime] units: u32,
) {
    let per_row = comptime!(c.head_dim as usize / NV8);
    let ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let total = comptime!(c.block_q as usize * per_row);
    #[unroll]
    for e in 0..comptime!(total.div_ceil(units as usize)) {
        let idx = UNIT_POS as usize + e * units as usize;
        if idx < total {
            let (r, cv) = (idx / per_row, idx % per_row);
            let row = row0 + r;
            let col = cv * NV8;
            let ok = row < group.rows && col < head_dim;
            let at = select(ok, (group.offset(q, row) + col) / NV8, 0);
            copy_vec::<F, NV>(q, q_s, at, r * ldv + cv, ok);
        }
    }
}
