//! The online-softmax update every flash forward runs, and its rescale (FlashAttention-2's
//! `softmax.h`). Per row, after the columns `0..j` a kernel holds a reference maximum `m`, the
//! sum `l = Σ e^(s − m)` and the unnormalised output `O = Σ e^(s − m)·v`; a step with scores
//! `S` (and `P = e^(S − m')`) updates them as
//!
//! ```text
//! m' = max(m, rowmax(S))
//! α  = e^(m − m')
//! l' = α·l + rowsum(P)
//! O' = α·O + P·V
//! ```
//!
//! and the result is `O / l` with the row log-sum-exp `lse = m + ln l`. Both start from the
//! lowest finite value (`m`) and 0, so `m − m'` is never `−inf − (−inf)`; a row with no visible
//! column keeps `l = 0` and gets the output 0 and `lse = −inf`.
//!
//! **Lazy rescale.** `m` only has to bound the scores closely enough that `e^(s − m)` neither
//! overflows nor loses the row's largest terms. The matrix-unit kernels keep `m` until a row's
//! maximum exceeds it by more than [`LAZY_RESCALE`]: then `P ≤ e^8 ≈ 2981` (well inside f16's
//! range) and most steps skip the rescale of `O` (whose cost grows with the output width).
//! The result is exact either way: `O / l` and `m + ln l` do not depend on which `m` was used.

use cubecl::prelude::*;

use crate::flash::config::FlashConfig;

/// How far a row's maximum may rise above the reference `m` before `m` (and the
/// accumulators) move (module docs).
pub const LAZY_RESCALE: f32 = 8.0;

/// The new reference maximum of a row from its current one `m` and the step's maximum:
/// `m' = max(m, step_max)`, or with `lazy`, `m` itself unless the step's maximum exceeds it by
/// more than [`LAZY_RESCALE`].
#[cube]
pub fn next_reference(m: f32, step_max: f32, #[comptime] lazy: bool) -> f32 {
    let exact = f32::max(m, step_max);
    if comptime!(lazy) {
        select(step_max > m + LAZY_RESCALE, exact, m)
    } else {
        exact
    }
}

/// The scale `α = e^(m − m')` of a row's sum and accumulators when its reference moves from
/// `m` to `m_new` (1 when it does not move).
#[cube]
pub fn rescale_factor(m: f32, m_new: f32) -> f32 {
    let mut alpha = f32::exp(m - m_new);
    if comptime!(crate::mutation::no_rescale()) {
        alpha = 1.0f32;
    }
    alpha
}

/// `P = e^(s − m)` of one score, 0 where the column is not `visible` (masked, or past the
/// end of the row).
#[cube]
pub fn probability(s: f32, m: f32, visible: bool) -> f32 {
    select(visible, f32::exp(s - m), 0.0f32)
}

/// The output scale `1 / l` of a row (0 for a row without a visible column, `l = 0`).
#[cube]
pub fn inverse_sum(l: f32) -> f32 {
    select(l == 0.0f32, 0.0f32, 1.0f32 / l)
}

/// The row log-sum-exp `m + ln l` (`−inf` when `l = 0`).
#[cube]
pub fn log_sum_exp(m: f32, l: f32) -> f32 {
    m + f32::ln(l)
}

/// The sum a row's output is divided by: `l`, plus with quiet softmax `e^(−m)` (the `1` of
/// `1 + Σ e^s` against the reference `m`) and with an attention sink `e^(sink − m)`; infinite,
/// and the output 0, for a row without a visible key or whose scores are all far below them.
#[cube]
pub fn output_sum(m: f32, l: f32, sink: f32, #[comptime] c: FlashConfig) -> f32 {
    let mut total = l;
    if comptime!(c.rules.quiet && !crate::mutation::quiet_off()) {
        total += f32::exp(-m);
    }
    if comptime!(c.rules.sinks) {
        total += f32::exp(sink - m);
    }
    total
}

/// The log-sum-exp a row stores for the backward: [`log_sum_exp()`], or with quiet softmax
/// [`quiet_lse()`] of it, and with an attention sink [`log_add_exp()`] of it and the sink.
#[cube]
pub fn row_lse(m: f32, l: f32, sink: f32, #[comptime] c: FlashConfig) -> f32 {
    let mut lse = log_sum_exp(m, l);
    if comptime!(c.rules.quiet) {
        lse = quiet_lse(lse);
    }
    if comptime!(c.rules.sinks) {
        lse = log_add_exp(lse, sink);
    }
    lse
}

/// `ln(e^a + e^b)` for a finite `b`, without overflow (`b` for `a = −inf`).
#[cube]
pub fn log_add_exp(a: f32, b: f32) -> f32 {
    let hi = f32::max(a, b);
    let lo = f32::min(a, b);
    hi + f32::ln(1.0f32 + f32::exp(lo - hi))
}

/// The log of the quiet softmax's denominator, `ln(1 + Σ e^s) = softplus(L)` for `L = lse`,
/// computed without overflow: `max(L, 0) + ln(1 + e^(−|L|))` (0 for `L = −inf`). The backward
/// rebuilds the quiet weights `e^(s − softplus(L))` from it; nothing else changes there, as
/// `∂p_j/∂s_k = p_j(δ_jk − p_k)` holds for the quiet weights too.
#[cube]
pub fn quiet_lse(lse: f32) -> f32 {
    f32::max(lse, 0.0f32) + f32::ln(1.0f32 + f32::exp(-f32::abs(lse)))
}
