//! The flash forward on the matrix units (f16/bf16, `mma` m16n8k16 with f32 accumulators,
//! `ldmatrix`, `cp.async`; CUDA sm_80+): FlashAttention-2's schedule, with the score source a
//! comptime choice ([`crate::flash::ScoreSource`]).
//!
//! One cube per block of `block_q` query rows of one (batch, key/value head) and one tile of
//! `value_dim` output columns; its rows run over the `G` query heads of the group (GQA: the
//! heads of a group share every `K`/`V` block the cube loads). `block_q / (16·row_tiles)`
//! planes of 32 lanes, `row_tiles` tiles of 16 rows each: every `K` and `V` fragment a plane
//! loads from shared memory feeds `row_tiles` `mma`s, which halves the shared-memory traffic
//! per `mma` at 2 tiles (the limit of the 1-tile kernel: ~0.29 KB of `ldmatrix` per `mma`
//! against 128 B/clock of shared memory).
//!
//! Per step of `block_k` keys:
//! - **the scores**, in `mma` accumulator fragments (lane `4g + t` holds rows `g`, `g + 8` of
//!   each 8-key tile):
//!   - `QueryKey`: `S = Q·Kᵀ` on the matrix units. The `Q` tile is copied into shared memory
//!     once (`cp.async`) and each step reloads a plane's `Q` fragments with `ldmatrix`, which
//!     keeps registers for the accumulators; `K`'s rows are the columns of the `B` operand,
//!     so a plain `ldmatrix.x4` gives the `B` fragments of two 8-key tiles.
//!   - `Given`: `X` straight from global memory into registers, 16 bytes per load, the next
//!     step's loads issued before this step's arithmetic. The keys of a step may be permuted
//!     freely as long as `V`'s rows are permuted alike: lane-quad member `t` takes the 8
//!     *consecutive* columns `8t .. 8t + 8` of each 32-column chunk (one vector) where the
//!     fragment layout has columns `2t, 2t + 1` of each 8-key tile, and `V`'s rows are staged
//!     in that order (`staged_row`).
//! - scale, softcap, mask, causal test and bias on the fragments in registers
//!   ([`crate::flash::scores`]; given scores are used as they are, only the end of the row is
//!   tested); the online softmax with the lazy rescale ([`crate::flash::online::next_reference()`]) and the
//!   hardware's approximate `exp` (`__expf`: fast math without `NaN`/`inf` guarantees, which
//!   cubecl needs to emit it; `e^(−inf) = 0` holds in hardware, and the softcap keeps the
//!   accurate `tanh`); given scores take their row sums on the matrix units (`P` times a block
//!   of ones) — saving the `FADD`s where no `Q·Kᵀ` shares the issue slots;
//! - `P` becomes the `A` operand of `P·V` in registers: the accumulator fragments of two
//!   adjacent 8-key tiles are, element for element, the `A` fragment of their 16 keys (PTX's
//!   m16n8k16 layouts), so `P` never goes through shared memory;
//! - `K` (for `QueryKey`) and `V` blocks stream through two shared-memory buffers: the copies
//!   of step `j + 1` run while step `j` computes ([`crate::staging`]).
//!
//! Causal: blocks of keys entirely after every row's diagonal are never loaded (the loop stops
//! before them); only the blocks that cross a diagonal (or the end) test each key.

use cubecl::{
    cmma::MmaDefinition,
    ir::{FastMath, MatrixIdent},
    prelude::barrier::Barrier,
    prelude::*,
};

use crate::dropout::keep_weight;
use crate::flash::args::{ForwardOutputs, ScoreArgs, ScoreInputs};
use crate::flash::block::{cube_block, cube_group};
use crate::flash::config::FlashConfig;
use crate::flash::online::{
    inverse_sum, next_reference, output_sum, probability, rescale_factor, row_lse,
};
use crate::flash::scores::{RowRefs, new_refs, score, set_row, visible};
use crate::fragment::{
    MMA_M, MMA_N, PLANE, V_PAD, load_b_pair, quad_max, quad_sum, quad_transpose, zero_accumulators,
};
use crate::staging::wait_step;

mod stage;

use stage::stage_q;
pub(crate) use stage::{KvRows, advance_kv, end_step, key_of, start_kv};

/// Elements per 16-byte vector of a 16-bit type: the kernel's `NV`.
pub const NV8: usize = 8;

/// Columns of given scores one lane-quad loads per chunk: 4 lanes × 8 elements (16 bytes).
pub const CHUNK: u32 = 32;

/// Shared memory of [`flash_forward_mma()`], in bytes: two `V` buffers and, for computed
/// scores, the `Q` tile and two `K` buffers, rows padded by [`V_PAD`] elements; and the two
/// `cp.async` barriers (8 bytes each), which count against the device's limit too (without
/// them a D 256 plan on sm_86/sm_89 asked for 16 bytes over the 99 KiB: `cargo xtask
/// cuda-check`).
pub fn shared_bytes(c: FlashConfig) -> usize {
    let pad = V_PAD as usize;
    let (bq, bk) = (c.block_q as usize, c.block_k as usize);
    let (d, dv) = (c.head_dim as usize, c.value_dim as usize);
    let qk = if c.given() {
        0
    } else {
        bq * (d + pad) + 2 * bk * (d + pad)
    };
    let barriers = if crate::mutation::uncounted_barriers() {
        0
    } else {
        BARRIER_BYTES
    };
    (qk + 2 * bk * (dv + pad)) * 2 + barriers
}

/// The shared memory of the kernel's two `Barrier::shared`.
const BARRIER_BYTES: usize = 2 * 8;

/// Whether `c` fits the kernel: whole `mma` tiles and pairs of them and, for given scores,
/// whole [`CHUNK`]s per step.
pub fn fits(c: FlashConfig) -> bool {
    let tile_rows = MMA_M * c.row_tiles;
    c.row_tiles >= 1
        && c.block_q.is_multiple_of(tile_rows)
        && c.block_k.is_multiple_of(if c.given() { CHUNK } else { 16 })
        && c.block_k > 0
        && c.head_dim.is_multiple_of(16)
        && c.value_dim.is_multiple_of(16)
        && c.value_dim > 0
}

/// Units per cube of `c`: one plane per `16·row_tiles` rows.
pub fn units(c: FlashConfig) -> u32 {
    (c.block_q / (MMA_M * c.row_tiles)) * PLANE
}

/// Loads this lane's given scores of the step at key `j0`: per row slot (`2·rt + h`: row
/// `r + 16·rt + 8·h`, offset `x_rows[slot]`), 8 consecutive columns per [`CHUNK`]
/// (`xr[slot·chunks + chunk]`). The loads are unconditional, from clamped addresses, so that
/// nothing waits for them before their use in the next step: rows past the end are never
/// stored, columns past `Sk` are invisible in the step that tests bounds.
#[cube]
pub(crate) fn load_scores<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    xr: &mut Array<Vector<F, NV>>,
    x_rows: &Array<usize>,
    j0: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) {
    let chunks = comptime!(c.block_k / CHUNK);
    let quad = (UNIT_POS_PLANE % 4) as usize;
    #[unroll]
    for ch in 0..chunks {
        let col = j0 + (ch * CHUNK) as usize + quad * NV8;
        let col = select(col < seq_k, col, 0);
        #[unroll]
        for slot in 0..comptime!(2 * c.row_tiles) {
            xr[(slot * chunks + ch) as usize] = x[(x_rows[slot as usize] + col) / NV8];
        }
    }
}

/// `S = Q·Kᵀ` of one step for one plane's row tiles: per 16 dims, one `Q` fragment per row
/// tile and, per 16 keys, one `ldmatrix.x4` of `K` shared by the row tiles.
#[cube]
pub(crate) fn step_scores<F: Float, NV: Size>(
    q_s: &SharedMemory<Vector<F, NV>>,
    k_s: &SharedMemory<Vector<F, NV>>,
    k_buf: usize,
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] c: FlashConfig,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let mat = lane / 8;
    let mat_row = lane % 8;
    let rts = comptime!(c.row_tiles);
    let q_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let k_ldv = comptime!((c.head_dim + V_PAD) as usize / NV8);
    let key_tiles = comptime!(c.block_k / MMA_N);
    // ldmatrix rows of this lane: Q row (matrices 1, 3: + 8), column + 8 for matrices 2, 3;
    // K key (matrices 2, 3: + 8), dim + 8 for matrices 1, 3.
    let q_row = (plane * MMA_M * rts + (mat % 2) * 8 + mat_row) as usize;
    let q_base = q_row * q_ldv + (mat / 2) as usize;
    let k_base = k_buf + ((mat / 2) * 8 + mat_row) as usize * k_ldv + (mat % 2) as usize;
    #[unroll]
    for kd in 0..comptime!(c.head_dim / 16) {
        let mut qa = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for rt in 0..rts {
            let at = q_base + comptime!((rt * MMA_M) as usize * q_ldv + kd as usize * 2);
            qa.push(def.load_matrix::<Vector<F, NV>, Const<2>>(
                &q_s.slice(at, at + 1),
                MatrixIdent::A,
                4usize,
                false,
            ));
        }
        #[unroll]
        for jp in 0..comptime!(c.block_k / 16) {
            let ka = k_base + comptime!((jp * 16) as usize * k_ldv + kd as usize * 2);
            let b = load_b_pair::<F, NV>(k_s, ka, false);
            #[unroll]
            for rt in 0..rts {
                let a = qa.index(rt as usize);
                def.execute_inplace(
                    a,
                    b.index(0usize),
                    s.index_mut(comptime!(rt * key_tiles + 2 * jp) as usize),
                );
                def.execute_inplace(
                    a,
                    b.index(1usize),
                    s.index_mut(comptime!(rt * key_tiles + 2 * jp + 1) as usize),
                );
            }
        }
    }
}

/// One step of `block_k` keys for one plane (`row_tiles` tiles of 16 query rows): `S = Q·Kᵀ`,
/// the finished scores, the online softmax update and `O += P·V`. Each `K` and `V` fragment is
/// loaded once for all the plane's row tiles. `bounds` (the blocks that cross the end of the
/// keys or a diagonal) tests each key's position.
///
/// Slots: row tile `rt`, half `h` (rows `r`, `r + 8`) is slot `2·rt + h` of `m`, `l` and
/// `refs`; `S` tile `j` of row tile `rt` is `s[rt·key_tiles + j]`, output tile `nt` is
/// `acc[rt·value_tiles + nt]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn step<F: Float, NV: Size>(
    q_s: &SharedMemory<Vector<F, NV>>,
    k_s: &SharedMemory<Vector<F, NV>>,
    v_s: &SharedMemory<Vector<F, NV>>,
    kv_buf: (usize, usize),
    xr: &Array<Vector<F, NV>>,
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    refs: &RowRefs,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    l_mma: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    j0: usize,
    seqs: (usize, usize),
    args: &ScoreArgs,
    pairs: &Array<usize>,
    #[comptime] c: FlashConfig,
    #[comptime] bounds: bool,
) {
    let (k_buf, v_buf) = kv_buf;
    let (seq_q, seq_k) = seqs;
    let drop = &args.dropout;
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let quad = (lane % 4) as usize;
    let rts = comptime!(c.row_tiles);
    let key_tiles = comptime!(c.block_k / MMA_N);
    let value_tiles = comptime!(c.value_dim / MMA_N);

    let mut s = zero_accumulators(comptime!(rts * key_tiles));
    if comptime!(c.given()) {
        // -- given scores: 8-key tile 4·chunk + u of slot (rt, h) is elements 2u, 2u + 1 of
        // the slot's vector of the chunk --
        let chunks = comptime!(c.block_k / CHUNK);
        #[unroll]
        for rt in 0..rts {
            #[unroll]
            for j in 0..key_tiles {
                let frag = s.index_mut(comptime!(rt * key_tiles + j) as usize);
                #[unroll]
                for h in 0..2u32 {
                    let vec = xr[comptime!(((2 * rt + h) * chunks + j / 4) as usize)];
                    let mut pair = Vector::<f32, Const<2>>::empty();
                    #[unroll]
                    for n in 0..2u32 {
                        pair[n as usize] =
                            f32::cast_from(vec[comptime!((2 * (j % 4) + n) as usize)]);
                    }
                    frag[h as usize] = pair;
                }
            }
        }
    } else {
        step_scores::<F, NV>(q_s, k_s, k_buf, &mut s, c);
    }
    // -- finished scores (invisible keys: the lowest value, no probability) and the step's row
    // maxima --
    let mut step_max = Array::<f32>::new(comptime!(2 * rts as usize));
    #[unroll]
    for rt in 0..rts {
        #[unroll]
        for h in 0..2u32 {
            let slot = (2 * rt + h) as usize;
            step_max[slot] = f32::min_value();
            #[unroll]
            for j in 0..key_tiles {
                let frag = s.index_mut(comptime!(rt * key_tiles + j) as usize);
                let mut vec = frag[h as usize];
                #[unroll]
                for n in 0..2u32 {
                    let key = j0 + key_of(j, quad, n, c);
                    let mut x = vec[n as usize];
                    if comptime!(!c.given()) {
                        x = score::<F>(mask, bias, refs, slot, x, key, seq_k, args, c);
                    }
                    let ok = visible::<F>(mask, refs, slot, key, seq_q, seq_k, c, bounds);
                    vec[n as usize] = select(ok, x, f32::min_value());
                    step_max[slot] = f32::max(step_max[slot], vec[n as usize]);
                }
                frag[h as usize] = vec;
            }
        }
    }

    // -- move the reference maxima (lazily; every lane of a plane agrees on whether) --
    let mut m_new = Array::<f32>::new(comptime!(2 * rts as usize));
    let mut moved = false;
    #[unroll]
    for slot in 0..comptime!(2 * rts as usize) {
        m_new[slot] = next_reference(m[slot], quad_max(step_max[slot]), true);
        moved = moved || m_new[slot] != m[slot];
    }
    if plane_any(moved) {
        let mut alpha = Array::<f32>::new(comptime!(2 * rts as usize));
        #[unroll]
        for slot in 0..comptime!(2 * rts as usize) {
            alpha[slot] = rescale_factor(m[slot], m_new[slot]);
            m[slot] = m_new[slot];
            l[slot] *= alpha[slot];
        }
        if comptime!(c.given()) {
            #[unroll]
            for rt in 0..rts {
                let frag = l_mma.index_mut(rt as usize);
                #[unroll]
                for h in 0..2u32 {
                    frag[h as usize] = frag[h as usize] * Vector::new(alpha[(2 * rt + h) as usize]);
                }
            }
        }
        #[unroll]
        for rt in 0..rts {
            #[unroll]
            for nt in 0..value_tiles {
                let frag = acc.index_mut(comptime!(rt * value_tiles + nt) as usize);
                #[unroll]
                for h in 0..2u32 {
                    frag[h as usize] = frag[h as usize] * Vector::new(alpha[(2 * rt + h) as usize]);
                }
            }
        }
    }

    // -- per 16 keys: P (the A fragment of S tiles 2κ and 2κ + 1), then O += P·V with each V
    // fragment pair (`ldmatrix.x4.trans`) shared by the row tiles --
    let v_ldv = comptime!((c.value_dim + V_PAD) as usize / NV8);
    let v_at = v_lane_at(v_buf, v_ldv);
    #[unroll]
    for kc in 0..comptime!(c.block_k / 16) {
        let mut pa = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for rt in 0..rts {
            let mut a = Array::<Vector<F, Const<2>>>::new(4usize);
            #[unroll]
            for i in 0..4u32 {
                // A register i: row r + 8·(i % 2), keys 16κ + 8·(i / 2) + 2t + n.
                let j = comptime!(rt * key_tiles + 2 * kc + i / 2);
                let slot = (2 * rt + i % 2) as usize;
                let vec = s.index(j as usize)[(i % 2) as usize];
                let mut pair = Vector::<F, Const<2>>::empty();
                #[unroll]
                for n in 0..2usize {
                    let x = vec[n];
                    // Invisible keys carry the lowest value; only steps that test bounds or
                    // read a mask have them (a given −inf needs no test: e^(−inf − m) = 0).
                    let mut p = f32::exp(x - m[slot]);
                    if comptime!(bounds || c.rules.mask) {
                        p = probability(x, m[slot], x > f32::min_value());
                    }
                    if comptime!(!c.given()) {
                        l[slot] += p;
                    }
                    // The row sum takes every weight; `P·V` the kept ones, scaled.
                    let mut kept = p;
                    if comptime!(c.rules.dropout) {
                        let key =
                            j0 + key_of(comptime!(2 * kc + i / 2), quad, comptime!(n as u32), c);
                        kept *= keep_weight(
                            drop.seed_lo,
                            drop.seed_hi,
                            drop.threshold,
                            drop.inv_keep,
                            pairs[slot],
                            refs.pos[slot],
                            key,
                            false,
                        );
                    }
                    pair[n] = F::cast_from(kept);
                }
                a[i as usize] = pair;
            }
            if comptime!(c.given()) {
                // Given scores: the row sums on the matrix units, `P` times a block of ones
                // (fewer instructions per score where no `Q·Kᵀ` shares the issue slots).
                let mut ones = Array::<Vector<F, Const<2>>>::new(2usize);
                ones[0usize] = Vector::new(F::from_int(1));
                ones[1usize] = Vector::new(F::from_int(1));
                def.execute_inplace(&a, &ones, l_mma.index_mut(rt as usize));
            }
            pa.push(a);
        }
        accumulate_pv::<F, NV>(v_s, v_at, kc, &pa, acc, v_ldv, c.value_dim, c.row_tiles);
    }
}

/// This lane's `ldmatrix.x4.trans` address in a `V` buffer at `v_buf` with rows of `ldv`
/// vectors: matrices 1 and 3 are 8 rows down, 2 and 3 one vector (8 columns) right.
#[cube]
pub(crate) fn v_lane_at(v_buf: usize, #[comptime] ldv: usize) -> usize {
    let lane = UNIT_POS_PLANE;
    let (mat, mat_row) = (lane / 8, lane % 8);
    v_buf + ((mat % 2) * 8 + mat_row) as usize * ldv + (mat / 2) as usize
}

/// `O += P·V` for the `kc`-th 16 keys of a step, for one plane: `pa` holds the `A` fragment
/// of `P` for each of `rts` row tiles, and each `V` fragment pair (`ldmatrix.x4.trans` at
/// `v_at`, this lane's address from [`v_lane_at()`] in a buffer of rows of `ldv` vectors) is
/// shared by the row tiles; `cols` output columns, `cols / 8` accumulator tiles per row tile.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_pv<F: Float, NV: Size>(
    v_s: &SharedMemory<Vector<F, NV>>,
    v_at: usize,
    #[comptime] kc: u32,
    pa: &Sequence<Array<Vector<F, Const<2>>>>,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] ldv: usize,
    #[comptime] cols: u32,
    #[comptime] rts: u32,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let tiles = comptime!(cols / MMA_N);
    #[unroll]
    for np in 0..comptime!(cols / 16) {
        let start = v_at + comptime!((kc * 16) as usize * ldv + np as usize * 2);
        let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
            &v_s.slice(start, start + 1),
            MatrixIdent::B,
            4usize,
            true,
        );
        let mut b0 = Array::<Vector<F, Const<2>>>::new(2usize);
        let mut b1 = Array::<Vector<F, Const<2>>>::new(2usize);
        b0[0usize] = regs[0usize];
        b0[1usize] = regs[1usize];
        b1[0usize] = regs[2usize];
        b1[1usize] = regs[3usize];
        #[unroll]
        for rt in 0..rts {
            let a = pa.index(rt as usize);
            def.execute_inplace(
                a,
                &b0,
                acc.index_mut(comptime!(rt * tiles + 2 * np) as usize),
            );
            def.execute_inplace(
                a,
                &b1,
                acc.index_mut(comptime!(rt * tiles + 2 * np + 1) as usize),
            );
        }
    }
}

/// FlashAttention-2's schedule: 4 planes (2 at 64 rows) of up to 255 registers, two cubes per SM.
/// Known spills: the D 128 variants with score rules, softmax·V's (given scores) on sm_86 /
/// sm_89 (RESULTS §15); the ceiling leaves room for cubecl's declaration order, which moves
/// between processes (NOTES §12).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(2, 160);

/// `out = softmax(scores)·v` and the row log-sum-exp `lse` of the finished scores, for
/// f16/bf16 tensors whose rows are contiguous and 16-byte aligned (row lengths and every
/// stride multiples of 8).
///
/// Shapes: `v` `[B, Hkv, Sk, Dv]`, `out` `[B, Hq, Sq, Dv]`, `lse` `[B, Hq, Sq]`, and
/// - `QueryKey`: `q` `[B, Hq, Sq, D]`, `k` `[B, Hkv, Sk, D]`; `mask` (1 = masked out) and `bias`
///   `[B, Hq, Sq, Sk]` with stride 0 along broadcast dimensions, read only when `c` says so;
/// - `Given`: the scores `X` `[B, H, Sq, Sk]` in place of `q`, `Hkv = H` (`k`, `mask`, `bias`,
///   `scale`, `softcap` unused).
///
/// Grid: `(column tiles of Dv, row blocks of G·Sq, B·Hkv)`; [`units()`] units per cube.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
// A comptime `if` stays apart from the runtime one inside it: joined, the branch would be
// expanded for computed scores too.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_forward_mma<F: Float, NV: Size, NO: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    outputs: &mut ForwardOutputs<Vector<F, NO>>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (out, lse) = (&mut outputs.out, &mut outputs.lse);
    let units = comptime!((c.block_q / (MMA_M * c.row_tiles)) * PLANE);
    let given = comptime!(c.given());
    let k_len = comptime!(c.block_k as usize * (c.head_dim + V_PAD) as usize / NV8);
    let v_len = comptime!(c.block_k as usize * (c.value_dim + V_PAD) as usize / NV8);
    let chunks = comptime!(c.block_k / CHUNK);
    let slots = comptime!(2 * c.row_tiles as usize);

    let blk = cube_block(q, k, &inputs.seqs, &args, c);
    let group = cube_group(&blk);
    let (seq_q, seq_k, rows) = (blk.seq_q, blk.seq_k, blk.rows);
    let (batch, hkv, head0, block_row0) = (blk.batch, blk.hkv, blk.head0, blk.row0);
    let kv_end = blk.kv_end;
    let head_dim = q.shape(3);
    let value_dim = out.shape(3);
    let col0 = blk.col0;
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let quad = (lane % 4) as usize;
    let rts = comptime!(c.row_tiles);
    let my_row = block_row0 + (plane * MMA_M * rts + lane / 4) as usize;

    // -- the keys this cube needs: with a causal mask or a window, its rows' key span --
    let steps = blk.steps(c);

    let kv = KvRows {
        k_base: batch * k.stride(0) + hkv * k.stride(1),
        v_base: batch * v.stride(0) + hkv * v.stride(1) + col0,
        ks: k.stride(2),
        vs: v.stride(2),
        kv_start: blk.kv_start,
        kv_end,
        head_dim,
        v_cols: value_dim - col0,
    };

    let mut q_s = SharedMemory::<Vector<F, NV>>::new(comptime!(if c.given() {
        1
    } else {
        c.block_q as usize * (c.head_dim + V_PAD) as usize / NV8
    }));
    let mut k_s =
        SharedMemory::<Vector<F, NV>>::new(comptime!(if c.given() { 1 } else { 2 * k_len }));
    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(2 * v_len));
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let mut refs = new_refs(slots);
    let mut m = Array::<f32>::new(slots);
    let mut l = Array::<f32>::new(slots);
    // Given scores: the row sums as `mma` accumulators (vector h of row tile rt holds, twice,
    // the sum of row r + 16·rt + 8·h).
    let mut l_mma = zero_accumulators(comptime!(if c.given() { c.row_tiles } else { 1 }));
    // Given scores: where each slot's row starts in `X`, and two steps of them in registers.
    let mut x_rows = Array::<usize>::new(slots);
    let x_len = comptime!(if c.given() {
        slots * chunks as usize
    } else {
        1
    });
    let mut xr = Array::<Vector<F, NV>>::new(x_len);
    let mut xn = Array::<Vector<F, NV>>::new(x_len);
    // The (batch, query head) pair of each slot's row: the dropout generator's key.
    let mut pairs = Array::<usize>::new(slots);
    #[unroll]
    for slot in 0..slots {
        // Slot 2·rt + h: row r + 16·rt + 8·h.
        let row = my_row + slot * 8;
        set_row(&mut refs, slot, inputs, &group, row, seq_k, &args, c);
        pairs[slot] = batch * q.shape(1) + group.head(row);
        x_rows[slot] = group.offset(q, row);
        m[slot] = f32::min_value();
        l[slot] = 0.0f32;
    }
    let value_tiles = comptime!(c.value_dim / MMA_N);
    let mut acc = zero_accumulators(comptime!(c.row_tiles * value_tiles));

    // -- prologue: Q (computed scores) and step 0's K, V, or step 0's given scores --
    if comptime!(!given) {
        stage_q::<F, NV>(q, &mut q_s, &group, block_row0, head_dim, c, units);
    }
    start_kv::<F, NV>(
        inputs, &mut k_s, &mut v_s, &mut xr, &x_rows, &bar0, steps, &kv, seq_k, c, units,
    );

    for st in 0..steps {
        let parity = st % 2;
        advance_kv::<F, NV>(
            inputs, &mut k_s, &mut v_s, &mut xn, &x_rows, &bar0, &bar1, st, steps, &kv, seq_k, c,
            units,
        );
        let bufs = (parity * k_len, parity * v_len);
        let j0 = blk.step_key(st, c);
        if blk.full_step(st, c) {
            step::<F, NV>(
                &q_s,
                &k_s,
                &v_s,
                bufs,
                &xr,
                mask,
                bias,
                &refs,
                &mut acc,
                &mut m,
                &mut l,
                &mut l_mma,
                j0,
                (seq_q, seq_k),
                &args,
                &pairs,
                c,
                false,
            );
        } else {
            step::<F, NV>(
                &q_s,
                &k_s,
                &v_s,
                bufs,
                &xr,
                mask,
                bias,
                &refs,
                &mut acc,
                &mut m,
                &mut l,
                &mut l_mma,
                j0,
                (seq_q, seq_k),
                &args,
                &pairs,
                c,
                true,
            );
        }
        end_step::<F, NV>(&mut xr, &xn, c, x_len);
    }
    if steps == 0 {
        // Nothing to see: the prologue's copies still complete before the cube exits.
        wait_step(&bar0, &bar1, 0);
    }

    // -- normalise and store --
    let mut inv = Array::<f32>::new(slots);
    #[unroll]
    for slot in 0..slots {
        let total = if comptime!(c.given()) {
            l_mma.index(comptime!(slot / 2))[comptime!(slot % 2)][0usize]
        } else {
            quad_sum(l[slot])
        };
        inv[slot] = inverse_sum(output_sum(m[slot], total, refs.sink[slot], c));
        let row = my_row + slot * 8;
        if quad == 0 && row < rows && blk.first_tile {
            let head = head0 + row / seq_q;
            let at = batch * lse.stride(0) + head * lse.stride(1) + (row % seq_q) * lse.stride(2);
            lse[at] = row_lse(m[slot], total, refs.sink[slot], c);
        }
    }
    #[unroll]
    for slot in 0..slots {
        let row = my_row + slot * 8;
        let (rt, h) = (comptime!(slot / 2), comptime!(slot % 2));
        let o_base = batch * out.stride(0)
            + (head0 + usize::min(row, rows - 1) / seq_q) * out.stride(1)
            + (usize::min(row, rows - 1) % seq_q) * out.stride(2);
        if comptime!(stores_vectors(c)) {
            store_row_vectors::<F, NO>(
                out,
                &acc,
                comptime!(rt as u32 * value_tiles),
                h,
                inv[slot],
                o_base,
                col0,
                value_dim,
                row < rows,
                value_tiles,
            );
        } else if row < rows {
            #[unroll]
            for nt in 0..value_tiles {
                let vec = acc.index(comptime!(rt as u32 * value_tiles + nt) as usize)[h];
                #[unroll]
                for n in 0..2usize {
                    let col = col0 + (nt * MMA_N) as usize + quad * 2 + n;
                    if col < value_dim {
                        out[o_base + col * out.stride(3)] =
                            Vector::new(F::cast_from(vec[n] * inv[slot]));
                    }
                }
            }
        }
    }
}

/// Whether the forward stores its output rows as whole 16-byte vectors rather than an element
/// at a time: the output tile is a whole number of groups of 4 m16n8 tiles, which each lane
/// quad transposes in registers. The launch then views `out` with vectors of [`out_vector()`]
/// elements.
pub fn stores_vectors(c: FlashConfig) -> bool {
    c.value_dim.is_multiple_of(4 * MMA_N)
}

/// The vector width of `out` in a launch of [`flash_forward_mma()`] with `c`.
pub fn out_vector(c: FlashConfig) -> usize {
    if stores_vectors(c) { NV8 } else { 1 }
}

/// Stores one row of a plane's output, `tiles` m16n8 accumulator tiles from `acc[first..]`
/// (half `h`: row `r` or `r + 8` of the tiles), times `scale`, at `o_base` (the row's start in
/// `out`, columns from `col0`): the lanes of a quad transpose each group of 4 tiles
/// ([`quad_transpose`]) and store one 8-column vector each (16 bytes; columns past
/// `value_dim`, a multiple of 8, are not stored, nor anything unless `store`). Every lane of
/// the plane must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_row_vectors<F: Float, NO: Size>(
    out: &mut Tensor<Vector<F, NO>>,
    acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] first: u32,
    #[comptime] h: usize,
    scale: f32,
    o_base: usize,
    col0: usize,
    value_dim: usize,
    store: bool,
    #[comptime] tiles: u32,
) {
    let quad = (UNIT_POS_PLANE % 4) as usize;
    #[unroll]
    for group in 0..comptime!(tiles / 4) {
        let mut a = Array::<f32>::new(comptime!(NV8));
        #[unroll]
        for t in 0..4u32 {
            let vec = acc.index(comptime!(first + 4 * group + t) as usize)[h];
            a[comptime!(2 * t as usize)] = vec[0usize] * scale;
            a[comptime!(2 * t as usize + 1)] = vec[1usize] * scale;
        }
        quad_transpose(&mut a);
        let col = col0 + comptime!((4 * group * MMA_N) as usize) + quad * NV8;
        if store && col < value_dim {
            let mut o = Vector::<F, NO>::empty();
            #[unroll]
            for i in 0..comptime!(NV8) {
                o[i] = F::cast_from(a[i]);
            }
            out[(o_base + col) / NV8] = o;
        }
    }
}
