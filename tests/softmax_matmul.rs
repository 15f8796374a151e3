//! The `softmax(X)·V` suite: test bodies generic over the backend, instantiated per backend and
//! dtype at the bottom (wgpu always; CUDA with `--features cuda`; NdArray for the fallback).
//! Every check compares with an f64 reference of the values actually on the device, on fresh
//! random inputs, with the output buffer poisoned and the device synced before reading.

mod common;

use burn::backend::Autodiff;
use burn::tensor::{DType, FloatDType, Tensor, activation, backend::Backend};
use burn_flash::kernels::softmax_matmul::{BLOCK_SIZES, SmmDims, SmmForwardKernel, SmmPath};
use burn_flash::{
    FlashBackend, SoftmaxMatmulOptions, TileSchedule, softmax_matmul, softmax_matmul_plan,
    softmax_matmul_with,
};
use common::*;

/// Absolute tolerance of an output `Σ_j p_j v_j` with `max|v| = v_max`: rounding of the result
/// to the dtype, of `P` (to the operand type on matrix units) and of `V`, plus f32 summation
/// and `exp` error over the row (`64 · 2^-24`, ~4e-6 relative).
fn out_tol(dtype: FloatDType, v_max: f64) -> Tol {
    let e = eps(dtype);
    Tol {
        atol: (4.0 * e + 64.0 * 2f64.powi(-24)) * v_max.max(1e-30),
        rtol: 2.0 * e,
    }
}

/// The problem as `[batch, d1, d2]` / `[batch or 1, d2, d3]` row-major f64 values.
struct Problem {
    batch: usize,
    d1: usize,
    d2: usize,
    d3: usize,
    shared_v: bool,
    x: Vec<f64>,
    v: Vec<f64>,
}

impl Problem {
    fn read<B: Backend, const D: usize, const DV: usize>(
        x: &Tensor<B, D>,
        v: &Tensor<B, DV>,
    ) -> Self {
        let (xs, vs) = (x.dims(), v.dims());
        let batch = xs[..D - 2].iter().product();
        let v_batch: usize = vs[..DV - 2].iter().product();
        Self {
            batch,
            d1: xs[D - 2],
            d2: xs[D - 1],
            d3: vs[DV - 1],
            shared_v: v_batch == 1,
            x: read(x.clone()),
            v: read(v.clone()),
        }
    }

    fn x_at(&self, b: usize, i: usize, j: usize) -> f64 {
        self.x[(b * self.d1 + i) * self.d2 + j]
    }

    /// The most steps of 16 columns, after a row's first, that raise the row's running maximum
    /// (over the rows): the rescales of an online softmax with the smallest column block.
    fn max_raises(&self) -> usize {
        let mut most = 0;
        for b in 0..self.batch {
            for i in 0..self.d1 {
                let mut m = f64::NEG_INFINITY;
                let mut raises = 0;
                for (k, j0) in (0..self.d2).step_by(16).enumerate() {
                    let step = (j0..(j0 + 16).min(self.d2)).map(|j| self.x_at(b, i, j));
                    let step_max = step.fold(f64::NEG_INFINITY, f64::max);
                    if step_max > m {
                        raises += usize::from(k > 0 && m.is_finite());
                        m = step_max;
                    }
                }
                most = most.max(raises);
            }
        }
        most
    }

    fn v_at(&self, b: usize, j: usize, c: usize) -> f64 {
        let b = if self.shared_v { 0 } else { b };
        self.v[(b * self.d2 + j) * self.d3 + c]
    }

    /// Row `(b, i)` of the softmax in f64; zeros for a row without a finite score.
    fn p_row(&self, b: usize, i: usize) -> Vec<f64> {
        let row: Vec<f64> = (0..self.d2).map(|j| self.x_at(b, i, j)).collect();
        softmax_row_ref(&row, burn_flash::SoftmaxVariant::Softmax)
    }

    fn forward(&self) -> Vec<f64> {
        let mut out = vec![0.0; self.batch * self.d1 * self.d3];
        for b in 0..self.batch {
            for i in 0..self.d1 {
                let p = self.p_row(b, i);
                for (j, &pj) in p.iter().enumerate() {
                    for c in 0..self.d3 {
                        out[(b * self.d1 + i) * self.d3 + c] += pj * self.v_at(b, j, c);
                    }
                }
            }
        }
        out
    }

    /// `(dx, dv)` for the output gradient `g` (`[batch, d1, d3]`).
    fn backward(&self, g: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let v_batches = if self.shared_v { 1 } else { self.batch };
        let mut dx = vec![0.0; self.batch * self.d1 * self.d2];
        let mut dv = vec![0.0; v_batches * self.d2 * self.d3];
        for b in 0..self.batch {
            let vb = if self.shared_v { 0 } else { b };
            for i in 0..self.d1 {
                let p = self.p_row(b, i);
                let gi = &g[(b * self.d1 + i) * self.d3..][..self.d3];
                let dp: Vec<f64> = (0..self.d2)
                    .map(|j| (0..self.d3).map(|c| gi[c] * self.v_at(b, j, c)).sum())
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..self.d2 {
                    dx[(b * self.d1 + i) * self.d2 + j] = p[j] * (dp[j] - delta);
                    for c in 0..self.d3 {
                        dv[(vb * self.d2 + j) * self.d3 + c] += p[j] * gi[c];
                    }
                }
            }
        }
        (dx, dv)
    }
}

/// Runs the op (output poisoned, device synced) and compares it with the f64 reference; where
/// every score is finite, also with the naive composition in the same dtype: the fused error
/// must stay within 2× the naive one (plus one rounding of the largest output).
fn check_forward<B: FlashBackend, const D: usize, const DV: usize>(
    x: Tensor<B, D>,
    v: Tensor<B, DV>,
    options: SoftmaxMatmulOptions,
    dtype: FloatDType,
    context: &str,
) {
    let device = x.device();
    let p = Problem::read(&x, &v);
    let mut out_shape = x.dims();
    out_shape[D - 1] = p.d3;
    poison::<B, D>(out_shape, dtype, &device);
    let out = softmax_matmul_with(x.clone(), v.clone(), options);
    assert_eq!(out.dims(), out_shape, "{context}: output shape");
    sync::<B>(&device);
    let got = read(out);
    let want = p.forward();
    let ctx = format!(
        "{context}: x {:?} v {:?} {dtype:?} {options:?}",
        x.dims(),
        v.dims()
    );
    let v_max = max_abs(&p.v);
    assert_close(&got, &want, out_tol(dtype, v_max), &ctx);
    if p.x.iter().all(|a| a.is_finite()) && p.d2 > 0 {
        let naive = activation::softmax(x, D - 1).matmul({
            let dims = v.dims();
            v.reshape(v_as_rank::<D, DV>(dims))
        });
        let naive = read(naive);
        // In f16/bf16 both errors are dominated by the storage rounding and one rounding of the
        // largest output is floor enough. In f32 both are accumulation errors of a few ulps, and
        // the fused kernel adds one rounding of `O` and `l` per online step (up to one per 16
        // columns: CI saw 27 ulps against a naive 13 at d2 = 4099 on lavapipe), and per step
        // that raises the row's maximum the device `exp` of the rescale `e^(−Δ)`, which a GPU
        // may compute to `3 + 2Δ` ulp (Vulkan's rule) on a share `≤ e^(−Δ)` of the output: at
        // most 6 roundings per raise (s47's rehearsal: 5.8e-7 against 2 × 2.1e-7 + 1.2e-7 at
        // blocks (64, 16), d2 40, scores ±8, seed 16528432086463601507).
        let floor_ulps = match dtype {
            FloatDType::F32 => (p.d2 as f64 / 16.0).max(2.0) + 6.0 * p.max_raises() as f64,
            _ => 1.0,
        };
        assert_within_naive(&got, &naive, &want, dtype, floor_ulps, &ctx);
    }
}

/// `v`'s shape at rank `D`: its own when it has `x`'s rank, else `[1, .., 1, d2, d3]` (Burn's
/// matmul broadcasts unit batch dims).
fn v_as_rank<const D: usize, const DV: usize>(v_dims: [usize; DV]) -> [usize; D] {
    let mut s = [1usize; D];
    s[D - 2] = v_dims[DV - 2];
    s[D - 1] = v_dims[DV - 1];
    if DV == D {
        s.copy_from_slice(&v_dims[..D]);
    }
    s
}

/// Every listed size of each dimension, with the other two small; `d1` around the default
/// block (64) too.
fn odd_and_boundary_sizes<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxMatmulOptions::default();
    for d1 in [1, 7, 63, 64, 65, 97] {
        let x = rand3::<B>([2, d1, 65], 4.0, dtype, device);
        let v = rand3::<B>([2, 65, 59], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("d1 = {d1}"));
    }
    for d2 in [1, 63, 64, 65, 1025, 4099] {
        let x = rand3::<B>([1, 7, d2], 4.0, dtype, device);
        let v = rand3::<B>([1, d2, 8], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("d2 = {d2}"));
    }
    for d3 in [1, 8, 59, 512, 1024] {
        let x = rand3::<B>([1, 97, 65], 4.0, dtype, device);
        let v = rand3::<B>([1, 65, d3], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("d3 = {d3}"));
    }
}

/// 0, 1 and 2 batch dims; `v` shared as a 2-D tensor or with all-ones batch dims.
fn batch_dims_and_shared_v<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxMatmulOptions::default();
    let x = random::<B, 2>([33, 70], -4.0, 4.0, dtype, device);
    let v = random::<B, 2>([70, 24], -1.0, 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "no batch dims");
    let x = rand3::<B>([3, 33, 70], 4.0, dtype, device);
    let v = rand3::<B>([3, 70, 24], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "one batch dim");
    let x = random::<B, 4>([2, 3, 33, 70], -4.0, 4.0, dtype, device);
    let v = random::<B, 4>([2, 3, 70, 24], -1.0, 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "two batch dims");
    let x = random::<B, 4>([2, 3, 33, 70], -4.0, 4.0, dtype, device);
    let v = random::<B, 2>([70, 24], -1.0, 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "shared 2-D v");
    let x = random::<B, 4>([2, 3, 33, 70], -4.0, 4.0, dtype, device);
    let v = random::<B, 4>([1, 1, 70, 24], -1.0, 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "shared v with unit batch dims");
    // A transposed (non-contiguous) x and v.
    let x = rand3::<B>([2, 70, 33], 4.0, dtype, device).swap_dims(1, 2);
    let v = rand3::<B>([2, 24, 70], 1.0, dtype, device).swap_dims(1, 2);
    check_forward(x, v, opts, dtype, "transposed inputs");
}

/// Scores of ±50: the running maximum moves by far more than `exp` can absorb, so a missing
/// or wrong rescale of the accumulator shows. Rows whose maximum grows along the row too.
fn large_magnitudes<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxMatmulOptions::default();
    for d2 in [65, 1025] {
        let x = rand3::<B>([2, 40, d2], 50.0, dtype, device);
        let v = rand3::<B>([2, d2, 40], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("±50, d2 = {d2}"));
    }
    // Increasing ramp + noise: the maximum is in the last block of every row.
    let d2 = 300;
    let ramp: Vec<f32> = (0..d2).map(|j| 0.3 * j as f32).collect();
    let ramp = tensor::<B, 3>(ramp, [1, 1, d2], dtype, device);
    let x = rand3::<B>([1, 20, d2], 2.0, dtype, device) + ramp;
    let v = rand3::<B>([1, d2, 16], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "maximum in the last block");
}

/// Rows that are entirely −inf give zeros; partly −inf rows ignore the −inf scores.
fn masked_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (d1, d2, d3) = (9, 130, 20);
    let x = rand3::<B>([2, d1, d2], 4.0, dtype, device);
    // Row 0: fully masked; row 3: masked after column 5; row 8: only the last column finite.
    let mut mask = vec![false; 2 * d1 * d2];
    for b in 0..2 {
        for j in 0..d2 {
            mask[(b * d1) * d2 + j] = true;
            mask[(b * d1 + 3) * d2 + j] = j > 5;
            mask[(b * d1 + 8) * d2 + j] = j + 1 < d2;
        }
    }
    let mask = Tensor::<B, 3, burn::tensor::Bool>::from_data(
        burn::tensor::TensorData::new(mask, [2, d1, d2]),
        device,
    );
    let x = x.mask_fill(mask, f32::NEG_INFINITY);
    let v = rand3::<B>([2, d2, d3], 1.0, dtype, device);
    let opts = SoftmaxMatmulOptions::default();
    check_forward(x.clone(), v.clone(), opts, dtype, "masked rows");
    let out = read(softmax_matmul(x, v));
    assert!(
        out[..d3]
            .iter()
            .chain(&out[d1 * d3..][..d3])
            .all(|&a| a == 0.0),
        "fully masked rows must be exactly 0"
    );
}

/// Every forced `(block_1, block_2)` gives the reference result, with `d1` and `d2` just off
/// the block sizes, and `d3 = 259`: three column tiles of the flash loop (the grid's third
/// axis), the last one partial.
fn every_forced_block_size<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for b1 in BLOCK_SIZES {
        for b2 in BLOCK_SIZES {
            let opts = SoftmaxMatmulOptions {
                blocks: Some((b1, b2)),
                ..Default::default()
            };
            let x = rand3::<B>([2, b1 + 1, 2 * b2 + 1], 8.0, dtype, device);
            let v = rand3::<B>([2, 2 * b2 + 1, 259], 1.0, dtype, device);
            check_forward(x, v, opts, dtype, &format!("blocks ({b1}, {b2})"));
            let x = rand3::<B>([1, b1 - 1, b2 - 1], 8.0, dtype, device);
            let v = rand3::<B>([1, b2 - 1, 17], 1.0, dtype, device);
            check_forward(
                x,
                v,
                opts,
                dtype,
                &format!("blocks ({b1}, {b2}), sizes − 1"),
            );
        }
    }
}

/// Rows whose lengths and strides are multiples of 16 bytes, the layout the 16-bit
/// matrix-unit kernel takes on CUDA (scores loaded 8 at a time, `V` copied asynchronously):
/// `d2` and `d3` multiples of 8 but not of the blocks, ±50 scores, masked rows, shared `v`,
/// and every forced block size.
fn aligned_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxMatmulOptions::default();
    for (d1, d2, d3) in [(1, 8, 8), (97, 72, 136), (130, 264, 272), (17, 1032, 64)] {
        let x = rand3::<B>([2, d1, d2], 8.0, dtype, device);
        let v = rand3::<B>([2, d2, d3], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("aligned {d1}×{d2}×{d3}"));
    }
    let x = rand3::<B>([2, 40, 264], 50.0, dtype, device);
    let v = rand3::<B>([1, 264, 40], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "aligned, ±50, shared v");
    // Increasing ramp + noise over four 128-column steps: every step raises the row maximum
    // (`d3` 96: the Hopper kernel's 128-column tile, where the others take 64 or 256).
    let d2 = 392;
    let ramp: Vec<f32> = (0..d2).map(|j| 0.3 * j as f32).collect();
    let ramp = tensor::<B, 3>(ramp, [1, 1, d2], dtype, device);
    let x = rand3::<B>([1, 20, d2], 2.0, dtype, device) + ramp;
    let v = rand3::<B>([1, d2, 96], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "aligned, maximum in the last step");
    for b1 in BLOCK_SIZES {
        for b2 in BLOCK_SIZES {
            let opts = SoftmaxMatmulOptions {
                blocks: Some((b1, b2)),
                ..Default::default()
            };
            let x = rand3::<B>([1, b1 + 3, 2 * b2 + 8], 8.0, dtype, device);
            let v = rand3::<B>([1, 2 * b2 + 8, 24], 1.0, dtype, device);
            check_forward(x, v, opts, dtype, &format!("aligned, blocks ({b1}, {b2})"));
        }
    }
    // Fully masked rows (0 and 5), a row finite only in its last 8 columns (3) and one
    // finite only in its first column (6).
    let rows = MaskedRows {
        full: [0, 5],
        tail: (3, 8),
        head: 6,
    };
    check_masked_rows::<B>(
        (9, 136, 16),
        rows,
        opts,
        dtype,
        device,
        "aligned, masked rows",
    );
}

/// Which rows of a `[1, d1, d2]` score matrix [`check_masked_rows()`] masks with −inf.
struct MaskedRows {
    /// Rows masked entirely: their outputs must be exactly 0.
    full: [usize; 2],
    /// A row finite only in its last `tail.1` columns.
    tail: (usize, usize),
    /// A row finite only in its first column.
    head: usize,
}

/// The forward with `options` on random scores of `dims = (d1, d2, d3)` (one batch) whose
/// `rows` are masked, against the reference, and the fully masked rows exactly 0.
fn check_masked_rows<B: FlashBackend>(
    (d1, d2, d3): (usize, usize, usize),
    rows: MaskedRows,
    options: SoftmaxMatmulOptions,
    dtype: FloatDType,
    device: &B::Device,
    context: &str,
) {
    let [full0, full1] = rows.full;
    let mut mask = vec![false; d1 * d2];
    for j in 0..d2 {
        mask[full0 * d2 + j] = true;
        mask[full1 * d2 + j] = true;
        mask[rows.tail.0 * d2 + j] = j + rows.tail.1 < d2;
        mask[rows.head * d2 + j] = j > 0;
    }
    let mask = Tensor::<B, 3, burn::tensor::Bool>::from_data(
        burn::tensor::TensorData::new(mask, [1, d1, d2]),
        device,
    );
    let x = rand3::<B>([1, d1, d2], 4.0, dtype, device).mask_fill(mask, f32::NEG_INFINITY);
    let v = rand3::<B>([1, d2, d3], 1.0, dtype, device);
    check_forward(x.clone(), v.clone(), options, dtype, context);
    let out = read(softmax_matmul_with(x, v, options));
    assert!(
        out[full0 * d3..][..d3]
            .iter()
            .chain(&out[full1 * d3..][..d3])
            .all(|&a| a == 0.0),
        "fully masked rows must be exactly 0"
    );
}

/// The register-tiled plain-unit kernel (the heuristic's choice on plain units for outputs of
/// at least 65 × 65, where the runtime has plane shuffles): partial 128 × 128 output tiles and
/// partial 16-column steps, vector widths 4, 2 and 1, ±50 scores and a rising maximum (lazy
/// rescale), masked rows, shared and transposed inputs. The plan says the tiled kernel runs (128
/// rows per cube on plain units).
fn tiled_units<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxMatmulOptions {
        path: Some(SmmPath::Units),
        ..Default::default()
    };
    let dims = SmmDims {
        batch: 2,
        d1: 130,
        d2: 1025,
        d3: 200,
    };
    match softmax_matmul_plan::<B>(device, dims, dtype.into(), opts) {
        Some(Ok(plan)) => {
            assert_eq!(plan.kernel, SmmForwardKernel::Tiled);
            let tiled = (plan.blocks(), plan.cubes);
            assert_eq!(
                tiled,
                ((128, 16, 128), (2, 2, 2)),
                "the tiled kernel's plan"
            );
        }
        Some(Err(err)) => panic!("{err}"),
        None => return,
    }
    // (d1, d2, d3): vectors of 1 (odd), 2 and 4 elements; one step, many, a partial last one.
    for (d1, d2, d3) in [
        (130, 257, 200),
        (129, 18, 130),
        (200, 136, 264),
        (65, 1, 65),
        (97, 259, 66),
    ] {
        let x = rand3::<B>([2, d1, d2], 8.0, dtype, device);
        let v = rand3::<B>([2, d2, d3], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("tiled {d1}×{d2}×{d3}"));
    }
    let x = rand3::<B>([2, 140, 272], 50.0, dtype, device);
    let v = rand3::<B>([1, 272, 72], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "tiled, ±50, shared v");
    let x = rand3::<B>([2, 300, 150], 4.0, dtype, device).swap_dims(1, 2);
    let v = rand3::<B>([2, 90, 300], 1.0, dtype, device).swap_dims(1, 2);
    check_forward(x, v, opts, dtype, "tiled, transposed inputs");
    // The maximum rises along every row: the reference maximum moves many times.
    let d2 = 333;
    let ramp: Vec<f32> = (0..d2).map(|j| 0.25 * j as f32).collect();
    let ramp = tensor::<B, 3>(ramp, [1, 1, d2], dtype, device);
    let x = rand3::<B>([1, 150, d2], 2.0, dtype, device) + ramp;
    let v = rand3::<B>([1, d2, 80], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "tiled, rising maximum");
    // Fully masked rows (0 and 129), one finite only in its last column (5), one only in its
    // first (77).
    let rows = MaskedRows {
        full: [0, 129],
        tail: (5, 1),
        head: 77,
    };
    check_masked_rows::<B>(
        (130, 70, 72),
        rows,
        opts,
        dtype,
        device,
        "tiled, masked rows",
    );
}

/// Long rows and wide outputs, on the default plan: many steps of every kernel, several output
/// column tiles, 16-byte aligned and not. GPU runs only (minutes on a CPU); the CPU suites cover
/// the same partial tiles and steps on smaller sizes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn large_problems<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxMatmulOptions::default();
    for (d1, d2, d3) in [
        (130, 1025, 200),
        (200, 1032, 520),
        (97, 4099, 66),
        (130, 1032, 520),
        (17, 4104, 64),
    ] {
        let x = rand3::<B>([2, d1, d2], 8.0, dtype, device);
        let v = rand3::<B>([2, d2, d3], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("large {d1}×{d2}×{d3}"));
    }
    let x = rand3::<B>([2, 140, 1040], 50.0, dtype, device);
    let v = rand3::<B>([1, 1040, 72], 1.0, dtype, device);
    check_forward(x, v, opts, dtype, "large, ±50, shared v");
}

/// Both inner-product paths (where the device has matrix units) agree with the reference.
fn every_path<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for path in [SmmPath::Units, SmmPath::MatrixUnits] {
        let opts = SoftmaxMatmulOptions {
            path: Some(path),
            ..Default::default()
        };
        let dims = SmmDims {
            batch: 2,
            d1: 70,
            d2: 300,
            d3: 72,
        };
        match softmax_matmul_plan::<B>(device, dims, dtype.into(), opts) {
            Some(Ok(plan)) => assert_eq!(plan.path(), path),
            Some(Err(err)) => {
                // Only the matrix units may be missing (no `mma` on this device, or f32).
                assert_eq!(path, SmmPath::MatrixUnits, "{err}");
                continue;
            }
            None => return,
        }
        let x = rand3::<B>([2, 70, 300], 8.0, dtype, device);
        let v = rand3::<B>([2, 300, 72], 1.0, dtype, device);
        check_forward(x, v, opts, dtype, &format!("{path:?}"));
    }
}

/// `hopper: Some(true)` runs the Hopper kernel where the device can (an sm_90 GPU through CUDA,
/// f16/bf16, 16-byte rows: values against the reference, with two row blocks, one 256-column
/// tile and five 64-key steps, all partial; one block per tile and 1 and 3 persistent blocks)
/// and is refused with the reason elsewhere; `Some(false)` never runs it; forcing it with forced
/// blocks or plain units is refused.
fn hopper_option<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = SmmDims {
        batch: 2,
        d1: 130,
        d2: 264,
        d3: 136,
    };
    let with = |hopper, blocks, path| SoftmaxMatmulOptions {
        hopper,
        blocks,
        path,
        ..Default::default()
    };
    let on = with(Some(true), None, None);
    let Some(plan) = softmax_matmul_plan::<B>(device, dims, dtype.into(), on) else {
        // No fused kernels (NdArray, Autodiff): nothing to plan.
        return;
    };
    match plan {
        Ok(plan) => {
            assert_eq!(plan.kernel, SmmForwardKernel::Hopper);
            assert_ne!(
                dtype,
                FloatDType::F32,
                "the Hopper kernel takes 16-bit types"
            );
            let x = rand3::<B>([2, 130, 264], 8.0, dtype, device);
            let v = rand3::<B>([2, 264, 136], 1.0, dtype, device);
            check_forward(x.clone(), v.clone(), on, dtype, "Hopper forced");
            // 4 tiles (one 256-column tile × 2 row blocks × 2 batches): one block each, or 1
            // and 3 persistent blocks taking them in rounds (a dynamic schedule, attention's
            // only, runs as a static one).
            for (schedule, blocks) in [
                (TileSchedule::PerTile, 4),
                (TileSchedule::Blocks(1), 1),
                (TileSchedule::Blocks(3), 3),
                (TileSchedule::DynamicBlocks(3), 3),
            ] {
                let options = SoftmaxMatmulOptions { schedule, ..on };
                let plan = softmax_matmul_plan::<B>(device, dims, dtype.into(), options)
                    .expect("fused")
                    .expect("plans");
                assert_eq!(plan.cubes, (blocks, 1, 1), "{schedule:?}");
                let context = format!("Hopper forced, {schedule:?}");
                check_forward(x.clone(), v.clone(), options, dtype, &context);
            }
        }
        Err(err) => {
            let reason = err.to_string();
            assert!(
                reason.contains("not a Hopper GPU")
                    || reason.contains("takes f16 and bf16")
                    || reason.contains("switched off"),
                "{dtype:?}: {reason}"
            );
        }
    }
    let off = with(Some(false), None, None);
    let plan = softmax_matmul_plan::<B>(device, dims, dtype.into(), off).expect("fused");
    assert_ne!(plan.expect("plans").kernel, SmmForwardKernel::Hopper);
    for (options, why) in [
        (with(Some(true), Some((64, 32)), None), "no forced blocks"),
        (
            with(Some(true), None, Some(SmmPath::Units)),
            "not plain units",
        ),
    ] {
        let err = softmax_matmul_plan::<B>(device, dims, dtype.into(), options)
            .expect("fused")
            .expect_err("refused");
        assert!(err.to_string().contains(why), "{options:?}: {err}");
    }
}

/// Bad input panics before any launch with a message naming the problem.
fn bad_input_is_refused<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let x = rand3::<B>([2, 8, 16], 1.0, dtype, device);
    let msg = panic_message(|| {
        softmax_matmul(x.clone(), rand3::<B>([2, 15, 4], 1.0, dtype, device));
    });
    assert!(
        msg.contains("`v` has 15 rows but `x` has 16 columns"),
        "{msg}"
    );
    let msg = panic_message(|| {
        softmax_matmul(x.clone(), rand3::<B>([3, 16, 4], 1.0, dtype, device));
    });
    assert!(
        msg.contains("batch dims [3] differ from `x`'s [2]"),
        "{msg}"
    );
    let msg = panic_message(|| {
        softmax_matmul(
            x.clone(),
            random::<B, 4>([1, 2, 16, 4], -1.0, 1.0, dtype, device),
        );
    });
    assert!(msg.contains("rank of `x` (3) or rank 2"), "{msg}");
    let other = match dtype {
        FloatDType::F32 if B::supports_dtype(device, DType::F16) => FloatDType::F16,
        FloatDType::F32 => FloatDType::F64,
        _ => FloatDType::F32,
    };
    let msg = panic_message(|| {
        softmax_matmul(x.clone(), rand3::<B>([2, 16, 4], 1.0, other, device));
    });
    assert!(msg.contains("`v` has dtype"), "{msg}");
    sync::<B>(device);
}

/// A forced block size outside the supported set is an error naming the choice, before launch.
fn impossible_blocks_are_refused<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let x = rand3::<B>([2, 8, 16], 1.0, dtype, device);
    let v = rand3::<B>([2, 16, 4], 1.0, dtype, device);
    for blocks in [(48, 32), (32, 8), (128, 64)] {
        let opts = SoftmaxMatmulOptions {
            blocks: Some(blocks),
            ..Default::default()
        };
        let msg = panic_message(|| {
            softmax_matmul_with(x.clone(), v.clone(), opts);
        });
        assert!(
            msg.contains(&format!("block sizes {blocks:?} cannot run")),
            "{blocks:?}: {msg}"
        );
    }
    sync::<B>(device);
}

/// Gradients of both inputs against the f64 reference, by FlashAttention's rule: the largest
/// error is at most twice that of Burn's autodiff of the composed `softmax(x)·v` on the same
/// backend and dtype, plus a few roundings of the largest reference gradient. Plain, shared-`v`
/// and masked inputs; the gradient buffers are poisoned first.
fn gradients<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cases: [([usize; 3], [usize; 3], bool); 13] = [
        ([2, 37, 70], [2, 70, 24], false),
        // 16-byte rows (d2, d3 multiples of 8): the matrix-unit backward on CUDA f16/bf16, with
        // partial cubes along d1 and d2, partial output tiles and reduction chunks (d3 = 264,
        // d1 = 70), a shared `v` summed over batches with masked rows, and a tiny problem.
        ([2, 200, 136], [2, 136, 264], false),
        ([3, 70, 520], [1, 520, 40], true),
        ([2, 64, 1024], [2, 1024, 128], false),
        ([1, 33, 8], [1, 8, 8], false),
        // The tiled forward and the register-tiled backward products: vectors
        // of 4, 2 and 1 elements, partial tiles and steps, shared `v` with masked rows.
        ([2, 70, 100], [2, 100, 80], false),
        ([2, 97, 66], [2, 66, 130], false),
        ([1, 67, 129], [1, 129, 67], false),
        ([3, 130, 260], [1, 260, 72], true),
        ([3, 65, 129], [1, 129, 33], false),
        ([1, 7, 1025], [1, 1025, 8], false),
        ([2, 9, 40], [2, 40, 16], true),
        // A wide `d3`: four column tiles of `dV` on the matrix units, all of it in their `dX`
        // kernel; a shared `v` with masked rows.
        ([2, 40, 64], [1, 64, 512], true),
    ];
    for (xs, vs, masked) in cases {
        check_gradients::<B>(xs, vs, masked, dtype, device);
    }
}

/// Gradients of `sum(softmax_matmul(x, v) ⊙ w)` for random `x` (`masked`: row 1 of each batch
/// fully −inf, row 2 half), `v` and `w`, against the f64 reference, within twice a naive
/// same-dtype composition's error.
fn check_gradients<B: FlashBackend>(
    xs: [usize; 3],
    vs: [usize; 3],
    masked: bool,
    dtype: FloatDType,
    device: &B::Device,
) {
    check_gradients_with::<B>(xs, vs, masked, Default::default(), dtype, device);
}

/// [`check_gradients()`] through `softmax_matmul_with(…, options)`.
fn check_gradients_with<B: FlashBackend>(
    xs: [usize; 3],
    vs: [usize; 3],
    masked: bool,
    options: SoftmaxMatmulOptions,
    dtype: FloatDType,
    device: &B::Device,
) {
    type A<B> = Autodiff<B>;
    let ctx = format!("gradients x {xs:?} v {vs:?} masked {masked} {dtype:?} {options:?}");
    let mut x = rand3::<A<B>>(xs, 4.0, dtype, device);
    if masked {
        // Row 1 of each batch fully −inf, row 2 half.
        let mut m = vec![false; xs.iter().product()];
        for b in 0..xs[0] {
            for j in 0..xs[2] {
                m[(b * xs[1] + 1) * xs[2] + j] = true;
                m[(b * xs[1] + 2) * xs[2] + j] = j % 2 == 0;
            }
        }
        let m = Tensor::<A<B>, 3, burn::tensor::Bool>::from_data(
            burn::tensor::TensorData::new(m, xs),
            device,
        );
        x = x.mask_fill(m, f32::NEG_INFINITY);
    }
    let x = x.detach().require_grad();
    let v = rand3::<A<B>>(vs, 1.0, dtype, device).require_grad();
    let w = rand3::<A<B>>([xs[0], xs[1], vs[2]], 1.0, dtype, device);
    let loss = (softmax_matmul_with(x.clone(), v.clone(), options) * w.clone()).sum();
    // NaN-filled buffers of the gradients' sizes: an element the backward does not write
    // reads back as NaN.
    poison::<B, 3>(xs, dtype, device);
    poison::<B, 3>(vs, dtype, device);
    let grads = loss.backward();
    let dx = read(x.grad(&grads).expect("dx"));
    let dv = read(v.grad(&grads).expect("dv"));
    sync::<B>(device);

    let p = Problem::read(&x.clone().inner(), &v.clone().inner());
    let g = read(w.clone().inner());
    let (want_dx, want_dv) = p.backward(&g);
    let (naive_dx, naive_dv) = naive_gradients::<B>(&p, &g, dtype, device);
    // The backward rebuilds P = e^(x − lse) from the f32 log-sum-exp, whose rounding
    // (2^-24·|lse|, |lse| ≈ max x + ln d2 ≈ 10) is ~10 f32 ulps of P: the floor allows 16.
    // In f16/bf16 the storage rounding dominates and two ulps suffice.
    let floor = if dtype == FloatDType::F32 { 16.0 } else { 2.0 };
    assert_within_naive(
        &dx,
        &naive_dx,
        &want_dx,
        dtype,
        floor,
        &format!("{ctx}: dx"),
    );
    assert_within_naive(
        &dv,
        &naive_dv,
        &want_dv,
        dtype,
        floor,
        &format!("{ctx}: dv"),
    );
}

/// Gradients `(dx, dv)` of Burn's composed `softmax(x)·v` through `Autodiff<B>` in `dtype`, for
/// output gradient `g`. The composition gives NaN on a fully masked row; such rows get `x = 0`
/// and a zero output gradient instead, which leaves the true gradients unchanged (the row's `P`
/// is 0, so it contributes nothing to `dv`, and its `dx` is 0 either way).
fn naive_gradients<B: FlashBackend>(
    p: &Problem,
    g: &[f64],
    dtype: FloatDType,
    device: &B::Device,
) -> (Vec<f64>, Vec<f64>) {
    type A<B> = Autodiff<B>;
    let (rows, d2, d3) = (p.batch * p.d1, p.d2, p.d3);
    let (mut x, mut g) = (p.x.clone(), g.to_vec());
    for r in 0..rows {
        if x[r * d2..][..d2].iter().all(|&a| a == f64::NEG_INFINITY) {
            x[r * d2..][..d2].fill(0.0);
            g[r * d3..][..d3].fill(0.0);
        }
    }
    let up = |vals: &[f64], shape: [usize; 3]| {
        let vals: Vec<f32> = vals.iter().map(|&a| a as f32).collect();
        tensor::<A<B>, 3>(vals, shape, dtype, device)
    };
    let v_batch = if p.shared_v { 1 } else { p.batch };
    let xb = up(&x, [p.batch, p.d1, d2]).require_grad();
    let vb = up(&p.v, [v_batch, d2, d3]).require_grad();
    let y = activation::softmax(xb.clone(), 2).matmul(vb.clone());
    let grads = (y * up(&g, [p.batch, p.d1, d3])).sum().backward();
    let dx = read(xb.grad(&grads).expect("naive dx"));
    let dv = read(vb.grad(&grads).expect("naive dv"));
    sync::<B>(device);
    (dx, dv)
}

/// The forward kernel the plan names, per dtype and row alignment: with `matrix_units` (CUDA)
/// f16/bf16 with 16-byte rows take the flash loop on the matrix units (unless a forced
/// `block_2` is not a multiple of 32); f32, every dtype without matrix units (wgpu) and
/// unaligned rows take the register-tiled plain-unit kernel from 65 × 65 outputs and the flash
/// loop on plain units below or with forced blocks. A device without `mma` that offers
/// cooperative matrices for the dtype (NVIDIA's Vulkan driver through SPIR-V) takes them for
/// every 16-bit case but a forced plain-unit path. The launch matches on this plan's kernel and
/// nothing else.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
fn forward_kernels<R: burn_cubecl::cubecl::Runtime>(
    device: &R::Device,
    matrix_units: bool,
    hopper: bool,
) {
    use burn_flash::kernels::softmax_matmul::{
        SmmForwardKernel as K, check_dtype, contiguous_row_vector, plan_softmax_matmul, row_vector,
    };
    let client = R::client(device);
    // f16/bf16: the kernel with matrix units (the Hopper kernel on sm_90), and without.
    let sixteen = |mma: K, plain: K| match (hopper, matrix_units) {
        (true, _) => K::Hopper,
        (false, true) => mma,
        (false, false) => plain,
    };
    // Hopper off (the suite's `BURN_FLASH_HOPPER=off`, or no sm_90): said in the options, as
    // the library's plan defaults say it for calls without them.
    let base = SoftmaxMatmulOptions {
        hopper: (!hopper).then_some(false),
        ..Default::default()
    };
    let forced = SoftmaxMatmulOptions {
        blocks: Some((64, 16)),
        ..base
    };
    let units = SoftmaxMatmulOptions {
        path: Some(SmmPath::Units),
        ..base
    };
    let default = base;
    // (dtype, [batch, d1, d2, d3], x transposed, options, kernel)
    let cases = [
        (
            FloatDType::F32,
            [2, 130, 1024, 200],
            false,
            default,
            K::Tiled,
        ),
        (
            FloatDType::F32,
            [2, 33, 1024, 200],
            false,
            default,
            K::Units,
        ),
        (
            FloatDType::F32,
            [2, 130, 1024, 200],
            false,
            forced,
            K::Units,
        ),
        (
            FloatDType::F32,
            [2, 130, 1025, 200],
            true,
            default,
            K::Tiled,
        ),
        (
            FloatDType::F16,
            [2, 130, 1024, 200],
            false,
            default,
            sixteen(K::MatrixUnits, K::Tiled),
        ),
        (
            FloatDType::BF16,
            [2, 130, 1024, 200],
            false,
            default,
            sixteen(K::MatrixUnits, K::Tiled),
        ),
        (
            FloatDType::F16,
            [2, 33, 1024, 64],
            false,
            default,
            sixteen(K::MatrixUnits, K::Units),
        ),
        // d2 = 1025: rows are not 16-byte aligned.
        (
            FloatDType::F16,
            [2, 130, 1025, 200],
            false,
            default,
            K::Tiled,
        ),
        // A transposed `x` (unit stride across rows): no vector loads at all.
        (
            FloatDType::BF16,
            [2, 130, 1024, 200],
            true,
            default,
            K::Tiled,
        ),
        // 16-column steps: not whole 32-column chunks of the matrix-unit loop.
        (
            FloatDType::F16,
            [2, 130, 1024, 200],
            false,
            forced,
            K::Units,
        ),
        (FloatDType::F16, [2, 130, 1024, 200], false, units, K::Tiled),
    ];
    for (dtype, [batch, d1, d2, d3], transposed, options, want) in cases {
        let dtype_s = DType::from(dtype).into();
        let dims = SmmDims { batch, d1, d2, d3 };
        if check_dtype(&client, dtype_s).is_err() {
            // bf16 on an adapter without it (lavapipe); CUDA has every dtype.
            assert!(!matrix_units, "{dtype:?} unsupported");
            continue;
        }
        let vector = if transposed {
            row_vector(
                &[
                    (&[batch, d1, d2], &[d1 * d2, 1, d1]),
                    (&[batch, d2, d3], &[d2 * d3, d3, 1]),
                    (&[batch, d1, d3], &[d1 * d3, d3, 1]),
                ],
                dtype_s,
            )
        } else {
            contiguous_row_vector(dims, dtype_s)
        };
        let cooperative = !matrix_units
            && options.path != Some(SmmPath::Units)
            && burn_flash::kernels::flash::forward::cmma::fragment(&client, dtype_s, false)
                .is_some();
        let want = if cooperative {
            K::CooperativeMatrix
        } else {
            want
        };
        let plan = plan_softmax_matmul(&client, dims, dtype_s, vector, options)
            .unwrap_or_else(|err| panic!("{dtype:?} {dims:?}: {err}"));
        assert_eq!(
            plan.kernel, want,
            "{dtype:?} {dims:?} transposed {transposed} {options:?}: {plan:?}"
        );
    }
}

/// The backward path of the `gradients` cases: with `matrix_units` (CUDA) the 16-byte aligned
/// f16/bf16 cases take the flash backward core on the matrix units, so `gradients` checks
/// those; everything else, and a `d3` whose `dX` kernel would not fit in shared memory, takes
/// plain units: the register-tiled given-score products for gradients of at least 65 × 65,
/// the core's flash schedule below.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
fn backward_paths<R: burn_cubecl::cubecl::Runtime>(
    device: &R::Device,
    matrix_units: bool,
    hopper: bool,
) {
    use burn_flash::kernels::softmax_matmul::{
        SmmBackwardPath as P, check_dtype, plan_softmax_matmul_backward,
    };
    let client = R::client(device);
    // The matrix units (dX by the Hopper kernel on sm_90), else `fallback`.
    let mma = |fallback: P| match (hopper, matrix_units) {
        (true, _) => P::Hopper,
        (false, true) => P::MatrixUnits,
        (false, false) => fallback,
    };
    let cases = [
        (FloatDType::F16, [2, 200, 136], 264, false, mma(P::Tiled)),
        (FloatDType::BF16, [2, 200, 136], 264, false, mma(P::Tiled)),
        (FloatDType::F16, [3, 70, 520], 40, true, mma(P::Units)),
        (FloatDType::F16, [2, 64, 1024], 128, false, mma(P::Units)),
        (FloatDType::F16, [1, 33, 8], 8, false, mma(P::Units)),
        (FloatDType::F16, [2, 9, 40], 16, true, mma(P::Units)),
        (FloatDType::BF16, [2, 40, 64], 512, true, mma(P::Units)),
        // Rows that 16-byte vectors do not divide, f32, and a `d3` too wide for the matrix
        // units' `dX` kernel (dO and two steps of V in shared memory): plain units.
        (FloatDType::F16, [2, 70, 100], 80, false, P::Tiled),
        (FloatDType::F16, [1, 7, 1025], 8, false, P::Units),
        (FloatDType::F32, [2, 200, 136], 264, false, P::Tiled),
        (FloatDType::F16, [1, 80, 72], 1024, false, P::Tiled),
    ];
    for (dtype, [batch, d1, d2], d3, shared_v, want) in cases {
        let dims = SmmDims { batch, d1, d2, d3 };
        let v_shape = [if shared_v { 1 } else { batch }, d2, d3];
        let v_strides = [if shared_v { 0 } else { d2 * d3 }, d3, 1];
        let dtype_s = DType::from(dtype).into();
        if check_dtype(&client, dtype_s).is_err() {
            // bf16 on an adapter without it (lavapipe): the plan refuses it; CUDA has it.
            assert!(!matrix_units, "{dtype:?} unsupported");
            continue;
        }
        let got = plan_softmax_matmul_backward(
            &client,
            dims,
            dtype_s,
            [
                (&[batch, d1, d2], &[d1 * d2, d2, 1]),
                (&v_shape, &v_strides),
                (&[batch, d1, d3], &[d1 * d3, d3, 1]),
                (&[batch, d1, d2], &[d1 * d2, d2, 1]),
                (&v_shape, &[d2 * d3, d3, 1]),
            ],
            // Hopper off where the suite switches it off (or there is no sm_90).
            SoftmaxMatmulOptions {
                hopper: (!hopper).then_some(false),
                ..Default::default()
            },
        )
        .expect("plans")
        .path;
        // A device without `mma` that offers cooperative matrices for the dtype (NVIDIA's
        // Vulkan driver through SPIR-V) takes them for every 16-bit case with d3 up to 128.
        let cooperative = !matrix_units
            && d3 <= 128
            && burn_flash::kernels::flash::forward::cmma::fragment(&client, dtype_s, false)
                .is_some();
        let want = if cooperative {
            P::CooperativeMatrix
        } else {
            want
        };
        assert_eq!(got, want, "{dtype:?} x [{batch}, {d1}, {d2}], d3 {d3}");
    }
}

/// The fallback (and any backend) returns the dtype it was given.
fn dtype_is_honoured<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let x = rand3::<B>([2, 4, 8], 1.0, dtype, device);
    let v = rand3::<B>([2, 8, 3], 1.0, dtype, device);
    assert_eq!(softmax_matmul(x, v).dtype(), DType::from(dtype));
    sync::<B>(device);
}

/// Tests every backend runs.
macro_rules! common_suite {
    ($module:ident, $backend:ty, $dtype:expr) => {
        suite!(
            $module,
            $backend,
            $dtype,
            [
                odd_and_boundary_sizes,
                batch_dims_and_shared_v,
                large_magnitudes,
                masked_rows,
                bad_input_is_refused,
                gradients,
                dtype_is_honoured,
            ]
        );
    };
}

/// Tests of the fused kernels' own machinery.
macro_rules! fused_suite {
    ($module:ident, $backend:ty, $dtype:expr) => {
        suite!(
            $module,
            $backend,
            $dtype,
            [
                every_forced_block_size,
                aligned_rows,
                tiled_units,
                every_path,
                hopper_option,
                impossible_blocks_are_refused
            ]
        );
    };
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    type W = burn::backend::Wgpu;
    common_suite!(f32, W, FloatDType::F32);
    common_suite!(f16, W, FloatDType::F16);
    fused_suite!(fused_f32, W, FloatDType::F32);
    fused_suite!(fused_f16, W, FloatDType::F16);

    #[test]
    fn empty_and_degenerate() {
        common::plan_inputs();
        let device = Default::default();
        // d2 = 0: every row is empty, hence "fully masked": zeros.
        let x = Tensor::<W, 3>::zeros([2, 3, 0], &device);
        let v = Tensor::<W, 3>::zeros([2, 0, 4], &device);
        let out = softmax_matmul(x, v);
        sync::<W>(&device);
        assert_eq!(out.dims(), [2, 3, 4]);
        assert!(read(out).iter().all(|&a| a == 0.0));
        let x = Tensor::<W, 3>::zeros([2, 0, 5], &device);
        let v = Tensor::<W, 3>::ones([2, 5, 4], &device);
        assert_eq!(softmax_matmul(x, v).dims(), [2, 0, 4]);
        sync::<W>(&device);
    }

    #[test]
    fn backward_paths_on_plain_units() {
        common::plan_inputs();
        backward_paths::<burn::backend::wgpu::WgpuRuntime>(&Default::default(), false, false);
    }

    #[test]
    fn forward_kernels_on_plain_units() {
        common::plan_inputs();
        forward_kernels::<burn::backend::wgpu::WgpuRuntime>(&Default::default(), false, false);
    }

    mod unfused {
        use super::*;
        type U = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
        suite!(f32, U, FloatDType::F32, [odd_and_boundary_sizes, gradients]);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    type C = burn::backend::Cuda;
    common_suite!(f32, C, FloatDType::F32);
    common_suite!(f16, C, FloatDType::F16);
    common_suite!(bf16, C, FloatDType::BF16);
    fused_suite!(fused_f32, C, FloatDType::F32);
    fused_suite!(fused_f16, C, FloatDType::F16);
    fused_suite!(fused_bf16, C, FloatDType::BF16);
    suite!(large_f32, C, FloatDType::F32, [large_problems]);
    suite!(large_f16, C, FloatDType::F16, [large_problems]);
    suite!(large_bf16, C, FloatDType::BF16, [large_problems]);

    /// The backward paths on CUDA: on an sm_90 GPU (unless `BURN_FLASH_HOPPER=off`) dX by the
    /// Hopper kernel for 16-byte aligned f16/bf16 rows, and the `mma.sync` kernels where a
    /// buffer does not start on 16 bytes (no TMA map); the `mma.sync` kernels elsewhere.
    #[test]
    fn backward_paths_take_the_matrix_units() {
        common::plan_inputs();
        use burn_cubecl::cubecl::{Runtime, cuda::CudaRuntime};
        use burn_flash::kernels::softmax_matmul::{
            SmmBackwardPath, plan_softmax_matmul_backward_for,
        };
        let device = Default::default();
        let client = CudaRuntime::client(&device);
        let off = common::plan_inputs().hopper == burn_flash::HopperUse::Off;
        let hopper = burn_flash::kernels::hopper::sm90(&client) && !off;
        let options = SoftmaxMatmulOptions {
            hopper: off.then_some(false),
            ..Default::default()
        };
        println!("sm_90 with the Hopper kernels on: {hopper}");
        backward_paths::<CudaRuntime>(&device, true, hopper);
        let (batch, d1, d2, d3) = (2, 200, 136, 264);
        let dims = SmmDims { batch, d1, d2, d3 };
        let x = [batch, d1, d2];
        let v = [batch, d2, d3];
        let o = [batch, d1, d3];
        let (xs, vs, os) = ([d1 * d2, d2, 1], [d2 * d3, d3, 1], [d1 * d3, d3, 1]);
        for dtype in [FloatDType::F16, FloatDType::BF16] {
            let dtype = DType::from(dtype).into();
            let plan = |tma| {
                let layouts = [
                    (&x[..], &xs[..]),
                    (&v[..], &vs[..]),
                    (&o[..], &os[..]),
                    (&x[..], &xs[..]),
                    (&v[..], &vs[..]),
                ];
                plan_softmax_matmul_backward_for(&client, dims, dtype, layouts, tma, options)
                    .expect("plans")
                    .path
            };
            let want = if hopper {
                SmmBackwardPath::Hopper
            } else {
                SmmBackwardPath::MatrixUnits
            };
            assert_eq!(plan(true), want);
            assert_eq!(plan(false), SmmBackwardPath::MatrixUnits);
        }
    }

    /// The plan's forward kernels on CUDA: on an sm_90 GPU (unless `BURN_FLASH_HOPPER=off`)
    /// the Hopper kernel for 16-byte aligned f16/bf16 rows, and the `mma.sync` kernel where a
    /// buffer does not start on 16 bytes (no TMA map); the `mma.sync` kernel elsewhere.
    #[test]
    fn forward_kernels_take_the_matrix_units() {
        common::plan_inputs();
        use burn_cubecl::cubecl::{Runtime, cuda::CudaRuntime};
        use burn_flash::kernels::softmax_matmul::{contiguous_row_vector, plan_softmax_matmul_for};
        let device = Default::default();
        let client = CudaRuntime::client(&device);
        let off = common::plan_inputs().hopper == burn_flash::HopperUse::Off;
        let hopper = burn_flash::kernels::hopper::sm90(&client) && !off;
        let options = SoftmaxMatmulOptions {
            hopper: off.then_some(false),
            ..Default::default()
        };
        println!("sm_90 with the Hopper kernels on: {hopper}");
        forward_kernels::<CudaRuntime>(&device, true, hopper);
        let dims = SmmDims {
            batch: 2,
            d1: 130,
            d2: 1024,
            d3: 200,
        };
        for dtype in [FloatDType::F16, FloatDType::BF16] {
            let dtype = DType::from(dtype).into();
            let vector = contiguous_row_vector(dims, dtype);
            let plan = |tma| {
                plan_softmax_matmul_for(&client, dims, dtype, vector, tma, options)
                    .expect("plans")
                    .kernel
            };
            let want = if hopper {
                SmmForwardKernel::Hopper
            } else {
                SmmForwardKernel::MatrixUnits
            };
            assert_eq!(plan(true), want);
            assert_eq!(plan(false), SmmForwardKernel::MatrixUnits);
        }
    }

    /// The `dX` kernel with 128 rows per cube: the plan takes it where its row blocks give
    /// every multiprocessor one (here with partial last blocks, a shared `v` with masked rows,
    /// and a `d3` of several reduction chunks), and keeps 64 rows on a smaller grid.
    #[test]
    fn wide_dx_rows() {
        common::plan_inputs();
        use burn_cubecl::cubecl::Runtime;
        use burn_flash::kernels::flash::backward::mma::{DQ_ROWS, WIDE_DX_ROWS};
        use burn_flash::kernels::softmax_matmul::mma_dx_rows;
        let device = Default::default();
        let client = burn_cubecl::cubecl::cuda::CudaRuntime::client(&device);
        let sms = client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(1) as usize;
        // Row blocks of 128 that cover the device once over with a partial last one.
        let d1 = (sms.div_ceil(2) * WIDE_DX_ROWS as usize) - 37;
        let cases = [
            ([2, d1 + 128, 40], [2, 40, 264], false),
            ([3, d1, 48], [1, 48, 72], true),
        ];
        for (xs, vs, shared_v) in cases {
            let dims = SmmDims {
                batch: xs[0],
                d1: xs[1],
                d2: xs[2],
                d3: vs[2],
            };
            assert_eq!(mma_dx_rows(&client, dims, shared_v), WIDE_DX_ROWS, "{xs:?}");
            for dtype in [FloatDType::F16, FloatDType::BF16] {
                check_gradients::<C>(xs, vs, shared_v, dtype, &device);
            }
        }
        let small = SmmDims {
            batch: 2,
            d1: 200,
            d2: 136,
            d3: 264,
        };
        assert_eq!(mma_dx_rows(&client, small, false), DQ_ROWS);
    }

    /// The Ampere backward (`sm80_given`: hand-written `mma.sync` `dX` and `dV`), forced with
    /// `AmpereUse::Always`: the plan takes it for 16-byte rows (and not for a row that 16
    /// bytes do not divide), and its gradients match the f64 reference within twice the
    /// composed op's error — partial row, key and column tiles, `d3` over several chunks and
    /// `dV` column tiles, a shared `v` summed over batches with masked rows, a tiny problem.
    #[test]
    fn ampere_gradients() {
        common::plan_inputs();
        use burn_cubecl::cubecl::Runtime;
        use burn_flash::AmpereUse;
        use burn_flash::kernels::softmax_matmul::{SmmBackwardPath, plan_softmax_matmul_backward};
        let device = Default::default();
        let client = burn_cubecl::cubecl::cuda::CudaRuntime::client(&device);
        let options = SoftmaxMatmulOptions {
            ampere: AmpereUse::Always,
            ..Default::default()
        };
        let cases = [
            ([2, 300, 264], [2, 264, 200], false),
            ([3, 130, 136], [1, 136, 520], true),
            ([2, 64, 1024], [2, 1024, 128], false),
            ([1, 33, 8], [1, 8, 8], false),
            ([2, 40, 64], [1, 64, 512], true),
        ];
        for dtype in [FloatDType::F16, FloatDType::BF16] {
            let dtype_s = DType::from(dtype).into();
            let path = |xs: [usize; 3], vs: [usize; 3]| {
                let [batch, d1, d2] = xs;
                let d3 = vs[2];
                let v_strides = [if vs[0] == 1 { 0 } else { d2 * d3 }, d3, 1];
                plan_softmax_matmul_backward(
                    &client,
                    SmmDims { batch, d1, d2, d3 },
                    dtype_s,
                    [
                        (&xs, &[d1 * d2, d2, 1]),
                        (&vs, &v_strides),
                        (&[batch, d1, d3], &[d1 * d3, d3, 1]),
                        (&xs, &[d1 * d2, d2, 1]),
                        (&vs, &[d2 * d3, d3, 1]),
                    ],
                    options,
                )
                .expect("plans")
                .path
            };
            assert_ne!(path([2, 70, 100], [2, 100, 80]), SmmBackwardPath::Ampere);
            for (xs, vs, masked) in cases {
                assert_eq!(path(xs, vs), SmmBackwardPath::Ampere, "{xs:?} {vs:?}");
                check_gradients_with::<C>(xs, vs, masked, options, dtype, &device);
            }
        }
    }

    /// The P-buffer plan of the matrix-unit backward: chosen at small `d2` with vector rows,
    /// not past [`P_BUFFER_MAX_D2`] nor with rows of odd length; gradients against the f64
    /// reference on both sides of the threshold (ragged `d1`, a masked case, `d3` over one
    /// column tile).
    #[test]
    fn p_buffer_plans() {
        common::plan_inputs();
        use burn_flash::kernels::softmax_matmul::{P_BUFFER_MAX_D2, mma_p_buffer};
        let dims = |d2| SmmDims {
            batch: 2,
            d1: 100,
            d2,
            d3: 264,
        };
        let strides = |d2: usize| [100 * d2, d2, 1];
        assert!(mma_p_buffer(dims(264), &[2, 100, 264], &strides(264)));
        let past = P_BUFFER_MAX_D2 + 8;
        assert!(!mma_p_buffer(dims(past), &[2, 100, past], &strides(past)));
        // Rows of 260 elements are not whole 16-byte vectors: no `dX` vector stores, no buffer.
        assert!(!mma_p_buffer(dims(260), &[2, 100, 260], &strides(260)));
        let device = Default::default();
        for (xs, vs, masked) in [
            ([2, 99, 264], [2, 264, 264], false),
            ([2, 99, 264], [2, 264, 136], true),
            ([1, 37, past], [1, past, 136], false),
        ] {
            for dtype in [FloatDType::F16, FloatDType::BF16] {
                check_gradients::<C>(xs, vs, masked, dtype, &device);
            }
        }
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    type N = burn::backend::NdArray;
    common_suite!(f32, N, FloatDType::F32);
}
