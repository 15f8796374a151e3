//! The softmax-family suite: each test body is written once, generic over the backend, and
//! instantiated per backend and dtype at the bottom (wgpu always; CUDA with `--features cuda`;
//! NdArray for the composed fallback).

mod common;

use burn::backend::Autodiff;
use burn::tensor::{DType, FloatDType, Tensor};
use burn_flash::{
    FlashBackend, SoftmaxOptions, SoftmaxTier, SoftmaxVariant, softmax, softmax_with,
};
use common::*;

/// The strided scheme, forced (small non-contiguous inputs are otherwise copied first).
const STRIDED: SoftmaxOptions = SoftmaxOptions {
    tier: Some(SoftmaxTier::Strided),
    plane_ops: None,
    unit_vectors: None,
};

use burn_flash::kernels::softmax::STRIDED_MAX_LEN;

const VARIANTS: [SoftmaxVariant; 3] = [
    SoftmaxVariant::Softmax,
    SoftmaxVariant::LogSoftmax,
    SoftmaxVariant::QuietSoftmax,
];

/// Runs the op on `x` (poisoned output, synced) and compares with the f64 reference of the
/// values actually on the device. Returns the output.
fn check_forward<B: FlashBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
    dtype: FloatDType,
    context: &str,
) -> Vec<f64> {
    let device = x.device();
    let shape = x.dims();
    let xv = read(x.clone());
    poison::<B, D>(shape, dtype, &device);
    let y = softmax_with(x, dim, variant, options);
    assert_eq!(y.dims(), shape, "{context}: output shape");
    sync::<B>(&device);
    let got = read(y);
    let want = softmax_ref(&xv, &shape, dim, variant);
    let max_abs = xv
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |a, v| a.max(v.abs()));
    let context = format!("{context} {variant:?} dim {dim} shape {shape:?} {dtype:?}");
    assert_close(&got, &want, tol_for(dtype, variant, max_abs), &context);
    if variant == SoftmaxVariant::Softmax && xv.iter().all(|v| v.is_finite()) {
        assert_probabilities(&got, &shape, dim, dtype, &context);
    }
    got
}

fn row_limits<B: FlashBackend>(
    device: &B::Device,
    dtype: FloatDType,
) -> Option<burn_flash::RowLimits> {
    burn_flash::softmax_row_limits::<B>(device, dtype.into(), SoftmaxOptions::default())
        .map(|r| r.expect("row limits"))
}

/// Row lengths that cross every tier boundary: the fixed list of the issue plus the device's
/// own plane/cube and cube/split switches ± 1.
fn boundary_lengths<B: FlashBackend>(device: &B::Device, dtype: FloatDType) -> Vec<usize> {
    let mut lengths = vec![1, 2, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025];
    if let Some(limits) = row_limits::<B>(device, dtype) {
        for l in [limits.plane, limits.cube] {
            lengths.extend([l - 1, l, l + 1]);
        }
    } else {
        // The fallback has no tiers; still cover a long row.
        lengths.extend([8191, 8192, 8193]);
    }
    lengths.sort();
    lengths.dedup();
    lengths
}

fn row_lengths_cross_every_tier<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for n in boundary_lengths::<B>(device, dtype) {
        let rows = if n > 4096 { 3 } else { 7 };
        for variant in VARIANTS {
            let x = random::<B, 2>([rows, n], -8.0, 8.0, dtype, device);
            check_forward(
                x,
                1,
                variant,
                SoftmaxOptions::default(),
                dtype,
                "row lengths",
            );
        }
    }
}

fn large_shapes<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for variant in VARIANTS {
        let x = random::<B, 2>([1823, 781], -6.0, 6.0, dtype, device);
        check_forward(x, 1, variant, SoftmaxOptions::default(), dtype, "1823x781");
    }
}

/// Rows up to 2^24 + 1 elements (the longest the issue asks for, plus a tail) and a 4096 × 4097
/// tensor. GPU runs only: on a CPU (lavapipe, NdArray) these take minutes, and the tier
/// boundaries they cross are crossed at their exact lengths by `row_lengths_cross_every_tier`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn huge_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for shape in [
        [4096, 4097],
        [1, 1 << 20],
        [2, (1 << 22) + 3],
        [1, (1 << 24) + 1],
    ] {
        let x = random::<B, 2>(shape, -6.0, 6.0, dtype, device);
        check_forward(
            x,
            1,
            SoftmaxVariant::Softmax,
            SoftmaxOptions::default(),
            dtype,
            "large",
        );
    }
}

fn every_rank_and_dim<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxOptions::default();
    for variant in VARIANTS {
        check_forward(
            random::<B, 1>([1000], -5.0, 5.0, dtype, device),
            0,
            variant,
            opts,
            dtype,
            "rank 1",
        );
        for dim in 0..2 {
            let x = random::<B, 2>([37, 129], -5.0, 5.0, dtype, device);
            check_forward(x, dim, variant, opts, dtype, "rank 2");
        }
        for dim in 0..3 {
            let x = random::<B, 3>([5, 33, 64], -5.0, 5.0, dtype, device);
            check_forward(x, dim, variant, opts, dtype, "rank 3");
        }
        for dim in 0..4 {
            let x = random::<B, 4>([3, 4, 17, 40], -5.0, 5.0, dtype, device);
            check_forward(x, dim, variant, opts, dtype, "rank 4");
        }
    }
}

fn non_contiguous_inputs<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let opts = SoftmaxOptions::default();
    for variant in VARIANTS {
        for dim in 0..2 {
            let x = random::<B, 2>([300, 257], -5.0, 5.0, dtype, device).swap_dims(0, 1);
            check_forward(x, dim, variant, opts, dtype, "transposed");
        }
        for dim in 0..3 {
            let x = random::<B, 3>([8, 50, 33], -5.0, 5.0, dtype, device).permute([2, 0, 1]);
            check_forward(x, dim, variant, opts, dtype, "permuted");
        }
        for dim in 0..2 {
            let x = random::<B, 2>([64, 300], -5.0, 5.0, dtype, device).slice([0..64, 10..260]);
            check_forward(x, dim, variant, opts, dtype, "sliced columns");
            let x = random::<B, 2>([64, 300], -5.0, 5.0, dtype, device).narrow(0, 3, 50);
            check_forward(x, dim, variant, opts, dtype, "sliced rows");
        }
    }
}

/// Rows with some −inf, rows entirely −inf (→ 0 for softmax and quiet, −inf for log), a row
/// with one finite value, in every tier.
fn neg_inf_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let mut lengths = vec![100, 3000];
    if let Some(limits) = row_limits::<B>(device, dtype) {
        lengths.push(limits.cube + 1);
    }
    for n in lengths {
        let mut values = uniform(4 * n, -4.0, 4.0, fresh_seed());
        for j in (0..n).step_by(3) {
            values[n + j] = f32::NEG_INFINITY;
        }
        values[2 * n..3 * n].fill(f32::NEG_INFINITY);
        values[3 * n..4 * n].fill(f32::NEG_INFINITY);
        values[3 * n + n / 2] = 1.5;
        for variant in VARIANTS {
            let x = tensor::<B, 2>(values.clone(), [4, n], dtype, device);
            let y = check_forward(
                x.clone(),
                1,
                variant,
                SoftmaxOptions::default(),
                dtype,
                "-inf",
            );
            let masked = &y[2 * n..3 * n];
            let expected = if variant == SoftmaxVariant::LogSoftmax {
                f64::NEG_INFINITY
            } else {
                0.0
            };
            assert!(
                masked.iter().all(|&v| v == expected),
                "{variant:?}: fully masked row"
            );
            // The same rows through the strided tier (forced: this shape alone would be copied to
            // a dim-last layout first), and through that copy.
            let xt = x.swap_dims(0, 1);
            if n <= STRIDED_MAX_LEN {
                check_forward(xt.clone(), 0, variant, STRIDED, dtype, "-inf strided");
            }
            let opts = SoftmaxOptions::default();
            check_forward(xt, 0, variant, opts, dtype, "-inf relaid");
        }
    }
}

fn huge_magnitudes<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for n in [40, 3000] {
        for variant in VARIANTS {
            let x = random::<B, 2>([9, n], -1e4, 1e4, dtype, device);
            check_forward(x, 1, variant, SoftmaxOptions::default(), dtype, "±1e4");
        }
    }
}

/// Rows whose maximum is far below zero (−300: `e^300` overflows f32) through every tier the
/// device runs, forced. The chunked tiers merge partial sums relative to partial maxima, and a
/// unit that holds no chunk of a short row has the pair `(−inf, 0)`: moving its 0 to the row's
/// shift must not compute `0 · e^(0 − shift) = 0 · inf = NaN`.
fn far_below_zero<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("fused backend");
    for tier in [
        SoftmaxTier::Plane,
        SoftmaxTier::Cube,
        SoftmaxTier::Split,
        SoftmaxTier::Exchange,
        SoftmaxTier::Strided,
    ] {
        let opts = SoftmaxOptions {
            tier: Some(tier),
            plane_ops: None,
            unit_vectors: None,
        };
        let lengths = match tier {
            SoftmaxTier::Plane => vec![7, limits.plane],
            SoftmaxTier::Cube => vec![300, limits.cube],
            SoftmaxTier::Split | SoftmaxTier::Exchange => vec![100, 3000, limits.cube + 1],
            _ => vec![100, 3000],
        };
        for n in lengths {
            let planned = burn_flash::softmax_plan::<B>(
                device,
                &[5, n],
                &[n, 1],
                1,
                dtype.into(),
                false,
                opts,
            )
            .expect("fused backend");
            if tier == SoftmaxTier::Exchange && planned.is_err() {
                // Refused where cubes may not wait on each other: `exchange_tier_refused`.
                continue;
            }
            for variant in VARIANTS {
                let x = random::<B, 2>([5, n], -304.0, -300.0, dtype, device);
                let ctx = format!("far below zero, forced {tier:?}, n {n}");
                check_forward(x, 1, variant, opts, dtype, &ctx);
            }
        }
    }
}

/// `softmax(x + 1000) = softmax(x)`: exact only where `x + 1000` is representable, i.e. f32.
fn shift_invariance<B: FlashBackend>(device: &B::Device) {
    for n in [64, 2000, 70000] {
        let x = random::<B, 2>([5, n], -10.0, 10.0, FloatDType::F32, device);
        let a = read(softmax(x.clone(), 1));
        let b = read(softmax(x + 1000.0, 1));
        sync::<B>(device);
        // x + 1000 rounds x to 2^-14: the outputs differ by that much relative.
        assert_close(
            &b,
            &a,
            Tol {
                atol: 1e-7,
                rtol: 2e-4,
            },
            "shift invariance",
        );
    }
}

fn nan_propagates<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let mut lengths = vec![300];
    if let Some(limits) = row_limits::<B>(device, dtype) {
        lengths.push(limits.cube + 1);
    }
    for n in lengths {
        let mut values = uniform(4 * n, -3.0, 3.0, fresh_seed());
        values[n + 17] = f32::NAN;
        for variant in VARIANTS {
            let x = tensor::<B, 2>(values.clone(), [4, n], dtype, device);
            let y = check_forward(
                x.clone(),
                1,
                variant,
                SoftmaxOptions::default(),
                dtype,
                "NaN",
            );
            assert!(y[n..2 * n].iter().all(|v| v.is_nan()), "NaN row");
            assert!(y[..n].iter().all(|v| v.is_finite()), "clean row");
            let xt = x.swap_dims(0, 1);
            if n <= STRIDED_MAX_LEN {
                check_forward(xt.clone(), 0, variant, STRIDED, dtype, "NaN strided");
            }
            let opts = SoftmaxOptions::default();
            check_forward(xt, 0, variant, opts, dtype, "NaN relaid");
        }
    }
}

fn empty_tensors<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for shape in [[0, 16], [16, 0]] {
        for variant in VARIANTS {
            for dim in 0..2 {
                // Uploaded, not made by a kernel: Burn's own fill and cast kernels fail to
                // launch with zero cubes on CUDA (burn 0.21).
                let data = burn::tensor::TensorData::new(Vec::<f32>::new(), shape)
                    .convert_dtype(dtype.into());
                let x = Tensor::<B, 2>::from_data(data, device);
                let y = softmax_with(x.clone(), dim, variant, SoftmaxOptions::default());
                assert_eq!(y.dims(), shape);
                let dx = B::flash_softmax_backward(
                    y.clone().into_primitive().tensor(),
                    x.into_primitive().tensor(),
                    dim,
                    variant,
                    SoftmaxOptions::default(),
                );
                let dx = Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(dx));
                assert_eq!(dx.dims(), shape);
                sync::<B>(device);
            }
        }
    }
}

/// A random tensor uploaded in `dtype` itself: a view of it (a slice) reaches the op as a view,
/// where Fusion may fuse a cast with the slice into one contiguous tensor.
fn uploaded<B: FlashBackend>(
    shape: [usize; 3],
    lo: f32,
    hi: f32,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, 3> {
    let values = uniform(shape.iter().product(), lo, hi, fresh_seed());
    let data = burn::tensor::TensorData::new(values, shape).convert_dtype(dtype.into());
    let x = Tensor::<B, 3>::from_data(data, (device, DType::from(dtype)));
    assert_eq!(x.dtype(), DType::from(dtype), "uploaded in its dtype");
    x
}

/// Row starts: tensors whose rows sit at one stride (contiguous, sliced rows, leading dims in
/// any order) take the flat path (`row · stride` from the launch's scalars); leading dims that
/// do not collapse (a slice of a middle dim) take the general one (the tensors' shapes and
/// strides). The general path is checked in every forced tier the device runs, forward, and
/// backward with a sliced `dy`, against the f64 reference.
fn flat_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let plan = |shape: &[usize], strides: &[usize], backward: bool| {
        let dim = shape.len() - 1;
        let opts = SoftmaxOptions::default();
        burn_flash::softmax_plan::<B>(device, shape, strides, dim, dtype.into(), backward, opts)
            .expect("fused backend")
            .expect("plan")
    };
    let n = 96;
    let contiguous = plan(&[4, 6, n], &[6 * n, n, 1], false);
    assert!(contiguous.config.flat_rows, "{contiguous:?}");
    assert_eq!(contiguous.row_strides, vec![n, n]);
    let swapped = plan(&[6, 4, n], &[n, 6 * n, 1], true);
    assert!(
        swapped.config.flat_rows,
        "leading dims swapped: {swapped:?}"
    );
    assert_eq!(swapped.row_strides, vec![n; 3]);
    let pitched = plan(&[7, n], &[128, 1], false);
    assert_eq!(pitched.row_strides, vec![128, 128], "{pitched:?}");
    assert_eq!(plan(&[1, 1, n], &[5, 3, 1], false).row_strides, vec![0, 0]);
    let sliced = plan(&[4, 3, n], &[6 * n, n, 1], false);
    assert!(!sliced.config.flat_rows, "middle dim sliced: {sliced:?}");
    assert!(sliced.row_strides.is_empty());

    let limits = row_limits::<B>(device, dtype).expect("fused backend");
    let mut tiers = vec![
        (SoftmaxTier::Plane, 40),
        (SoftmaxTier::Cube, limits.plane + 8),
        (SoftmaxTier::Split, limits.plane + 8),
    ];
    if burn_flash::softmax_plan::<B>(
        device,
        &[2, 64],
        &[64, 1],
        1,
        dtype.into(),
        false,
        SoftmaxOptions {
            tier: Some(SoftmaxTier::Exchange),
            ..Default::default()
        },
    )
    .expect("fused backend")
    .is_ok()
    {
        tiers.push((SoftmaxTier::Exchange, limits.plane + 8));
    }
    for (tier, n) in tiers {
        let opts = SoftmaxOptions {
            tier: Some(tier),
            ..Default::default()
        };
        for variant in VARIANTS {
            let ctx = format!("middle-dim slice, {tier:?}");
            let x = uploaded::<B>([3, 5, n], -5.0, 5.0, dtype, device).slice([0..3, 1..4, 0..n]);
            let y = check_forward(x, 2, variant, opts, dtype, &ctx);
            // The backward with `dy` a middle-dim slice (y and dx contiguous).
            let y = burn::tensor::TensorData::new(y.iter().map(|&v| v as f32).collect(), [3, 3, n])
                .convert_dtype(dtype.into());
            // Uploaded in its dtype: a pending cast would let Fusion copy `dy`'s slice into a
            // contiguous tensor in the same fused kernel.
            let yt = Tensor::<B, 3>::from_data(y, (device, DType::from(dtype)));
            let dy = uploaded::<B>([3, 5, n], -0.5, 1.5, dtype, device).slice([0..3, 1..4, 0..n]);
            let (yv, dyv) = (read(yt.clone()), read(dy.clone()));
            poison::<B, 3>([3, 3, n], dtype, device);
            let dx = B::flash_softmax_backward(
                yt.into_primitive().tensor(),
                dy.into_primitive().tensor(),
                2,
                variant,
                opts,
            );
            let dx = Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(dx));
            sync::<B>(device);
            let (want, scale) = softmax_backward_ref(&yv, &dyv, &[3, 3, n], 2, variant);
            let ctx = format!("{ctx} backward {variant:?} {dtype:?}");
            assert_rows_close(
                &read(dx),
                &want,
                &scale,
                &[3, 3, n],
                2,
                grad_rel(dtype),
                &ctx,
            );
        }
    }
}

/// `unit_vectors` spreads a cube-tier row over more units: the plan takes as many units as the
/// row needs at that many vectors each (within the cube's limit), every choice computes the same
/// function forward and backward, and a count outside 1 to the 128 B limit is refused.
fn unit_vectors_spread_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("a fused backend reports its limits");
    // The vectors of 128 B: 16-byte vectors where the runtime loads them (rows of 8n).
    let plan = |n: usize, k: Option<usize>| {
        let opts = SoftmaxOptions {
            unit_vectors: k,
            ..Default::default()
        };
        burn_flash::softmax_plan::<B>(device, &[4, n], &[n, 1], 1, dtype.into(), false, opts)
            .expect("fused backend")
    };
    let n = (limits.plane + 8).next_multiple_of(8);
    let default = plan(n, None).expect("plan");
    assert_eq!(default.tier, SoftmaxTier::Cube, "row of {n}");
    let max_k = default.config.vectors_per_unit as usize;
    let mut units = default.cube_dim.x;
    for k in (1..max_k).rev() {
        let p = plan(n, Some(k)).expect("plan");
        assert!(p.cube_dim.x >= units, "k {k}: {p:?}");
        assert!(p.config.vectors_per_unit as usize <= max_k, "k {k}: {p:?}");
        units = p.cube_dim.x;
    }
    let msg = plan(n, Some(0)).expect_err("refused").to_string();
    assert!(msg.contains("unit_vectors must be from 1"), "{msg}");
    let too_many = 128 / (default.vector_size * DType::from(dtype).size()) + 1;
    assert!(plan(n, Some(too_many)).is_err(), "k {too_many}");
    for k in [1, 2] {
        let opts = SoftmaxOptions {
            unit_vectors: Some(k),
            ..Default::default()
        };
        let ctx = format!("unit_vectors {k}, row {n}");
        let x = random::<B, 2>([13, n], -6.0, 6.0, dtype, device);
        check_forward(x, 1, SoftmaxVariant::Softmax, opts, dtype, &ctx);
        check_backward::<B, 2>(
            [13, n],
            1,
            SoftmaxVariant::Softmax,
            opts,
            dtype,
            device,
            false,
            &ctx,
        );
    }
}

/// Every row scheme, forced, computes the same function (plane operations on and off where the
/// runtime can run both).
fn forced_tiers_agree<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let plane_choices: Vec<Option<bool>> = [None, Some(false), Some(true)]
        .into_iter()
        .filter(|p| {
            let opts = SoftmaxOptions {
                tier: None,
                plane_ops: *p,
                unit_vectors: None,
            };
            matches!(
                burn_flash::softmax_row_limits::<B>(device, dtype.into(), opts),
                Some(Ok(_))
            )
        })
        .collect();
    assert!(
        plane_choices.len() >= 2,
        "shared-memory and default paths both available"
    );
    for plane_ops in plane_choices {
        let opts = SoftmaxOptions {
            tier: None,
            plane_ops,
            unit_vectors: None,
        };
        let limits = burn_flash::softmax_row_limits::<B>(device, dtype.into(), opts)
            .unwrap()
            .unwrap();
        // Lengths every tier can run forward and backward: up to the plane tier's backward
        // limit (128 with lavapipe's 8-wide planes), odd ones for scalar loads.
        let lengths = [5, 99, limits.backward_plane.min(1000)];
        for tier in [
            SoftmaxTier::Plane,
            SoftmaxTier::Cube,
            SoftmaxTier::Split,
            SoftmaxTier::Strided,
        ] {
            for n in lengths {
                for variant in VARIANTS {
                    let opts = SoftmaxOptions {
                        tier: Some(tier),
                        plane_ops,
                        unit_vectors: None,
                    };
                    let x = random::<B, 2>([13, n], -6.0, 6.0, dtype, device);
                    let ctx = format!("forced {tier:?} planes {plane_ops:?}");
                    check_forward(x.clone(), 1, variant, opts, dtype, &ctx);
                    // A forced row scheme on a non-contiguous softmax dim relays the input out.
                    check_forward(x.swap_dims(0, 1), 0, variant, opts, dtype, &ctx);
                    check_backward::<B, 2>([13, n], 1, variant, opts, dtype, device, false, &ctx);
                }
            }
        }
    }
}

/// The heuristic picks the tier the limits say, and the strided tier for a non-contiguous
/// softmax dimension.
fn tier_choice_follows_limits<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("a fused backend reports its limits");
    let plan = |shape: [usize; 2], strides: [usize; 2], backward: bool| {
        let opts = SoftmaxOptions::default();
        burn_flash::softmax_plan::<B>(device, &shape, &strides, 1, dtype.into(), backward, opts)
            .expect("fused backend")
            .expect("plan")
            .tier
    };
    for (backward, plane, cube) in [
        (false, limits.plane, limits.cube),
        (true, limits.backward_plane, limits.backward_cube),
    ] {
        for (n, tier) in [
            (1, SoftmaxTier::Plane),
            (plane, SoftmaxTier::Plane),
            (plane + 1, SoftmaxTier::Cube),
            (cube, SoftmaxTier::Cube),
            (cube + 1, SoftmaxTier::Split),
            (1 << 22, SoftmaxTier::Split),
        ] {
            // Long rows take the exchange scheme where the runtime has it (CUDA: its own test,
            // `exchange_tier`, pins which).
            let got = plan([4, n], [n, 1], backward);
            let ok = got == tier || (tier == SoftmaxTier::Split && got == SoftmaxTier::Exchange);
            assert!(
                ok,
                "row length {n}, backward {backward}: {got:?}, expected {tier:?}"
            );
        }
        // A non-contiguous softmax dim is read in place (strided) only with many rows; with
        // few, the op copies to a dim-last layout first and takes a row tier.
        let many = 1 << 18;
        let strided = plan([many, 100], [1, many], backward);
        assert_eq!(strided, SoftmaxTier::Strided, "many rows");
        assert_eq!(
            plan([64, 100], [1, 64], backward),
            SoftmaxTier::Plane,
            "few rows"
        );
    }
}

/// The row kernels take the hardware's approximate exponential only for 16-bit types on CUDA
/// (`RowConfig::fast_exp`): f32 keeps the accurate one, and other runtimes never get the
/// fast-math modes. Every tier's plan says so, forward and backward.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
fn fast_exp_choice<B: FlashBackend>(device: &B::Device, cuda: bool) {
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        if !B::supports_dtype(device, dtype.into()) {
            continue;
        }
        let want = cuda && dtype != FloatDType::F32;
        for n in [100, 5000, 1 << 20] {
            for backward in [false, true] {
                let opts = SoftmaxOptions::default();
                let plan = burn_flash::softmax_plan::<B>(
                    device,
                    &[4, n],
                    &[n, 1],
                    1,
                    dtype.into(),
                    backward,
                    opts,
                )
                .expect("fused backend")
                .expect("plan");
                assert_eq!(
                    plan.config.fast_exp, want,
                    "{dtype:?} n {n} backward {backward}: {plan:?}"
                );
            }
        }
    }
}

/// The forward register tiers keep each unit's exponentials in registers (`cache_exp`) where
/// its share of the row is at most 32 elements in a cube of at most 512 units: short rows do,
/// the backward never, a full 1024-unit cube not; 16-bit rows on the cube tier only with
/// `unit_vectors` small enough.
fn kept_exponentials<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("a fused backend reports its limits");
    let plan = |n: usize, backward: bool, unit_vectors: Option<usize>| {
        let opts = SoftmaxOptions {
            unit_vectors,
            ..Default::default()
        };
        burn_flash::softmax_plan::<B>(device, &[4, n], &[n, 1], 1, dtype.into(), backward, opts)
            .expect("fused backend")
            .expect("plan")
    };
    let short = plan(96, false, None);
    assert!(short.config.cache_exp, "{short:?}");
    assert!(!plan(96, true, None).config.cache_exp, "backward");
    // The longest cube-tier row: kept only if its share and its cube are small enough (never
    // in a 1024-unit cube).
    let full = plan(limits.cube, false, None);
    let share = full.config.vectors_per_unit as usize * full.vector_size;
    let units = (full.cube_dim.x * full.cube_dim.y) as usize;
    assert_eq!(
        full.config.cache_exp,
        share <= 32 && units <= 512,
        "{full:?}"
    );
    if units > 512 {
        assert!(!full.config.cache_exp, "{full:?}");
    }
    // 16-bit rows of 16-byte vectors up to 128 units of 4 vectors (4096 elements) take the
    // cube tier that way, with kept exponentials; longer ones 8 vectors a unit, without.
    let n = 4096;
    let mid = plan(n, false, None);
    if dtype != FloatDType::F32 && mid.vector_size == 8 && mid.tier == SoftmaxTier::Cube {
        assert_eq!(mid.config.vectors_per_unit, 4, "{mid:?}");
        assert!(mid.config.cache_exp, "{mid:?}");
        let long = plan(16384, false, None);
        assert_eq!(long.config.vectors_per_unit, 8, "{long:?}");
        assert!(!long.config.cache_exp, "{long:?}");
    }
    let n = (limits.plane + 8).next_multiple_of(8);
    let spread = plan(n, false, Some(1));
    let share = spread.config.vectors_per_unit as usize * spread.vector_size;
    assert_eq!(
        spread.config.cache_exp,
        share <= 32 && spread.cube_dim.x <= 512,
        "{spread:?}"
    );
}

fn bad_dim_is_refused<B: FlashBackend>(device: &B::Device, _dtype: FloatDType) {
    let x = random::<B, 2>([3, 4], -1.0, 1.0, FloatDType::F32, device);
    for (variant, name) in [
        (SoftmaxVariant::Softmax, "softmax"),
        (SoftmaxVariant::LogSoftmax, "log_softmax"),
        (SoftmaxVariant::QuietSoftmax, "quiet_softmax"),
    ] {
        let msg = panic_message(|| {
            softmax_with(x.clone(), 2, variant, SoftmaxOptions::default());
        });
        assert_eq!(
            msg,
            format!("burn_flash::{name}: `dim` is 2, out of range for a tensor of rank 2")
        );
    }
}

fn impossible_forced_tier_is_refused<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("fused backend");
    let n = limits.plane + 1;
    let x = random::<B, 2>([2, n], -1.0, 1.0, dtype, device);
    let opts = SoftmaxOptions {
        tier: Some(SoftmaxTier::Plane),
        plane_ops: None,
        unit_vectors: None,
    };
    let msg = panic_message(|| {
        softmax_with(x.clone(), 1, SoftmaxVariant::Softmax, opts);
    });
    assert_eq!(
        msg,
        format!(
            "burn_flash::softmax: tier Plane cannot run rows of length {n}: the row does not fit \
             in one plane's registers"
        )
    );
}

/// The exchange scheme (CUDA): the plan takes it for rows longer than one cube holds, forward
/// and backward, up to one chunk per streaming multiprocessor; forced, it matches the f64
/// reference on ragged lengths, masked chunks, fully masked rows and more cubes than
/// the device holds at once (so that cubes wait on cubes that have not started).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn exchange_tier<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("fused backend");
    let plan = |n: usize, backward: bool, tier: Option<SoftmaxTier>| {
        let opts = SoftmaxOptions {
            tier,
            plane_ops: None,
            unit_vectors: None,
        };
        burn_flash::softmax_plan::<B>(device, &[4, n], &[n, 1], 1, dtype.into(), backward, opts)
            .expect("fused backend")
    };
    for (backward, cube) in [(false, limits.cube), (true, limits.backward_cube)] {
        let long = cube + 1;
        let auto = plan(long, backward, None).unwrap();
        assert_eq!(
            auto.tier,
            SoftmaxTier::Exchange,
            "row of {long}, backward {backward}"
        );
        // bf16's forward reads its chunk again for the write pass (registers); the values
        // below run that path in bf16 and the register-held one in f32 and f16.
        assert_eq!(
            auto.config.reread,
            !backward && dtype == FloatDType::BF16,
            "re-read, {dtype:?}, backward {backward}"
        );
        assert_eq!(
            plan(1 << 22, backward, None).unwrap().tier,
            SoftmaxTier::Split,
            "more chunks than streaming multiprocessors, backward {backward}"
        );
    }
    let long = limits.cube + 1;
    let exchange = SoftmaxOptions {
        tier: Some(SoftmaxTier::Exchange),
        plane_ops: None,
        unit_vectors: None,
    };
    // One chunk is 256 units' registers: 128 B each in f32, 64 B in 16-bit types, so 8192
    // elements in every dtype.
    let chunk = 8192;
    for variant in VARIANTS {
        for n in [100, chunk, chunk + 1, 3 * chunk + 5, long] {
            let x = random::<B, 2>([13, n], -6.0, 6.0, dtype, device);
            let ctx = format!("exchange n {n}");
            check_forward(x, 1, variant, exchange, dtype, &ctx);
            check_backward::<B, 2>([13, n], 1, variant, exchange, dtype, device, false, &ctx);
        }
        // Masked chunks: the first chunk of row 0 fully −inf, row 1 fully −inf (zeros for
        // softmax and quiet, −inf for log-softmax: the reference says which).
        let n = 2 * chunk + 7;
        let x = random::<B, 2>([3, n], -6.0, 6.0, dtype, device);
        let x = x.slice_assign(
            [0..1, 0..chunk],
            Tensor::<B, 2>::full([1, chunk], f32::NEG_INFINITY, device).cast(dtype),
        );
        let x = x.slice_assign(
            [1..2, 0..n],
            Tensor::<B, 2>::full([1, n], f32::NEG_INFINITY, device).cast(dtype),
        );
        check_forward(x, 1, variant, exchange, dtype, "exchange, masked chunks");
    }
    // Many rows: far more cubes than the device runs at once (the backward's chunks are half
    // as long: it holds `y` and `dy`).
    check_backward::<B, 2>(
        [300, 3 * 4096 + 1],
        1,
        SoftmaxVariant::Softmax,
        SoftmaxOptions::default(),
        dtype,
        device,
        false,
        "exchange backward, many rows",
    );
    // Many rows: ~3000 cubes of 4 chunks each, far more than the device runs at once.
    let x = random::<B, 2>([777, 3 * chunk + 1], -6.0, 6.0, dtype, device);
    check_forward(
        x,
        1,
        SoftmaxVariant::Softmax,
        SoftmaxOptions::default(),
        dtype,
        "exchange, many rows",
    );
}

/// Where cubes may not make progress while others wait (wgpu), the exchange scheme is refused
/// with its reason and long rows take the two-kernel split.
#[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
fn exchange_tier_refused<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let limits = row_limits::<B>(device, dtype).expect("fused backend");
    let n = limits.cube + 1;
    let opts = |tier| SoftmaxOptions {
        tier,
        plane_ops: None,
        unit_vectors: None,
    };
    let plan = |tier| {
        burn_flash::softmax_plan::<B>(device, &[4, n], &[n, 1], 1, dtype.into(), false, opts(tier))
            .expect("fused backend")
    };
    assert_eq!(plan(None).unwrap().tier, SoftmaxTier::Split);
    let x = random::<B, 2>([2, n], -1.0, 1.0, dtype, device);
    let msg = panic_message(|| {
        softmax_with(
            x.clone(),
            1,
            SoftmaxVariant::Softmax,
            opts(Some(SoftmaxTier::Exchange)),
        );
    });
    assert_eq!(
        msg,
        format!(
            "burn_flash::softmax: tier Exchange cannot run rows of length {n}: the exchange \
             scheme runs on CUDA only (cubes must make progress while others wait)"
        )
    );
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn unsupported_dtype_is_refused<B: FlashBackend>(device: &B::Device) {
    let x = random::<B, 2>([3, 4], -1.0, 1.0, FloatDType::F32, device).cast(FloatDType::F64);
    let msg = panic_message(|| {
        softmax(x.clone(), 1);
    });
    assert_eq!(
        msg,
        "burn_flash::softmax: `tensor` has dtype F64; supported: F32, F16, BF16"
    );
}

/// Largest error of a gradient element, relative to the largest reference gradient of its row:
/// the output's rounding, `y`'s rounding in the forward, and f32 sums over rows of up to 2^22
/// elements (f32's bound is several roundings wide for that reason).
fn grad_rel(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F32 | FloatDType::Flex32 => 64.0 * eps(dtype),
        _ => 8.0 * eps(dtype),
    }
}

/// Gradient of `variant` through `Autodiff<B>` against the f64 backward of the f64 forward of
/// the input (never of the op's own output), row by row within [`grad_rel`] of the row's largest
/// reference gradient. The gradient buffer is poisoned first. `dy` is drawn from `[-0.5, 1.5)`:
/// its rows have a clear mean, so the row term `Σ dy ⊙ y` (`Σ dy` for log-softmax) is far from 0
/// and a backward that drops it fails.
fn check_backward<B: FlashBackend, const D: usize>(
    shape: [usize; D],
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
    dtype: FloatDType,
    device: &B::Device,
    transpose: bool,
    context: &str,
) {
    type A<B> = Autodiff<B>;
    let prepare = |t: Tensor<A<B>, D>| if transpose { t.swap_dims(0, D - 1) } else { t };
    let x0 = random::<A<B>, D>(shape, -5.0, 5.0, dtype, device);
    let w0 = random::<A<B>, D>(shape, -0.5, 1.5, dtype, device);
    let (x, w) = (prepare(x0), prepare(w0));
    let logical = x.dims();

    let xg = x.clone().detach().require_grad();
    let y = softmax_with(xg.clone(), dim, variant, options);
    let loss = (y * w.clone().detach()).sum();
    // NaN-filled buffers of the gradient's size: an element the backward does not write
    // reads back as NaN.
    poison::<B, D>(logical, dtype, device);
    let grads = loss.backward();
    let dx = read(xg.grad(&grads).expect("gradient"));
    sync::<B>(device);

    let xv = read(x);
    let dy = read(w);
    let y_ref = softmax_ref(&xv, &logical, dim, variant);
    let (want, scale) = softmax_backward_ref(&y_ref, &dy, &logical, dim, variant);
    let ctx = format!("{context} backward {variant:?} shape {logical:?} dim {dim} {dtype:?}");
    assert_rows_close(&dx, &want, &scale, &logical, dim, grad_rel(dtype), &ctx);
}

fn gradients_every_tier<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let mut lengths = vec![1, 33, 1000];
    if let Some(limits) = row_limits::<B>(device, dtype) {
        lengths.extend([
            limits.backward_plane,
            limits.backward_plane + 1,
            limits.backward_cube,
            limits.backward_cube + 1,
        ]);
    } else {
        lengths.push(9000);
    }
    let opts = SoftmaxOptions::default();
    for variant in VARIANTS {
        for &n in &lengths {
            check_backward::<B, 2>([5, n], 1, variant, opts, dtype, device, false, "rows");
        }
        check_backward::<B, 2>([300, 70], 1, variant, opts, dtype, device, true, "relaid");
        check_backward::<B, 2>(
            [300, 70],
            1,
            variant,
            STRIDED,
            dtype,
            device,
            true,
            "strided",
        );
        check_backward::<B, 3>(
            [4, 6, 50],
            1,
            variant,
            opts,
            dtype,
            device,
            false,
            "middle dim",
        );
    }
}

/// Fully masked rows have zero gradient for softmax and quiet softmax (their output is 0
/// whatever the input), and `dx = dy` for log-softmax.
fn gradients_of_masked_rows<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let n = 70;
    let mut values = uniform(3 * n, -3.0, 3.0, fresh_seed());
    values[n..2 * n].fill(f32::NEG_INFINITY);
    for variant in VARIANTS {
        let x = tensor::<Autodiff<B>, 2>(values.clone(), [3, n], dtype, device).require_grad();
        let w = random::<Autodiff<B>, 2>([3, n], -1.0, 1.0, dtype, device);
        let y = softmax_with(x.clone(), 1, variant, SoftmaxOptions::default());
        let grads = (y * w.clone()).sum().backward();
        let dx = read(x.grad(&grads).unwrap());
        sync::<B>(device);
        let dy = read(w);
        for j in 0..n {
            let want = if variant == SoftmaxVariant::LogSoftmax {
                dy[n + j]
            } else {
                0.0
            };
            assert!(
                (dx[n + j] - want).abs() <= 1e-6 + tol(dtype).rtol * want.abs(),
                "{variant:?}"
            );
        }
        assert!(
            dx.iter().all(|v| v.is_finite()),
            "{variant:?}: finite gradients"
        );
    }
}

/// The dtype a backend's tensors are created with is the one asked for (guards the suite
/// against silently testing f32 twice).
fn dtype_is_honoured<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let x = random::<B, 2>([2, 8], -1.0, 1.0, dtype, device);
    let y = softmax(x, 1);
    assert_eq!(y.dtype(), DType::from(dtype));
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
                row_lengths_cross_every_tier,
                large_shapes,
                every_rank_and_dim,
                non_contiguous_inputs,
                neg_inf_rows,
                huge_magnitudes,
                nan_propagates,
                bad_dim_is_refused,
                gradients_every_tier,
                gradients_of_masked_rows,
                dtype_is_honoured,
            ]
        );
    };
}

/// Tests of the fused kernels' own machinery (tiers, forced options).
macro_rules! fused_suite {
    ($module:ident, $backend:ty, $dtype:expr) => {
        suite!(
            $module,
            $backend,
            $dtype,
            [
                forced_tiers_agree,
                far_below_zero,
                flat_rows,
                unit_vectors_spread_rows,
                kept_exponentials,
                tier_choice_follows_limits,
                impossible_forced_tier_is_refused,
            ]
        );
    };
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    // Burn's default wgpu backend (Fusion over CubeBackend): the path users take.
    type W = burn::backend::Wgpu;
    common_suite!(f32, W, FloatDType::F32);
    common_suite!(f16, W, FloatDType::F16);
    suite!(empty_f32, W, FloatDType::F32, [empty_tensors]);
    suite!(empty_f16, W, FloatDType::F16, [empty_tensors]);
    fused_suite!(fused_f32, W, FloatDType::F32);
    fused_suite!(fused_f16, W, FloatDType::F16);
    suite!(exchange_f32, W, FloatDType::F32, [exchange_tier_refused]);

    #[test]
    fn shift_invariance_f32() {
        super::shift_invariance::<W>(&Default::default());
    }

    #[test]
    fn accurate_exponential() {
        fast_exp_choice::<W>(&Default::default(), false);
    }

    // CubeBackend without the Fusion wrapper.
    mod unfused {
        use super::*;
        type U = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
        suite!(
            f32,
            U,
            FloatDType::F32,
            [row_lengths_cross_every_tier, gradients_every_tier]
        );
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    type C = burn::backend::Cuda;
    common_suite!(f32, C, FloatDType::F32);
    common_suite!(f16, C, FloatDType::F16);
    common_suite!(bf16, C, FloatDType::BF16);
    suite!(huge_f32, C, FloatDType::F32, [huge_rows]);
    suite!(huge_f16, C, FloatDType::F16, [huge_rows]);
    suite!(huge_bf16, C, FloatDType::BF16, [huge_rows]);
    // No `empty_tensors` on CUDA: Burn 0.21 cannot create a zero-element tensor there (uploading
    // one fails with "the provided strides are not supported for this operation", an IO error
    // of cubecl-cuda's pitched allocator, before our op runs). Our op's empty-tensor path is the
    // same code on every CubeCL runtime and is covered by the wgpu instantiation.
    fused_suite!(fused_f32, C, FloatDType::F32);
    fused_suite!(fused_f16, C, FloatDType::F16);
    fused_suite!(fused_bf16, C, FloatDType::BF16);
    suite!(exchange_f32, C, FloatDType::F32, [exchange_tier]);
    suite!(exchange_f16, C, FloatDType::F16, [exchange_tier]);
    suite!(exchange_bf16, C, FloatDType::BF16, [exchange_tier]);

    #[test]
    fn shift_invariance_f32() {
        super::shift_invariance::<C>(&Default::default());
    }

    #[test]
    fn fast_exponential_for_16_bit() {
        fast_exp_choice::<C>(&Default::default(), true);
    }

    // CUDA has f64 tensors; the kernels do not take them.
    #[test]
    fn f64_is_refused() {
        super::unsupported_dtype_is_refused::<C>(&Default::default());
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    // The composed fallback. The fused-machinery suite does not apply (no tiers, no kernels).
    type N = burn::backend::NdArray;
    common_suite!(f32, N, FloatDType::F32);
    suite!(empty_f32, N, FloatDType::F32, [empty_tensors]);

    #[test]
    fn shift_invariance_f32() {
        super::shift_invariance::<N>(&Default::default());
    }
}
