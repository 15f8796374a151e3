//! What the kernels crate's GPU tests share: the seed of a run's inputs, SplitMix64 words, f16
//! bits of exact inputs.

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
