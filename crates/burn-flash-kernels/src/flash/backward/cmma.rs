//! The flash backward on cooperative matrices (cubecl's whole-fragment `cmma`: Vulkan through
//! SPIR-V, Metal, CUDA's `wmma`), for both score sources: the math of
//! [`crate::flash::backward`], the products on the matrix units, everything between them
//! through shared memory (a fragment's elements cannot be addressed per lane), as in the
//! forward ([`crate::flash::forward::cmma`]).
//!
//! Two kernels, each owning its output, [`PLANES`] planes of `m`-row fragments per cube:
//! - [`flash_backward_dkv_cmma()`]: one cube per block of `PLANES·m` keys of one (batch,
//!   key/value head); plane `p` owns keys `p·m ..` of it and keeps their `K` and `V` rows as
//!   `A` fragments. It loops over the query rows of the head's group in steps of [`STEP`]
//!   (rows above a causal diagonal skipped), computes the transposed scores `Sᵀ = K·Qᵀ` and
//!   `dPᵀ = V·dOᵀ`, and accumulates `dV += (P ⊙ Z)ᵀ·dO` and `dK += dRᵀ·Q` (given scores:
//!   `Sᵀ` read from `X`, no `dK` and so no `dPᵀ`);
//! - [`flash_backward_dq_cmma()`]: one cube per block of `PLANES·m` query rows; plane `p` owns
//!   rows `p·m ..` and keeps their `Q` and `dO` rows as `A` fragments; it loops over the keys
//!   the rows see in steps of [`STEP`], computes `S = Q·Kᵀ` and `dP = dO·Vᵀ`, writes `dS`
//!   where asked (a tracked bias; given scores: `dX`) and accumulates `dQ += dR·K`.
//!
//! Lane `λ` of a plane works on row `λ / L` of the plane's tiles (`L` lanes per row) and on
//! the columns `L·g + λ mod L`. The streamed operands of a step are loaded into registers
//! during the step before ([`crate::flash::forward::cmma`]'s scheme).

use cubecl::{
    cmma::{Matrix, MatrixIdent, MatrixLayout},
    prelude::*,
};

use crate::dropout::keep_weight;
use crate::flash::args::{BackwardLaunch, GradInputs, Scalars, ScoreArgs, ScoreInputs};
use crate::flash::block::{cube_count, pair_block, pair_group, rows_keys, span_positions};
use crate::flash::config::FlashConfig;
use crate::flash::forward::cmma::{
    Fragment, PAD, S_PAD, fragment, load_rows, product_abt, product_wb, stage_group_rows,
    store_accumulators, store_rows,
};
use crate::flash::keys::row_range;
use crate::flash::scores::{
    RowRefs, add_bias, cap_slope, capped, filled, live_score, new_refs, set_row, visible,
};

mod dkv;
mod dq;

pub use dkv::*;
pub use dq::*;

/// Planes per cube of either kernel.
pub const PLANES: u32 = 4;
/// Query rows per step of the dK/dV kernel, keys per step of the dQ kernel.
pub const STEP: u32 = 32;
/// The widest `D` and `Dv` (their accumulators and `A` fragments stay in registers).
pub const MAX_DIM: u32 = 128;

/// The dQ kernel's configuration tile on fragment `f`: `PLANES·m` rows per cube, [`STEP`] keys
/// per step, `D`, `Dv` rounded up to the fragment.
pub fn tile(head_dim: usize, value_dim: usize, f: Fragment) -> crate::flash::Tile {
    crate::flash::Tile {
        block_q: PLANES * f.m,
        row_tiles: 1,
        block_k: STEP,
        head_dim: head_dim.next_multiple_of(f.k.max(f.n) as usize) as u32,
        value_dim: value_dim.next_multiple_of(f.k.max(f.n) as usize) as u32,
    }
}

/// Keys per cube of the dK/dV kernel on fragment `f`.
pub fn block_keys(f: Fragment) -> u32 {
    PLANES * f.m
}

/// Shared memory of the dQ kernel for `c` on `f`'s operands, in bytes: the `Q` and `dO` tiles
/// staged once, then a step's `K` and `V` blocks and the planes' `dR` tiles; the f32 bounce
/// tiles.
pub fn dq_shared_bytes(c: FlashConfig, f: Fragment) -> usize {
    (dq_shared_len(c) * f.operand_bytes() + c.block_q * (STEP + S_PAD) * 4) as usize
}

/// [`dq_shared_bytes`]' operand elements.
fn dq_shared_len(c: FlashConfig) -> u32 {
    let (dl, vl, wl) = (c.head_dim + PAD, c.value_dim + PAD, STEP + PAD);
    (c.block_q * (dl + vl)).max(STEP * (dl + vl) + c.block_q * wl)
}

/// Shared memory of the dK/dV kernel for `c` (the dQ kernel's config) on fragment `f`, in bytes:
/// the `K` and `V` tiles staged once (given scores: neither), then a step's `Q` (given scores:
/// `X`) and `dO` rows and the planes' weight tiles; the f32 bounce tiles.
pub fn dkv_shared_bytes(c: FlashConfig, f: Fragment) -> usize {
    (dkv_shared_len(c, f) * f.operand_bytes() + block_keys(f) * (STEP + S_PAD) * 4) as usize
}

/// [`dkv_shared_bytes`]' operand elements.
fn dkv_shared_len(c: FlashConfig, f: Fragment) -> u32 {
    let keys = block_keys(f);
    let (dl, vl, wl) = (c.head_dim + PAD, c.value_dim + PAD, STEP + PAD);
    let (first, rows_l) = if c.given() {
        (0, keys + PAD)
    } else {
        (keys * (dl + vl), dl)
    };
    first.max(STEP * (rows_l + vl) + keys * wl)
}

/// Whether the device of `client` runs the cooperative-matrix backward for `c` on `f`: the
/// kernels take `c` ([`fits`]) and the device has their units and shared memory.
pub fn runs<R: Runtime>(client: &ComputeClient<R>, c: FlashConfig, f: Fragment) -> bool {
    let hw = &client.properties().hardware;
    fits(c, f)
        && hw.max_units_per_cube >= PLANES * f.plane
        && hw.max_shared_memory_size >= dq_shared_bytes(c, f).max(dkv_shared_bytes(c, f))
}

/// Whether the cooperative-matrix backward takes `c` on `f`: head dims up to [`MAX_DIM`] in
/// whole fragments, [`STEP`] a whole number of fragments and of lanes per row.
pub fn fits(c: FlashConfig, f: Fragment) -> bool {
    let lanes = f.lanes_per_row();
    c.block_q == PLANES * f.m
        && c.block_k == STEP
        && STEP.is_multiple_of(f.n.max(f.k))
        && STEP.is_multiple_of(lanes)
        && f.n.is_multiple_of(lanes)
        && c.head_dim.max(c.value_dim) <= MAX_DIM
        && c.head_dim.is_multiple_of(f.k.max(f.n))
        && c.value_dim.is_multiple_of(f.k.max(f.n))
        && c.value_dim > 0
}

/// The plane's `A` fragments of its `m` rows from a tile at `at` (pitch `ld`): `width / k` of
/// them, along the columns.
#[cube]
fn a_fragments<F: Float>(
    sh: &SharedMemory<F>,
    at: usize,
    #[comptime] ld: u32,
    #[comptime] width: u32,
    #[comptime] f: Fragment,
) -> Sequence<Matrix<F>> {
    let mut frags = Sequence::<Matrix<F>>::new();
    #[unroll]
    for kc in 0..comptime!(width / f.k) as usize {
        let a_at = at + kc * f.k as usize;
        frags.push(Matrix::<F>::from_slice(
            MatrixIdent::A,
            f.m as usize,
            f.n as usize,
            f.k as usize,
            MatrixLayout::RowMajor,
            &sh.slice(a_at, a_at + (f.m * ld) as usize),
            ld,
        ));
    }
    frags
}

/// `count` zeroed accumulators.
#[cube]
fn accumulators(#[comptime] count: u32, #[comptime] f: Fragment) -> Sequence<Matrix<f32>> {
    let mut acc = Sequence::<Matrix<f32>>::new();
    #[unroll]
    for _t in 0..count {
        acc.push(Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            f.m as usize,
            f.n as usize,
            f.k as usize,
            MatrixLayout::Undefined,
            0.0f32,
        ));
    }
    acc
}

/// What the backward takes of one score ([`crate::flash::backward`]'s math): `P` (0 where the
/// key is invisible or the row has none), the dropout factor `Z` (the forward's mask drawn
/// again; 1 without), the softcap's derivative `1 − (s_c/c)²` and whether `dS` flows (0 where a
/// masked key took the fill score).
#[derive(CubeType)]
struct Weight {
    p: f32,
    z: f32,
    fac: f32,
    gate: f32,
}

/// The [`Weight`] of key `key` in the row of `refs`' `slot` (a row that exists where `row_ok`,
/// with log-sum-exp `lse` and dropout pair `pair`), from its raw product `raw` (given scores:
/// the score itself).
#[cube]
#[allow(clippy::too_many_arguments)]
fn weight<F: Float>(
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    raw: f32,
    key: usize,
    row_ok: bool,
    lse: f32,
    pair: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> Weight {
    let mut fac = 1.0f32;
    let mut s = raw;
    if comptime!(!c.given()) {
        let sc = capped(raw, args, c);
        fac = cap_slope(sc, args, c);
        s = add_bias::<F>(bias, refs, slot, sc, key, seq_k, c);
        s = filled::<F>(mask, refs, slot, s, key, seq_k, c);
    }
    let live = row_ok
        && visible::<F>(mask, refs, slot, key, seq_q, seq_k, c, true)
        && lse > f32::min_value();
    let mut w = Weight {
        p: select(live, f32::exp(s - lse), 0.0f32),
        z: 1.0f32,
        fac,
        gate: 1.0f32,
    };
    if comptime!(c.rules.dropout) {
        let drop = args.dropout;
        w.z = keep_weight(
            drop.seed_lo,
            drop.seed_hi,
            drop.threshold,
            drop.inv_keep,
            pair,
            refs.pos[slot],
            key,
            true,
        );
    }
    if comptime!(c.fills() && !crate::mutation::fill_grad()) {
        w.gate = select(
            live_score::<F>(mask, refs, slot, key, seq_k, c),
            1.0f32,
            0.0f32,
        );
    }
    w
}
