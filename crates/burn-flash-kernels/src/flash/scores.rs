//! What turns a raw score `q·k` into the score the softmax sees, shared by every attention
//! kernel, in the order of Burn's `attention_fallback`: scale, softcap `c·tanh(s/c)`, the bool
//! mask, the causal mask (bottom-right aligned: query position `i` sees key `j` when
//! `j + Sq ≤ i + Sk`), then the additive bias and the ALiBi term. Masked keys are not scores
//! set to `−inf`: they are *invisible*, and [`crate::flash::online::probability()`] gives them
//! `P = 0`. With [`crate::flash::ScoreRules::masked_score`] a key the bool mask masks stays
//! visible and takes that score instead of the finished one (burn-nn's `mask_fill(mask,
//! min_float)`).
//!
//! The causal mask and a sliding window are one rule, each row's contiguous range of keys
//! ([`crate::flash::keys`]); the bool mask is the only per-key test.

use cubecl::{ir::FastMath, prelude::*};

use crate::flash::args::{ScoreArgs, ScoreInputs};
use crate::flash::block::QueryGroup;
use crate::flash::config::FlashConfig;
use crate::flash::keys::{diagonal, key_range};

/// The ALiBi term of query position `pos` of head `head` and key `key`: `−slope[head]·|pos +
/// Sk − Sq − key|` ([`diagonal()`]; 0 without ALiBi).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn alibi_term(
    slopes: &Tensor<f32>,
    seqs: &Tensor<u32>,
    head: usize,
    pos: usize,
    key: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) -> f32 {
    let mut t = 0.0f32;
    if comptime!(c.rules.alibi) {
        let d = diagonal(seqs, pos, seq_q, seq_k, c) - f32::cast_from(key);
        t = -slopes[head * slopes.stride(0)] * f32::abs(d);
    }
    t
}

/// Where a unit's query rows read the mask and the bias, one slot per row: the row's query
/// position `i` (for dropout), the keys it sees ([`key_range()`]), the element offsets of
/// `mask[b, h, i, 0]` and `bias[b, h, i, 0]` (broadcast dimensions have stride 0), and its ALiBi
/// slope and diagonal.
#[derive(CubeType)]
pub struct RowRefs {
    /// Query position of each row.
    pub pos: Array<usize>,
    /// First key each row sees.
    pub lo: Array<usize>,
    /// One past the last key each row sees.
    pub hi: Array<usize>,
    /// Offset of each row's mask.
    pub mask: Array<usize>,
    /// Offset of each row's bias.
    pub bias: Array<usize>,
    /// Each row's ALiBi slope.
    pub slope: Array<f32>,
    /// Each row's diagonal key `i + Sk − Sq`, as f32 (exact below 2²⁴).
    pub diag: Array<f32>,
    /// Each row's attention-sink logit (its head's; read with [`crate::flash::ScoreRules::sinks`]).
    pub sink: Array<f32>,
}

/// Empty references for `slots` rows.
#[cube]
pub fn new_refs(#[comptime] slots: usize) -> RowRefs {
    RowRefs {
        pos: Array::new(slots),
        lo: Array::new(slots),
        hi: Array::new(slots),
        mask: Array::new(slots),
        bias: Array::new(slots),
        slope: Array::new(slots),
        diag: Array::new(slots),
        sink: Array::new(slots),
    }
}

/// Fills `slot` for row `row` of the cube's [`QueryGroup`] (clamped to the last row), of a call
/// with `Sk = seq_k` keys and score operands `inputs`.
#[cube]
pub fn set_row<E: CubePrimitive, F: Float>(
    refs: &mut RowRefs,
    slot: usize,
    inputs: &ScoreInputs<E, F>,
    group: &QueryGroup,
    row: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) {
    let pos = group.pos(row);
    refs.pos[slot] = pos;
    let keys = key_range(&inputs.seqs, pos, group.seq_q, seq_k, args, c);
    refs.lo[slot] = keys.start;
    refs.hi[slot] = keys.end;
    refs.mask[slot] = 0usize;
    refs.bias[slot] = 0usize;
    refs.slope[slot] = 0.0f32;
    refs.diag[slot] = 0.0f32;
    refs.sink[slot] = 0.0f32;
    if comptime!(c.rules.mask) {
        refs.mask[slot] = group.offset(&inputs.mask, row);
    }
    if comptime!(c.rules.bias) {
        refs.bias[slot] = group.offset(&inputs.bias, row);
    }
    if comptime!(c.rules.sinks) {
        refs.sink[slot] = inputs.sinks[group.head(row) * inputs.sinks.stride(0)];
    }
    if comptime!(c.rules.alibi) {
        let slopes = &inputs.slopes;
        refs.slope[slot] = slopes[group.head(row) * slopes.stride(0)];
        refs.diag[slot] = diagonal(&inputs.seqs, pos, group.seq_q, seq_k, c);
    }
}

/// Whether key `key` is visible from the row: inside the row's key range (causal, window and
/// `Sk`, packed sequences; tested only when `bounds`) and not masked.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn visible<F: Float>(
    mask: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    key: usize,
    _seq_q: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
    #[comptime] bounds: bool,
) -> bool {
    let mut ok = true;
    if comptime!(bounds) {
        ok = key < refs.hi[slot];
        if comptime!(c.rules.window || c.rules.varlen) {
            ok = ok && key >= refs.lo[slot];
        }
    }
    if comptime!(c.rules.mask && !c.fills()) {
        ok = ok && !masked::<F>(mask, refs, slot, key, seq_k, c);
    }
    ok
}

/// Whether the bool mask masks key `key` from the row (never without a mask).
#[cube]
pub fn masked<F: Float>(
    mask: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    key: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) -> bool {
    let mut hit = false;
    if comptime!(c.rules.mask) {
        let k = usize::min(key, seq_k - 1);
        hit = f32::cast_from(mask[refs.mask[slot] + k * mask.stride(3)]) != 0.0f32;
    }
    hit
}

/// The finished score `s` of key `key`, or [`crate::flash::ScoreRules::masked_score`] where the mask masks
/// the key and the config fills masked keys (`s` itself otherwise).
#[cube]
pub fn filled<F: Float>(
    mask: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    s: f32,
    key: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) -> f32 {
    let mut s = s;
    if comptime!(c.fills()) {
        let fill = f32::new(comptime!(c.fill_score()));
        s = select(masked::<F>(mask, refs, slot, key, seq_k, c), fill, s);
    }
    s
}

/// Whether the score of key `key` depends on `q·k` and the bias: 0 where a masked key took the
/// fill score ([`filled()`]), whose `dS` then reaches neither; always without fill.
#[cube]
pub fn live_score<F: Float>(
    mask: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    key: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) -> bool {
    let mut live = true;
    if comptime!(c.fills()) {
        live = !masked::<F>(mask, refs, slot, key, seq_k, c);
    }
    live
}

/// The score of a raw product `q·k`: scaled, softcapped, plus the bias; a masked key's fill
/// score instead where the config fills masked keys ([`filled()`]).
#[cube]
pub fn score<F: Float>(
    mask: &Tensor<F>,
    bias: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    raw: f32,
    key: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> f32 {
    let s = capped(raw, args, c);
    let s = add_bias::<F>(bias, refs, slot, s, key, seq_k, c);
    filled::<F>(mask, refs, slot, s, key, seq_k, c)
}

/// The first half of [`score()`]: `q·k` scaled and (with a softcap) capped, the scalars from
/// `args`. The backward reads the softcap's derivative `1 − (s/c)²` from it ([`cap_slope()`]).
#[cube]
pub fn capped(raw: f32, args: &ScoreArgs, #[comptime] c: FlashConfig) -> f32 {
    let mut s = raw * args.scale;
    if comptime!(c.rules.softcap) {
        s = soft_cap(s, args.softcap);
    }
    s
}

/// The softcap's derivative at a [`capped()`] score `s`: `1 − (s/c)²` under a softcap `c`
/// (`args.softcap`), else 1 (what the backward multiplies `dS` by on its way to `q·k`).
#[cube]
pub fn cap_slope(s: f32, args: &ScoreArgs, #[comptime] c: FlashConfig) -> f32 {
    let mut slope = 1.0f32;
    if comptime!(c.rules.softcap) {
        let t = s / args.softcap;
        slope = 1.0f32 - t * t;
    }
    slope
}

/// The second half of [`score()`]: `s` plus the row's bias at `key` and its ALiBi term
/// `−slope·|i + Sk − Sq − key|` (`s` itself without either).
#[cube]
pub fn add_bias<F: Float>(
    bias: &Tensor<F>,
    refs: &RowRefs,
    slot: usize,
    s: f32,
    key: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) -> f32 {
    let mut s = s;
    if comptime!(c.rules.bias) {
        let k = usize::min(key, seq_k - 1);
        s += f32::cast_from(bias[refs.bias[slot] + k * bias.stride(3)]);
    }
    if comptime!(c.rules.alibi) {
        s -= refs.slope[slot] * f32::abs(f32::cast_from(key) - refs.diag[slot]);
    }
    s
}

/// `c·tanh(s/c)` with the accurate `tanh`, also inside a kernel compiled with fast math
/// (`flash_forward_mma`): the approximate one errs by up to 2⁻¹¹ of `c`, as much as rounding
/// the score to f16.
#[cube(fast_math = FastMath::ReducedPrecision.into())]
fn soft_cap(s: f32, cap: f32) -> f32 {
    cap * f32::tanh(s / cap)
}
