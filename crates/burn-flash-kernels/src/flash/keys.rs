//! Which keys a query row sees and which rows see a key: the causal mask (bottom-right
//! aligned: query position `i` sees key `j` when `j + Sq ≤ i + Sk`), the sliding window and
//! packed variable-length sequences are one rule, a contiguous range of keys per row
//! ([`key_range()`]), which the kernels use to skip whole key blocks ([`crate::flash::block`])
//! and to test single keys ([`sees()`]); [`row_range()`] inverts it for the backward's key
//! blocks. The score math on the keys a row sees is [`crate::flash::scores`].

use cubecl::prelude::*;

use crate::flash::args::ScoreArgs;
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
