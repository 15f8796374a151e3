//! Dropout on the attention weights without a stored mask: a counter-based generator
//! (Threefry-2×32, 20 rounds, of the Random123 family Philox belongs to: additions, rotations
//! and xors of 32-bit words only, so it runs the same on every runtime) keyed by the seed and
//! the (batch, head) pair, with the (query position, key) of each weight as its counter. The
//! forward draws the mask, the backward draws the identical one again; nothing `Sq × Sk` is
//! kept.
//!
//! A weight is kept when the generator's first word is at least `threshold = ⌊p·2³²⌉`, so with
//! probability `1 − p` (to 2⁻³²), and the kept ones are scaled by `1 / (1 − p)`: PyTorch's and
//! FlashAttention's `P̃ = P ⊙ keep / (1 − p)`.
//!
//! [`keep`] is the same generator on the host: tests materialise the kernels' mask with it.

use cubecl::prelude::*;

/// Rotations of Threefry-2×32.
const ROT: [u32; 8] = [13, 15, 26, 6, 17, 29, 16, 24];
/// Threefry's key-schedule parity constant.
const PARITY: u32 = 0x1BD1_1BDA;
/// Odd multiplier that spreads the (batch, head) index over the second key word (a bijection
/// modulo 2³²: distinct pairs never share a key).
const PAIR_MIX: u32 = 0x9E37_79B9;

/// Dropout of one call, in the kernels' terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DropoutParams {
    /// Low word of the seed.
    pub seed_lo: u32,
    /// High word of the seed.
    pub seed_hi: u32,
    /// A weight is kept when the generator's word is at least this: `⌊p·2³²⌉`.
    pub threshold: u32,
    /// `1 / (1 − p)`, as f32 bits (`f32::to_bits`).
    pub inv_keep_bits: u32,
}

impl DropoutParams {
    /// The parameters of probability `p` (in `[0, 1)`) and `seed`.
    pub fn new(p: f64, seed: u64) -> Self {
        Self {
            seed_lo: seed as u32,
            seed_hi: (seed >> 32) as u32,
            threshold: threshold(p),
            inv_keep_bits: ((1.0 / (1.0 - p)) as f32).to_bits(),
        }
    }

    /// `1 / (1 − p)`.
    pub fn inv_keep(&self) -> f32 {
        f32::from_bits(self.inv_keep_bits)
    }
}

/// `⌊p·2³²⌉`, saturated.
pub fn threshold(p: f64) -> u32 {
    (p * 4_294_967_296.0).round().clamp(0.0, u32::MAX as f64) as u32
}

/// Threefry-2×32-20 of counter `(c0, c1)` under key `(k0, k1)`: the first output word.
pub fn threefry(c0: u32, c1: u32, k0: u32, k1: u32) -> u32 {
    let ks = [k0, k1, PARITY ^ k0 ^ k1];
    let (mut x0, mut x1) = (c0.wrapping_add(k0), c1.wrapping_add(k1));
    for round in 0..20 {
        x0 = x0.wrapping_add(x1);
        x1 = x1.rotate_left(ROT[round % 8]) ^ x0;
        if round % 4 == 3 {
            let s = round / 4 + 1;
            x0 = x0.wrapping_add(ks[s % 3]);
            x1 = x1.wrapping_add(ks[(s + 1) % 3]).wrapping_add(s as u32);
        }
    }
    x0
}

/// Whether the weight of query position `pos` and key `key` of (batch, head) pair
/// `pair = b·Hq + h` is kept: the host twin of [`keep_weight()`].
pub fn keep(params: &DropoutParams, pair: usize, pos: usize, key: usize) -> bool {
    let k1 = params.seed_hi ^ (pair as u32).wrapping_mul(PAIR_MIX);
    threefry(key as u32, pos as u32, params.seed_lo, k1) >= params.threshold
}

/// `x` rotated left by `r`.
#[cube]
fn rotl(x: u32, #[comptime] r: u32) -> u32 {
    (x << r) | (x >> comptime!(32 - r))
}

/// The two words of the generator's state.
#[derive(CubeType)]
struct Words {
    a: u32,
    b: u32,
}

/// Four Threefry rounds with rotations `ROT[first..first + 4]`, then a key injection
/// (`ka`, `kb`, the round number already in `kb`).
#[cube]
fn four_rounds(x0: u32, x1: u32, #[comptime] first: usize, ka: u32, kb: u32) -> Words {
    let mut a = x0;
    let mut b = x1;
    a += b;
    b = rotl(b, comptime!(ROT[first])) ^ a;
    a += b;
    b = rotl(b, comptime!(ROT[first + 1])) ^ a;
    a += b;
    b = rotl(b, comptime!(ROT[first + 2])) ^ a;
    a += b;
    b = rotl(b, comptime!(ROT[first + 3])) ^ a;
    Words {
        a: a + ka,
        b: b + kb,
    }
}

/// The device generator: [`threefry`].
#[cube]
pub fn threefry_device(c0: u32, c1: u32, k0: u32, k1: u32) -> u32 {
    let k2 = k0 ^ k1 ^ PARITY;
    let w = four_rounds(c0 + k0, c1 + k1, 0usize, k1, k2 + 1u32);
    let w = four_rounds(w.a, w.b, 4usize, k2, k0 + 2u32);
    let w = four_rounds(w.a, w.b, 0usize, k0, k1 + 3u32);
    let w = four_rounds(w.a, w.b, 4usize, k1, k2 + 4u32);
    let w = four_rounds(w.a, w.b, 0usize, k2, k0 + 5u32);
    w.a
}

/// The factor of one weight: `1 / (1 − p)` where [`keep`] keeps it, else 0. With the
/// `dropout-fresh-mask` mutation the backward draws under another key (`fresh`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn keep_weight(
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    inv_keep: f32,
    pair: usize,
    pos: usize,
    key: usize,
    #[comptime] fresh: bool,
) -> f32 {
    let mut k0 = seed_lo;
    if comptime!(fresh && crate::mutation::dropout_fresh_mask()) {
        k0 += 1u32;
    }
    let k1 = seed_hi ^ (u32::cast_from(pair) * PAIR_MIX);
    let word = threefry_device(u32::cast_from(key), u32::cast_from(pos), k0, k1);
    select(word >= threshold, inv_keep, 0.0f32)
}
