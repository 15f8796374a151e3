//! What the kernels crate's GPU tests share: the seed of a run's inputs, SplitMix64 words, f16
//! bits of exact inputs, the 16-bit types of the attention tests. Each test binary uses a part.

#![allow(dead_code)]

use cubecl::ir::{ElemType, FloatKind, StorageType};

/// The seed of this run's inputs: `BURN_FLASH_SEED`, else the clock; printed, so that a failed
/// test can be replayed.
pub fn seed() -> u64 {
    let seed = std::env::var("BURN_FLASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("inputs from seed {seed} (replay: BURN_FLASH_SEED={seed})");
    seed
}

/// `n` SplitMix64 words from `seed`.
pub fn splitmix(n: usize, seed: u64) -> impl Iterator<Item = u64> {
    let mut state = seed;
    (0..n).map(move |_| {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// f16 bits of `x`, a normal number (or 0) whose significand fits f16's 11 bits: the tests
/// draw inputs that are exact in f16, so the kernels and the f64 reference see the same values.
pub fn f16_bits(x: f32) -> u16 {
    if x == 0.0 {
        return 0;
    }
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    assert!(
        (1..31).contains(&exp) && bits & 0x1fff == 0,
        "{x} is not exact in f16"
    );
    sign | ((exp as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

/// SplitMix64 values `k / 64` for integers `|k| ≤ 127`: exact in f16 and bf16, so the kernels
/// and the f64 reference see the same inputs.
pub fn draw(n: usize, seed: u64) -> Vec<f32> {
    splitmix(n, seed)
        .map(|z| ((z % 255) as i32 - 127) as f32 / 64.0)
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Half {
    F16,
    Bf16,
}

impl Half {
    pub fn dtype(self) -> StorageType {
        StorageType::Scalar(ElemType::Float(match self {
            Self::F16 => FloatKind::F16,
            Self::Bf16 => FloatKind::BF16,
        }))
    }

    /// The bits of `x`, which must be exact in this type (inputs from [`draw`]).
    pub fn bits(self, x: f32) -> u16 {
        let bits = x.to_bits();
        match self {
            Self::Bf16 => {
                assert_eq!(bits & 0xffff, 0, "{x} is not exact in bf16");
                (bits >> 16) as u16
            }
            Self::F16 => f16_bits(x),
        }
    }

    pub fn value(self, bits: u16) -> f64 {
        match self {
            Self::Bf16 => f64::from(f32::from_bits(u32::from(bits) << 16)),
            Self::F16 => {
                let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
                let exp = i32::from((bits >> 10) & 0x1f);
                let frac = f64::from(bits & 0x3ff);
                match exp {
                    0 => sign * frac * 2f64.powi(-24),
                    31 if frac == 0.0 => sign * f64::INFINITY,
                    31 => f64::NAN,
                    e => sign * (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
                }
            }
        }
    }

    /// Half an ulp at 1.
    pub fn half_ulp(self) -> f64 {
        match self {
            Self::F16 => 2f64.powi(-11),
            Self::Bf16 => 2f64.powi(-8),
        }
    }
}
