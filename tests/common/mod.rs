//! Shared test machinery: f64 CPU references, random inputs, tolerance checks.

#![allow(dead_code)]

pub mod attention_ref;
pub mod memory_check;
pub mod peak_memory;

use std::cell::RefCell;

use burn::tensor::{Bool, FloatDType, Tensor, TensorData, backend::Backend};
use burn_flash::SoftmaxVariant;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The plan inputs the GPU suite sets through the environment, made the process's plan defaults
/// ([`burn_flash::set_plan_defaults`]) on first use; every suite test calls it first (the
/// library itself reads no environment). `BURN_FLASH_HOPPER`: `off`, `always` or `faster` (the
/// default); `BURN_FLASH_DECODE_KEYS` (4, 8, 16) and `BURN_FLASH_DECODE_CUBES` (1–64): the
/// decoding schedule; `BURN_FLASH_DETERMINISTIC` (`1`, `0`): the deterministic backward;
/// `BURN_FLASH_PERSISTENT` and `BURN_FLASH_BWD_OVERLAP`: the Hopper kernels' schedules
/// ([`burn_flash::PlanDefaults::from_settings`]).
/// Whether the forward plan of an f32 call of `dims` with `options` on `device` takes TF32
/// products (`FlashAttentionOptions::tf32`, or the run's `BURN_FLASH_TF32`): where it does, the
/// suites' f64 checks take the naive TF32 model.
pub fn tf32_forward<B: burn_flash::FlashBackend>(
    device: &B::Device,
    dims: burn_flash::attention::AttentionDims,
    dtype: FloatDType,
    options: burn_flash::FlashAttentionOptions,
) -> bool {
    dtype == FloatDType::F32
        && burn_flash::attention_plan::<B>(device, dims, dtype.into(), options)
            .and_then(Result::ok)
            .is_some_and(|p| p.config.tf32)
}

/// Whether an f32 call on `device` takes TF32 products by the run's plan inputs
/// (`BURN_FLASH_TF32=1`, [`plan_inputs`]) on CUDA (every GPU this project runs is sm_80+).
pub fn tf32_by_default<D: std::fmt::Debug>(device: &D, dtype: burn::tensor::FloatDType) -> bool {
    dtype == burn::tensor::FloatDType::F32
        && plan_inputs().tf32
        && format!("{device:?}").to_lowercase().contains("cuda")
}

pub fn plan_inputs() -> burn_flash::PlanDefaults {
    static SET: std::sync::OnceLock<burn_flash::PlanDefaults> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        let d = burn_flash::PlanDefaults::from_settings(|name| std::env::var(name).ok())
            .unwrap_or_else(|e| panic!("BURN_FLASH_* plan inputs: {e}"));
        burn_flash::set_plan_defaults(d);
        d
    })
}

/// Absolute and relative tolerance of one dtype: `|got − want| ≤ atol + rtol·|want|`.
#[derive(Debug, Clone, Copy)]
pub struct Tol {
    pub atol: f64,
    pub rtol: f64,
}

/// Per-dtype tolerances for softmax outputs (values in [0, 1]). The relative part is a few
/// units of the dtype's rounding (f32 2^-24, f16 2^-11, bf16 2^-8) plus the f32 exp's error.
pub fn tol(dtype: FloatDType) -> Tol {
    match dtype {
        FloatDType::F32 | FloatDType::Flex32 => Tol {
            atol: 1e-7,
            rtol: 2e-5,
        },
        FloatDType::F16 => Tol {
            atol: 2e-5,
            rtol: 2e-3,
        },
        FloatDType::BF16 => Tol {
            atol: 2e-4,
            rtol: 1.6e-2,
        },
        FloatDType::F64 => Tol {
            atol: 1e-12,
            rtol: 1e-10,
        },
    }
}

/// Tolerance for a variant on inputs of magnitude up to `max_abs`: log-softmax outputs are
/// differences of numbers as large as the inputs, so their absolute error scales with them.
pub fn tol_for(dtype: FloatDType, variant: SoftmaxVariant, max_abs: f64) -> Tol {
    let t = tol(dtype);
    match variant {
        SoftmaxVariant::LogSoftmax => Tol {
            atol: t.rtol * (1.0 + max_abs),
            rtol: t.rtol,
        },
        _ => t,
    }
}

thread_local! {
    /// The test's input generator: seeded once per test (libtest runs each test on a thread
    /// of its own), from `BURN_FLASH_SEED` when set, else at random.
    static INPUTS: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// The next seed of this test's input stream. The first call of a test picks the test's seed
/// and prints it; libtest shows a test's output when it fails, so a failure names its seed, and
/// `BURN_FLASH_SEED=<seed> cargo test <name>` draws the same inputs again.
pub fn fresh_seed() -> u64 {
    INPUTS.with(|inputs| {
        inputs
            .borrow_mut()
            .get_or_insert_with(|| {
                let seed = match std::env::var("BURN_FLASH_SEED") {
                    Ok(s) => s.trim().parse().expect("BURN_FLASH_SEED: an integer"),
                    Err(_) => rand::rng().random(),
                };
                eprintln!("inputs from seed {seed} (replay: BURN_FLASH_SEED={seed})");
                StdRng::seed_from_u64(seed)
            })
            .random()
    })
}

pub fn uniform(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Uploads `values` (row-major) as a tensor of `dtype`. The values tests use as reference inputs
/// must be read back from the device (rounded to `dtype`), not taken from `values`.
pub fn tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::<B, D>::from_data(TensorData::new(values, shape), device).cast(dtype)
}

/// A random tensor of `dtype` with values uniform in `[lo, hi)`.
pub fn random<B: Backend, const D: usize>(
    shape: [usize; D],
    lo: f32,
    hi: f32,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    tensor::<B, D>(uniform(n, lo, hi, fresh_seed()), shape, dtype, device)
}

/// Device values in logical row-major order, as f64.
pub fn read<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    let data = t.into_data().convert::<f32>();
    data.to_vec::<f32>()
        .expect("f32 data")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Best-effort poisoning: allocates and frees NaN-filled buffers of the output's size, so that
/// Burn's memory pool hands one of them to the op under test; an element the kernel forgets to
/// write then reads back as NaN and fails the comparison.
pub fn poison<B: Backend, const D: usize>(
    shape: [usize; D],
    dtype: FloatDType,
    device: &B::Device,
) {
    if shape.contains(&0) {
        return;
    }
    let t = Tensor::<B, D>::full(shape, f32::NAN, device).cast(dtype);
    let _ = t.clone().sum();
    B::sync(device).expect("sync after poisoning");
    drop(t);
}

/// Waits for the device and fails the test if any kernel failed (compilation errors surface
/// only here).
pub fn sync<B: Backend>(device: &B::Device) {
    B::sync(device).expect("device sync: a kernel failed");
}

/// f64 reference of the softmax family along `dim` of a row-major `shape`, with burn-flash's
/// semantics: a fully −inf row gives 0 (softmax, quiet) or −inf (log); a NaN poisons its row.
pub fn softmax_ref(x: &[f64], shape: &[usize], dim: usize, variant: SoftmaxVariant) -> Vec<f64> {
    let n = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut y = vec![0.0; x.len()];
    for o in 0..outer {
        for i in 0..inner {
            let idx = |j: usize| (o * n + j) * inner + i;
            let row: Vec<f64> = (0..n).map(|j| x[idx(j)]).collect();
            let out = softmax_row_ref(&row, variant);
            for j in 0..n {
                y[idx(j)] = out[j];
            }
        }
    }
    y
}

pub fn softmax_row_ref(row: &[f64], variant: SoftmaxVariant) -> Vec<f64> {
    if row.iter().any(|v| v.is_nan()) {
        return vec![f64::NAN; row.len()];
    }
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let m = if m == f64::NEG_INFINITY { 0.0 } else { m };
    let shift = match variant {
        SoftmaxVariant::QuietSoftmax => m.max(0.0),
        _ => m,
    };
    let s: f64 = row.iter().map(|v| (v - shift).exp()).sum();
    row.iter()
        .map(|v| match variant {
            SoftmaxVariant::Softmax => {
                if s == 0.0 {
                    0.0
                } else {
                    (v - shift).exp() / s
                }
            }
            SoftmaxVariant::QuietSoftmax => (v - shift).exp() / ((-shift).exp() + s),
            SoftmaxVariant::LogSoftmax => {
                if s == 0.0 {
                    f64::NEG_INFINITY
                } else {
                    v - shift - s.ln()
                }
            }
        })
        .collect()
}

/// f64 reference of the backward along `dim` from `y` and `dy` (row-major): `dx`, and per
/// element the size of the terms `dx` is made of before they cancel, `y·(|dy| + |Σ dy⊙y|)`
/// (softmax, quiet softmax) or `|dy| + e^y·|Σ dy|` (log-softmax). Rounding `y` or the row sum
/// moves `dx` by a fraction of these, however small `dx` itself is.
pub fn softmax_backward_ref(
    y: &[f64],
    dy: &[f64],
    shape: &[usize],
    dim: usize,
    variant: SoftmaxVariant,
) -> (Vec<f64>, Vec<f64>) {
    let n = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut dx = vec![0.0; y.len()];
    let mut terms = vec![0.0; y.len()];
    for o in 0..outer {
        for i in 0..inner {
            let idx = |j: usize| (o * n + j) * inner + i;
            let s: f64 = (0..n)
                .map(|j| match variant {
                    SoftmaxVariant::LogSoftmax => dy[idx(j)],
                    _ => dy[idx(j)] * y[idx(j)],
                })
                .sum();
            for j in 0..n {
                let (yj, dyj) = (y[idx(j)], dy[idx(j)]);
                (dx[idx(j)], terms[idx(j)]) = match variant {
                    SoftmaxVariant::LogSoftmax => {
                        (dyj - yj.exp() * s, dyj.abs() + yj.exp() * s.abs())
                    }
                    _ => (yj * (dyj - s), yj * (dyj.abs() + s.abs())),
                };
            }
        }
    }
    (dx, terms)
}

/// With `BURN_FLASH_MARGINS` set, prints a passing check's worst error as a share of what it
/// allows (1 fails), so that a run shows which tolerances random inputs come close to.
pub fn report_margin(share: f64, context: &str) {
    // (NaN: an empty comparison.)
    if !share.is_nan() && std::env::var_os("BURN_FLASH_MARGINS").is_some() {
        eprintln!("margin {share:.3}: {context}");
    }
}

/// Asserts `got ≈ want` element-wise: NaN where and only where the reference is NaN, exact
/// infinities, finite values within `tol`.
pub fn assert_close(got: &[f64], want: &[f64], tol: Tol, context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: length");
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol.atol + tol.rtol * w.abs()
        };
        assert!(
            ok,
            "{context}: element {i}: got {g:e}, want {w:e} (tol {tol:?}); {} elements",
            got.len()
        );
        if w.is_finite() {
            let excess = (g - w).abs() / (tol.atol + tol.rtol * w.abs());
            if excess > worst.0 {
                worst = (excess, i);
            }
        }
    }
    report_margin(worst.0, context);
}

/// Rows (along `dim`) of a softmax output sum to 1 and every value is in [0, 1].
pub fn assert_probabilities(
    y: &[f64],
    shape: &[usize],
    dim: usize,
    dtype: FloatDType,
    context: &str,
) {
    let n = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let t = tol(dtype);
    for o in 0..outer {
        for i in 0..inner {
            let mut s = 0.0;
            for j in 0..n {
                let v = y[(o * n + j) * inner + i];
                assert!(
                    (0.0..=1.0).contains(&v),
                    "{context}: value {v} outside [0, 1]"
                );
                s += v;
            }
            // Each of n outputs is rounded to the dtype: the sum drifts by up to ~rtol, plus, in
            // f16, up to half a subnormal step (2^-25) per element once outputs fall below f16's
            // normal range (rows longer than ~16 000).
            let subnormal = if dtype == FloatDType::F16 {
                2f64.powi(-25)
            } else {
                0.0
            };
            assert!(
                (s - 1.0).abs() <= 4.0 * t.rtol + 1e-6 + n as f64 * subnormal,
                "{context}: row ({o}, {i}) sums to {s}"
            );
        }
    }
}

/// A `[d0, d1, d2]` tensor of `dtype`, uniform in `[-scale, scale)`.
pub fn rand3<B: Backend>(
    shape: [usize; 3],
    scale: f32,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, 3> {
    random::<B, 3>(shape, -scale, scale, dtype, device)
}

/// A `[d0, d1, d2, d3]` tensor of `dtype`, uniform in `[-scale, scale)`.
pub fn rand4<B: Backend>(
    shape: [usize; 4],
    scale: f32,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, 4> {
    random::<B, 4>(shape, -scale, scale, dtype, device)
}

/// A bool tensor of `dims` whose element at index `[i0, i1, …]` is `f` of it (row-major).
pub fn bool_mask<B: Backend, const D: usize>(
    dims: [usize; D],
    device: &B::Device,
    f: impl Fn([usize; D]) -> bool,
) -> Tensor<B, D, Bool> {
    let n: usize = dims.iter().product();
    let values: Vec<bool> = (0..n)
        .map(|mut i| {
            let mut idx = [0usize; D];
            for d in (0..D).rev() {
                idx[d] = i % dims[d];
                i /= dims[d];
            }
            f(idx)
        })
        .collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

/// Unit roundoff of a dtype's storage.
pub fn eps(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F16 => 2f64.powi(-11),
        FloatDType::BF16 => 2f64.powi(-8),
        FloatDType::F64 => 2f64.powi(-53),
        _ => 2f64.powi(-24),
    }
}

/// Largest finite magnitude.
pub fn max_abs(v: &[f64]) -> f64 {
    v.iter()
        .filter(|a| a.is_finite())
        .fold(0.0f64, |a, b| a.max(b.abs()))
}

/// Largest `|got − want|`; infinite when an element is NaN (or infinite) where `want` is
/// finite, or differs where `want` is not finite.
pub fn max_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "max_err: lengths");
    got.iter().zip(want).fold(0.0f64, |worst, (&g, &w)| {
        let e = if w.is_finite() {
            (g - w).abs()
        } else if g == w || (g.is_nan() && w.is_nan()) {
            0.0
        } else {
            f64::INFINITY
        };
        if e.is_nan() {
            f64::INFINITY
        } else {
            worst.max(e)
        }
    })
}

/// FlashAttention's rule: the fused result's largest error against the f64 reference `want`
/// is at most twice that of the naive composition in the same dtype (`naive`, same inputs),
/// plus a floor of `floor_ulps` roundings of the largest reference value. Elements where the
/// naive result is NaN (Burn's composition on fully masked rows) do not count for its error.
pub fn assert_within_naive(
    got: &[f64],
    naive: &[f64],
    want: &[f64],
    dtype: FloatDType,
    floor_ulps: f64,
    context: &str,
) {
    let e_fused = max_err(got, want);
    let (n_kept, w_kept): (Vec<f64>, Vec<f64>) = naive
        .iter()
        .zip(want)
        .filter(|(n, _)| !n.is_nan())
        .map(|(&n, &w)| (n, w))
        .unzip();
    let e_naive = max_err(&n_kept, &w_kept);
    let floor = floor_ulps * eps(dtype) * max_abs(want);
    report_margin(
        e_fused / (2.0 * e_naive + floor),
        &format!("{context} (error {e_fused:.2e}, naive {e_naive:.2e}, floor {floor:.2e})"),
    );
    assert!(
        e_fused <= 2.0 * e_naive + floor,
        "{context}: error {e_fused:e} > 2 × naive error {e_naive:e} + floor {floor:e} \
         (max |reference| {:e})",
        max_abs(want)
    );
}

/// Row by row along `dim` of a row-major `shape`: `|got − want| ≤ rel · max_row scale`, where
/// `scale` holds per element the magnitude of the terms that make up `want` (a sum's terms
/// before they cancel). The tolerance follows each row's own magnitudes, so it shrinks with the
/// gradient: a zero or half-computed row fails however small its values are.
pub fn assert_rows_close(
    got: &[f64],
    want: &[f64],
    scale: &[f64],
    shape: &[usize],
    dim: usize,
    rel: f64,
    context: &str,
) {
    assert_eq!(got.len(), want.len(), "{context}: length");
    let n = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut worst = 0.0f64;
    for o in 0..outer {
        for i in 0..inner {
            let idx = |j: usize| (o * n + j) * inner + i;
            let row_scale = (0..n).map(|j| scale[idx(j)].abs()).fold(0.0f64, f64::max);
            let allowed = rel * row_scale;
            for j in 0..n {
                let (g, w) = (got[idx(j)], want[idx(j)]);
                if allowed > 0.0 {
                    worst = worst.max((g - w).abs() / allowed);
                }
                assert!(
                    (g - w).abs() <= allowed,
                    "{context}: row ({o}, {i}) element {j}: got {g:e}, want {w:e}; allowed \
                     {allowed:e} = {rel:e} × the row's largest term {row_scale:e}"
                );
            }
        }
    }
    report_margin(worst, context);
}

/// The forward kernel the suite's calls ask for: the plan's (`None`), unless the GPU run sets
/// `BURN_FLASH_FORWARD=cooperative`, which forces the cooperative-matrix forward on every 16-bit
/// call that leaves the kernel to the plan, so that the whole suite runs it on CUDA (`wmma`),
/// where the plan picks the `mma` kernel.
pub fn forward_kernel(
    options: burn_flash::FlashAttentionOptions,
    dtype: FloatDType,
) -> burn_flash::FlashAttentionOptions {
    let forced = std::env::var("BURN_FLASH_FORWARD").ok();
    match forced.as_deref() {
        None | Some("") => options,
        Some("cooperative") if options.kernel.is_none() && dtype != FloatDType::F32 => {
            burn_flash::FlashAttentionOptions {
                kernel: Some(burn_flash::AttentionKernel::CooperativeMatrix),
                ..options
            }
        }
        Some("cooperative") => options,
        Some(other) => panic!("BURN_FLASH_FORWARD: `cooperative` or unset, got `{other}`"),
    }
}

/// Whether the run forces the cooperative-matrix forward ([`forward_kernel`]), which takes the
/// cooperative-matrix backward with it.
pub fn cooperative_forced() -> bool {
    std::env::var("BURN_FLASH_FORWARD").as_deref() == Ok("cooperative")
}

/// The message of the panic `f` must raise.
pub fn panic_message(f: impl FnOnce()) -> String {
    let err =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("expected a panic");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// One `#[test]` per listed suite function, instantiated for one backend and dtype. Each test
/// ends with the device idle: work still queued (a test that only checks refusals reads
/// nothing back) must finish, and fail the test if it fails, before the process may exit.
#[allow(unused_macros)]
macro_rules! suite {
    ($module:ident, $backend:ty, $dtype:expr, [$($test:ident),* $(,)?]) => {
        mod $module {
            use super::*;
            $(
                #[test]
                fn $test() {
                    common::plan_inputs();
                    let device = Default::default();
                    super::$test::<$backend>(&device, $dtype);
                    <$backend as burn::tensor::backend::Backend>::sync(&device)
                        .expect("the device's work at the end of the test");
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use suite;

/// Whether Burn's f32 matmul on this backend rounds its operands to TF32-class precision
/// (Burn 0.21's does on CUDA; full f32 accumulation errs ~1e-7 here).
pub fn f32_matmul_is_tf32<B: Backend>(device: &B::Device) -> bool {
    let (m, k, n) = (16, 512, 16);
    let a = uniform(m * k, -1.0, 1.0, fresh_seed());
    let b = uniform(k * n, -1.0, 1.0, fresh_seed());
    let ta = Tensor::<B, 2>::from_data(TensorData::new(a.clone(), [m, k]), device);
    let tb = Tensor::<B, 2>::from_data(TensorData::new(b.clone(), [k, n]), device);
    let got = read(ta.matmul(tb));
    let mut worst = 0.0f64;
    for i in 0..m {
        for j in 0..n {
            let (mut want, mut size) = (0.0f64, 0.0f64);
            for l in 0..k {
                let p = a[i * k + l] as f64 * b[l * n + j] as f64;
                want += p;
                size += p.abs();
            }
            worst = worst.max((got[i * n + j] - want).abs() / size);
        }
    }
    worst > 1e-6
}
