//! What the kernels crate's GPU tests share: the seed of a run's inputs, SplitMix64 words, f16
//! bits of exact inputs, the 16-bit types of the attention tests. Each test binary uses a part.

#![allow(dead_code)]

use burn_flash_kernels::attention::{
    AmpereTile, AmpereUse, AttentionKernel, AttentionOptions, TileSchedule,
};
use burn_flash_kernels::tensor::TensorRef;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::{ComputeClient, Runtime};
use cubecl::server::Handle;

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

/// The CUDA client of the default device, which must be a Hopper GPU (sm_90): `what` needs one.
pub fn hopper_client(what: &str) -> ComputeClient<CudaRuntime> {
    let client = CudaRuntime::client(&CudaDevice::default());
    assert!(
        burn_flash_kernels::hopper::sm90(&client),
        "{what} need a Hopper GPU (sm_90): this is the GPU suite"
    );
    client
}

/// Contiguous strides of `shape`.
pub fn contiguous(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len() - 1).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// A tensor view of `handle`.
pub fn t<'a>(handle: &'a Handle, shape: &'a [usize], strides: &'a [usize]) -> TensorRef<'a> {
    TensorRef {
        handle,
        shape,
        strides,
    }
}

/// Offsets of the elements of `shape` in `[B, H, S, D]` order, through `strides`.
pub fn offsets(shape: [usize; 4], strides: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(shape.iter().product());
    for b in 0..shape[0] {
        for h in 0..shape[1] {
            for s in 0..shape[2] {
                for d in 0..shape[3] {
                    out.push(b * strides[0] + h * strides[1] + s * strides[2] + d * strides[3]);
                }
            }
        }
    }
    out
}

/// The length in elements of a buffer holding the element offsets `places` (at least 1).
fn span(places: &[usize]) -> usize {
    places.iter().max().map_or(1, |m| m + 1)
}

fn le_bytes(words: &[u16]) -> Vec<u8> {
    words.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A buffer holding `values` (in `[B, H, S, D]` order) as `half`, laid out through `strides`.
pub fn upload(
    client: &ComputeClient<CudaRuntime>,
    half: Half,
    values: &[f32],
    shape: [usize; 4],
    strides: &[usize],
) -> Handle {
    let places = offsets(shape, strides);
    let mut mem = vec![0u16; span(&places)];
    for (&x, &at) in values.iter().zip(&places) {
        mem[at] = half.bits(x);
    }
    client.create_from_slice(&le_bytes(&mem))
}

/// A 16-bit buffer for `shape` through `strides`, poisoned with 0x7fc0 (NaN in f16 and bf16).
pub fn poisoned(
    client: &ComputeClient<CudaRuntime>,
    shape: [usize; 4],
    strides: &[usize],
) -> Handle {
    client.create_from_slice(&le_bytes(&vec![0x7fc0u16; span(&offsets(shape, strides))]))
}

/// The values of a `half` buffer holding `shape` through `strides`, in `[B, H, S, D]` order.
pub fn download(
    client: &ComputeClient<CudaRuntime>,
    half: Half,
    handle: Handle,
    shape: [usize; 4],
    strides: &[usize],
) -> Vec<f64> {
    let bytes = client.read_one(handle).expect("reads a 16-bit buffer");
    offsets(shape, strides)
        .into_iter()
        .map(|at| half.value(u16::from_le_bytes([bytes[2 * at], bytes[2 * at + 1]])))
        .collect()
}

/// `call` once, then (where `repeats > 0`) `repeats` times between two syncs: its first
/// result and the wall milliseconds per timed call (0 where untimed).
pub fn timed<T>(
    client: &ComputeClient<CudaRuntime>,
    repeats: usize,
    call: impl Fn() -> T,
) -> (T, f64) {
    let first = call();
    if repeats == 0 {
        return (first, 0.0);
    }
    cubecl::future::block_on(client.sync()).expect("syncs");
    let start = std::time::Instant::now();
    for _ in 0..repeats {
        call();
    }
    cubecl::future::block_on(client.sync()).expect("syncs");
    (first, start.elapsed().as_secs_f64() * 1e3 / repeats as f64)
}

/// The largest `|got − want|` (a NaN counts as infinite).
pub fn max_error(got: &[f64], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_nan() {
                f64::INFINITY
            } else {
                (g - w).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// The measured shapes of the at-size tests (B 4, H 16; S 4096 with D 128, causal or not,
/// D 64 and D 256; S 1024 with D 128).
pub fn at_size_cases() -> impl Iterator<Item = Case> {
    [
        (4096, 128, false),
        (4096, 128, true),
        (4096, 64, false),
        (1024, 128, false),
        (4096, 256, false),
    ]
    .into_iter()
    .map(|(s, d, causal)| Case {
        causal,
        ..Case::new(4, 16, 16, s, s, d, d)
    })
}

/// Runs `check` on each case with the run's seed plus `offset + i` (`what`: the tests, for the
/// client's message).
pub fn check_cases(
    what: &str,
    cases: impl IntoIterator<Item = Case>,
    offset: u64,
    check: impl Fn(&ComputeClient<CudaRuntime>, Case, u64),
) {
    check_cases_on(&hopper_client(what), cases, offset, check);
}

/// [`check_cases`] on `client`.
pub fn check_cases_on(
    client: &ComputeClient<CudaRuntime>,
    cases: impl IntoIterator<Item = Case>,
    offset: u64,
    check: impl Fn(&ComputeClient<CudaRuntime>, Case, u64),
) {
    let client = client.clone();
    let seed = seed();
    for (i, c) in cases.into_iter().enumerate() {
        check(&client, c, seed.wrapping_add(offset + i as u64));
    }
}

/// One measured shape and type of an at-size test: the Hopper kernel's and the `mma` kernel's
/// time per call and their outputs, by name.
pub struct AtSize {
    pub hopper_ms: f64,
    pub mma_ms: f64,
    pub outputs: Vec<(&'static str, Vec<f64>, Vec<f64>)>,
}

/// The at-size harness: for each of [`at_size_cases`] in both 16-bit types, `run` times the
/// Hopper and `mma` kernels; their times are printed (TFLOP/s counting `passes` × the forward)
/// and each output of the Hopper kernel must equal the `mma` kernel's within 8 half-ulps
/// (`relative`: of the larger of 1 and the output's largest magnitude).
pub fn at_size<I>(
    what: &str,
    passes: f64,
    relative: bool,
    inputs: impl Fn(&Case, u64) -> I,
    run: impl Fn(&ComputeClient<CudaRuntime>, &Case, Half, &I) -> AtSize,
) {
    let client = hopper_client(what);
    let seed = seed();
    for c in at_size_cases() {
        let (s, d, causal) = (c.sq, c.d, c.causal);
        let inputs = inputs(&c, seed);
        for half in [Half::F16, Half::Bf16] {
            let r = run(&client, &c, half, &inputs);
            let tflops = |ms: f64| c.tflops(ms, passes);
            print!(
                "S {s} D {d} causal {causal} {half:?}: hopper {:.3} ms ({:.1} TFLOP/s), mma {:.3} ms ({:.1} TFLOP/s)",
                r.hopper_ms,
                tflops(r.hopper_ms),
                r.mma_ms,
                tflops(r.mma_ms)
            );
            for (name, got, base) in &r.outputs {
                let diff = max_error(got, base);
                let scale = base.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                print!(", {name} |hopper − mma| {diff:.2e} of {scale:.2e}");
                let unit = if relative { scale.max(1.0) } else { 1.0 };
                assert!(
                    diff <= 8.0 * half.half_ulp() * unit,
                    "causal {causal} {half:?} {name}: |hopper − mma| = {diff:e} (largest {scale:e})"
                );
            }
            println!();
        }
    }
}

/// One attention call of the Hopper tests: sizes and options; `bshd`: the query-side tensors
/// (`q`, `out`, and in the backward `dO`, `dQ`) stored `[B, S, H, D]` and passed as permuted
/// views.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub dv: usize,
    pub causal: bool,
    pub softcap: Option<f32>,
    pub bshd: bool,
    /// [`AttentionOptions::deterministic`].
    pub deterministic: bool,
    /// [`AttentionOptions::schedule`].
    pub schedule: TileSchedule,
    /// The Ampere backward ahead of the Hopper one ([`AmpereUse::Always`]; else the default).
    pub ampere: bool,
    /// [`AttentionOptions::ampere_tile`]: the Ampere backward's block shape (any shape that
    /// fits this GPU, whatever its default would be).
    pub ampere_tile: AmpereTile,
}

impl Case {
    pub fn new(b: usize, hq: usize, hkv: usize, sq: usize, sk: usize, d: usize, dv: usize) -> Self {
        Self {
            b,
            hq,
            hkv,
            sq,
            sk,
            d,
            dv,
            causal: false,
            softcap: None,
            bshd: false,
            deterministic: false,
            schedule: TileSchedule::Planned,
            ampere: false,
            ampere_tile: AmpereTile::Planned,
        }
    }

    /// TFLOP/s of `passes` forwards' worth of work in `ms` milliseconds (4·B·H·Sq·Sk·D, half
    /// under causal; a backward is 2.5 forwards).
    pub fn tflops(&self, ms: f64, passes: f64) -> f64 {
        let causal = if self.causal { 0.5 } else { 1.0 };
        let flops = passes * 4.0 * (self.b * self.hq * self.sq * self.sk * self.d) as f64;
        flops * causal / (ms * 1e-3) / 1e12
    }

    pub fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }

    pub fn options(&self, kernel: Option<AttentionKernel>) -> AttentionOptions {
        AttentionOptions {
            scale: self.scale() as f32,
            softcap: self.softcap,
            causal: self.causal,
            kernel,
            deterministic: self.deterministic,
            schedule: self.schedule,
            ampere_backward: if self.ampere {
                AmpereUse::Always
            } else {
                AmpereUse::Faster
            },
            ampere_tile: self.ampere_tile,
            ..Default::default()
        }
    }

    pub fn q_shape(&self) -> [usize; 4] {
        [self.b, self.hq, self.sq, self.d]
    }

    pub fn out_shape(&self) -> [usize; 4] {
        [self.b, self.hq, self.sq, self.dv]
    }

    pub fn k_shape(&self) -> [usize; 4] {
        [self.b, self.hkv, self.sk, self.d]
    }

    pub fn v_shape(&self) -> [usize; 4] {
        [self.b, self.hkv, self.sk, self.dv]
    }

    /// Strides of a query-side tensor of `shape` (permuted where `bshd`).
    pub fn query_strides(&self, shape: [usize; 4]) -> Vec<usize> {
        let [_, h, s, d] = shape;
        if self.bshd {
            vec![s * h * d, d, h * d, 1]
        } else {
            contiguous(&shape)
        }
    }
}

/// The non-causal calls both Hopper directions are checked on: head dims 64, 128 and 256 and
/// their rounding (96, 72, 192; Dv ≠ D), lengths that leave partial row and key blocks, grouped-query
/// heads, softcap, `[B, S, H, D]` strides.
pub fn grid() -> [Case; 8] {
    [
        Case::new(1, 2, 2, 128, 128, 64, 64),
        Case::new(1, 4, 2, 200, 333, 256, 256),
        Case {
            bshd: true,
            ..Case::new(1, 2, 1, 130, 200, 192, 64)
        },
        Case::new(2, 4, 2, 200, 333, 128, 128),
        Case::new(1, 3, 1, 77, 515, 96, 64),
        Case::new(1, 2, 1, 300, 129, 72, 128),
        Case {
            softcap: Some(5.0),
            ..Case::new(1, 2, 2, 256, 384, 128, 128)
        },
        Case {
            bshd: true,
            ..Case::new(2, 4, 4, 190, 260, 64, 64)
        },
    ]
}

/// The causal calls (bottom-right aligned) both Hopper directions are checked on: `Sq = Sk`,
/// `Sq < Sk`, `Sq > Sk` (rows without a key), softcap with `Dv ≠ D`, D 256 with Dv 128.
pub fn causal_grid() -> [Case; 5] {
    let causal = |c: Case| Case { causal: true, ..c };
    [
        causal(Case::new(1, 2, 1, 150, 300, 256, 128)),
        causal(Case::new(1, 2, 2, 384, 384, 128, 128)),
        causal(Case::new(2, 4, 2, 100, 700, 64, 64)),
        causal(Case::new(1, 2, 1, 333, 200, 128, 64)),
        Case {
            softcap: Some(3.0),
            ..causal(Case::new(1, 2, 2, 257, 257, 64, 128))
        },
    ]
}
