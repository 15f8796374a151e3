//! What turns a raw score `q·k` into the score the softmax sees, shared by every attention
//! kernel, in the order of Burn's `attention_fallback`: scale, softcap `c·tanh(s/c)`, the bool
//! mask, the causal mask (bottom-right aligned: query position `i` sees key `j` when
//! `j + Sq ≤ i + Sk`), then the additive bias and the ALiBi term. Masked keys are not scores
//! set to `−inf`: they are *invisible*, and [`crate::flash::online::probability()`] gives them
//! `P = 0`. With [`crate::flash::ScoreRules::masked_score`] a key the bool mask masks stays
//! visible and takes that score instead of the finished one (burn-nn's `mask_fill(mask,
//! min_float)`).
//!
//! The causal mask and a sliding window are one rule: each row sees a contiguous range of keys
//! ([`key_range()`]), which the kernels also use to skip whole key blocks ([`crate::flash::block`]);
//! the bool mask is the only per-key test.

use cubecl::{ir::FastMath, prelude::*};

use crate::flash::args::{ScoreArgs, ScoreInputs};
use crate::flash::block::QueryGroup;
use crate::flash::config::FlashConfig;

/// A half-open range of keys (or of query positions) `start .. end`; empty when `end ≤ start`.
#[derive(CubeType, Clone, Copy)]
pub struct KeyRange {
    /// The first one.
    pub start: usize,
    /// One past the last one.
    pub end: usize,
}

/// One sequence of a packed variable-length call ([`crate::flash::ScoreRules::varlen`]): its
/// query positions `q0 .. q1` and keys `k0 .. k1` in the packed tensors.
#[derive(CubeType, Clone, Copy)]
pub struct PackedSeq {
    /// The sequence's first query position.
    pub q0: usize,
    /// One past its last query position.
    pub q1: usize,
    /// Its first key.
    pub k0: usize,
    /// One past its last key.
    pub k1: usize,
}

/// The sequence holding query position `pos` of a packed call, from `seqs` (`[2·(n + 1)]`: the
/// cumulative query lengths `cu_q`, then the cumulative key lengths `cu_k`): the last sequence
/// `b < n` with `cu_q[b] ≤ pos` (a binary search; empty sequences before a position are
/// passed over).
#[cube]
pub fn packed_seq(seqs: &Tensor<u32>, pos: usize) -> PackedSeq {
    let st = seqs.stride(0);
    let n = seqs.shape(0) / 2 - 1;
    let mut lo = 0usize;
    let mut hi = n;
    // Invariant: cu_q[lo] ≤ pos, and every b ≥ hi has cu_q[b] > pos or b = n.
    loop {
        if hi - lo <= 1 {
            break;
        }
        let mid = (lo + hi) / 2;
        let mut starts = seqs[mid * st] as usize <= pos;
        if comptime!(crate::mutation::varlen_first_row()) {
            starts = (seqs[mid * st] as usize) < pos;
        }
        if starts {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    PackedSeq {
        q0: seqs[lo * st] as usize,
        q1: seqs[(lo + 1) * st] as usize,
        k0: seqs[(n + 1 + lo) * st] as usize,
        k1: seqs[(n + 2 + lo) * st] as usize,
    }
}

/// The keys query position `pos` sees under the causal mask, the sliding window and packed
/// sequences: with [`crate::flash::ScoreRules::varlen`] the keys of `pos`'s own sequence
/// ([`packed_seq()`]) that [`local_range()`] gives its position within the sequence, against
/// the sequence's lengths; [`local_range()`] of the call's `Sq`, `Sk` otherwise. Both ends grow
/// with `pos` (also across sequences: a sequence's keys follow the previous one's).
#[cube]
pub fn key_range(
    seqs: &Tensor<u32>,
    pos: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> KeyRange {
    // The position within its sequence, the sequence's lengths and its first key.
    let mut at = pos;
    let mut len_q = seq_q;
    let mut len_k = seq_k;
    let mut k0 = 0usize;
    if comptime!(c.rules.varlen) {
        let s = packed_seq(seqs, pos);
        at = pos - s.q0;
        len_q = s.q1 - s.q0;
        len_k = s.k1 - s.k0;
        k0 = s.k0;
    }
    let local = local_range(at, len_q, len_k, args, c);
    KeyRange {
        start: local.start + k0,
        end: local.end + k0,
    }
}

/// The keys query position `pos` of a sequence of `Sq` queries and `Sk` keys sees under the
/// causal mask and the sliding window, bottom-right aligned (the row's diagonal key is
/// `a = pos + Sk − Sq`): from `max(a − left, 0)` to `min(end, Sk)`, `end` being `a + 1`
/// (causal) or `a + right + 1` (window); `0 .. Sk` without either rule.
#[cube]
pub fn local_range(
    pos: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> KeyRange {
    let mut start = 0usize;
    let mut end = seq_k;
    if comptime!(c.rules.causal) {
        end = causal_end(pos, seq_q, seq_k);
    }
    if comptime!(c.rules.window) {
        // Unsigned throughout: `pos + Sk` against `Sq + left` (`left ≤ Sq + Sk`, host-clamped).
        let a = pos + seq_k;
        let back = seq_q + args.window_left as usize;
        start = usize::min(select(a > back, a - back, 0usize), seq_k);
        let mut ahead = a + args.window_right as usize + 1;
        if comptime!(crate::mutation::window_right()) {
            ahead += 1;
        }
        end = usize::min(
            end,
            usize::min(select(ahead > seq_q, ahead - seq_q, 0usize), seq_k),
        );
    }
    KeyRange { start, end }
}

/// Whether query position `pos` sees key `key` under the causal mask, the window and packed
/// sequences: `key` in [`key_range()`]`(pos)`, tested directly (for kernels that hold a key and
/// visit rows); without packed sequences, does not test `key < Sk`.
#[cube]
pub fn sees(
    seqs: &Tensor<u32>,
    pos: usize,
    key: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> bool {
    let mut ok = true;
    if comptime!(c.rules.varlen) {
        let keys = key_range(seqs, pos, seq_q, seq_k, args, c);
        ok = key >= keys.start && key < keys.end;
    } else {
        if comptime!(c.rules.causal) {
            if comptime!(crate::mutation::causal_top_left()) {
                ok = key <= pos;
            } else {
                ok = key + seq_q <= pos + seq_k;
            }
        }
        if comptime!(c.rules.window) {
            let mut right = args.window_right as usize;
            if comptime!(crate::mutation::window_right()) {
                right += 1;
            }
            ok = ok
                && key + seq_q + args.window_left as usize >= pos + seq_k
                && key + seq_q <= pos + seq_k + right;
        }
    }
    ok
}

/// Query position `pos`'s diagonal key `pos + Sk − Sq` as f32 (exact below 2²⁴), the point
/// of its ALiBi distance: with packed sequences, of its own sequence (`pos + k1 − q1`).
#[cube]
pub fn diagonal(
    seqs: &Tensor<u32>,
    pos: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) -> f32 {
    let mut q1 = seq_q;
    let mut k1 = seq_k;
    if comptime!(c.rules.varlen) {
        let s = packed_seq(seqs, pos);
        q1 = s.q1;
        k1 = s.k1;
    }
    f32::cast_from(pos + k1) - f32::cast_from(q1)
}

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

/// The query positions that see at least one of the keys `key_lo ..= key_hi` under the causal
/// mask, the sliding window and packed sequences ([`key_range()`] inverted; every position
/// without any of them), clamped to `0 .. Sq`. May include positions that see none of them
/// (between two that do, or beside one under packed sequences): the kernels still test each
/// key.
#[cube]
pub fn row_range(
    seqs: &Tensor<u32>,
    key_lo: usize,
    key_hi: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> KeyRange {
    let mut start = 0usize;
    let mut end = seq_q;
    if comptime!(c.rules.varlen) {
        // Both ends of [`key_range()`] grow with the position: the first position whose range
        // ends after `key_lo`, and the first whose range starts after `key_hi`.
        start = first_position(seqs, key_lo, seq_q, seq_k, args, true, c);
        end = first_position(seqs, key_hi, seq_q, seq_k, args, false, c);
    } else if comptime!(c.rules.causal || c.rules.window) {
        let local = local_rows(key_lo, key_hi, seq_q, seq_k, args, c);
        start = local.start;
        end = local.end;
    }
    KeyRange { start, end }
}

/// The first query position `pos` (or `Sq`) whose [`key_range()`] ends after `key`
/// (`by_end`), or starts after it.
#[cube]
fn first_position(
    seqs: &Tensor<u32>,
    key: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] by_end: bool,
    #[comptime] c: FlashConfig,
) -> usize {
    let mut lo = 0usize;
    let mut hi = seq_q;
    loop {
        if lo >= hi {
            break;
        }
        let mid = (lo + hi) / 2;
        let keys = key_range(seqs, mid, seq_q, seq_k, args, c);
        let mut past = keys.start > key;
        if comptime!(by_end) {
            past = keys.end > key;
        }
        if past {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// [`row_range()`] of a call without packed sequences, from the window's formula.
#[cube]
fn local_rows(
    key_lo: usize,
    key_hi: usize,
    seq_q: usize,
    seq_k: usize,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
) -> KeyRange {
    // Position `i` sees key `j` when `j ≤ i + Sk − Sq + right'` (`right' = 0` causal, `right`
    // window) and `j ≥ i + Sk − Sq − left`: `i ≥ key_lo + Sq − Sk − right'`,
    // `i ≤ key_hi + Sq − Sk + left`.
    let mut start = 0usize;
    let mut end = seq_q;
    if comptime!(c.rules.causal || c.rules.window) {
        let mut right = 0usize;
        if comptime!(c.rules.window) {
            right = args.window_right as usize;
            if comptime!(crate::mutation::window_right()) {
                right += 1;
            }
        }
        if comptime!(c.rules.causal) {
            right = 0usize;
            if comptime!(crate::mutation::causal_top_left()) {
                // Top-left rows see `Sq − Sk` more keys when `Sq > Sk` (fewer otherwise).
                right = seq_q - usize::min(seq_q, seq_k);
            }
        }
        let a = key_lo + seq_q;
        let back = seq_k + right;
        start = usize::min(select(a > back, a - back, 0usize), seq_q);
    }
    if comptime!(c.rules.window) {
        let b = key_hi + seq_q + args.window_left as usize + 1;
        end = usize::min(select(b > seq_k, b - seq_k, 0usize), seq_q);
    }
    KeyRange { start, end }
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
    scale: f32,
    softcap: f32,
    #[comptime] c: FlashConfig,
) -> f32 {
    let s = capped(raw, scale, softcap, c);
    let s = add_bias::<F>(bias, refs, slot, s, key, seq_k, c);
    filled::<F>(mask, refs, slot, s, key, seq_k, c)
}

/// The first half of [`score()`]: `q·k` scaled and (with a softcap) capped. The backward reads
/// the softcap's derivative `1 − (s/c)²` from it.
#[cube]
pub fn capped(raw: f32, scale: f32, softcap: f32, #[comptime] c: FlashConfig) -> f32 {
    let mut s = raw * scale;
    if comptime!(c.rules.softcap) {
        s = soft_cap(s, softcap);
    }
    s
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

/// The keys query position `pos` sees under the causal mask: `j < pos + 1 + Sk − Sq`,
/// clamped to `0..=Sk`.
#[cube]
pub fn causal_end(pos: usize, seq_q: usize, seq_k: usize) -> usize {
    let mut hi = pos + 1 + seq_k;
    if comptime!(crate::mutation::causal_top_left()) {
        hi = pos + 1 + seq_q;
    }
    let mut end = 0usize;
    if hi > seq_q {
        end = usize::min(hi - seq_q, seq_k);
    }
    end
}
