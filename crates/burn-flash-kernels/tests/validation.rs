//! Every validation path of the host launch functions refuses bad input with its message, and
//! launches nothing. Runs on wgpu (lavapipe on CPU-only machines).

#![cfg(feature = "wgpu")]

use burn_flash_kernels::softmax::{
    SoftmaxError, SoftmaxOptions, SoftmaxTier, SoftmaxVariant, TensorRef, launch_softmax,
    launch_softmax_backward,
};
use cubecl::{
    prelude::*,
    wgpu::{WgpuDevice, WgpuRuntime},
};

fn client() -> ComputeClient<WgpuRuntime> {
    WgpuRuntime::client(&WgpuDevice::DefaultDevice)
}

/// An f32 buffer of `values`, and a zero-filled output of the same size.
fn buffers(
    client: &ComputeClient<WgpuRuntime>,
    values: &[f32],
) -> (cubecl::server::Handle, cubecl::server::Handle) {
    let input = client.create_from_slice(f32::as_bytes(values));
    let output = client.create_from_slice(f32::as_bytes(&vec![f32::NAN; values.len()]));
    (input, output)
}

fn read(client: &ComputeClient<WgpuRuntime>, handle: cubecl::server::Handle) -> Vec<f32> {
    let bytes = client.read_one(handle).expect("read");
    f32::from_bytes(&bytes).to_vec()
}

fn f32_type() -> StorageType {
    f32::as_type_native_unchecked().storage_type()
}

/// Launches a forward softmax over a row-major f32 buffer of `shape` (with `strides`) that must
/// be refused; returns the error and the output buffer's contents afterwards.
fn refused(
    shape: &[usize],
    strides: &[usize],
    dim: usize,
    dtype: StorageType,
    options: SoftmaxOptions,
) -> (SoftmaxError, Vec<f32>) {
    let client = client();
    let len = shape.iter().product();
    let (input, output) = buffers(&client, &vec![0.5; len]);
    let t = |h| TensorRef {
        handle: h,
        shape,
        strides,
    };
    let err = launch_softmax(
        &client,
        t(&input),
        t(&output),
        dim,
        dtype,
        SoftmaxVariant::Softmax,
        options,
    )
    .unwrap_err();
    (err, read(&client, output))
}

#[test]
fn launch_without_burn_computes_softmax() {
    let client = client();
    let values: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let (input, output) = buffers(&client, &values);
    let (shape, strides) = ([4usize, 6], [6usize, 1]);
    let refs = |h| TensorRef {
        handle: h,
        shape: &shape,
        strides: &strides,
    };
    let plan = launch_softmax(
        &client,
        refs(&input),
        refs(&output),
        1,
        f32_type(),
        SoftmaxVariant::Softmax,
        SoftmaxOptions::default(),
    )
    .expect("valid launch")
    .expect("non-empty");
    assert_eq!(plan.tier, SoftmaxTier::Plane);
    let got = read(&client, output);
    for r in 0..4 {
        let row = &values[r * 6..r * 6 + 6];
        let m = row.iter().copied().fold(f32::MIN, f32::max) as f64;
        let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        for j in 0..6 {
            let want = (row[j] as f64 - m).exp() / s;
            assert!(
                (got[r * 6 + j] as f64 - want).abs() < 1e-6,
                "row {r} col {j}"
            );
        }
    }
}

#[test]
fn invalid_dim_is_refused() {
    let (err, output) = refused(&[2, 3], &[3, 1], 2, f32_type(), SoftmaxOptions::default());
    assert_eq!(err, SoftmaxError::InvalidDim { dim: 2, rank: 2 });
    assert_eq!(
        err.to_string(),
        "dim 2 is out of range for a tensor of rank 2"
    );
    assert!(output.iter().all(|v| v.is_nan()), "nothing was launched");
}

#[test]
fn non_float_dtype_is_refused() {
    let int = i32::as_type_native_unchecked().storage_type();
    let (err, _) = refused(&[2, 3], &[3, 1], 1, int, SoftmaxOptions::default());
    assert!(matches!(err, SoftmaxError::UnsupportedDType { .. }));
    assert!(err.to_string().starts_with("dtype "), "{err}");
    assert!(
        err.to_string()
            .ends_with("is not supported (f32, f16 and bf16 are, where the device has them)"),
        "{err}"
    );
}

#[test]
fn mismatched_shapes_are_refused() {
    let client = client();
    let (input, output) = buffers(&client, &[1.0; 6]);
    let (shape, strides) = ([2usize, 3], [3usize, 1]);
    let (bad_shape, bad_strides) = ([3usize, 2], [2usize, 1]);
    let t = |h| TensorRef {
        handle: h,
        shape: &shape,
        strides: &strides,
    };
    let bad = |h| TensorRef {
        handle: h,
        shape: &bad_shape,
        strides: &bad_strides,
    };
    let err = launch_softmax(
        &client,
        t(&input),
        bad(&output),
        1,
        f32_type(),
        SoftmaxVariant::Softmax,
        SoftmaxOptions::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`output` has shape [3, 2], expected [2, 3]"
    );
    let err = launch_softmax_backward(
        &client,
        t(&input),
        bad(&input),
        t(&output),
        1,
        f32_type(),
        SoftmaxVariant::Softmax,
        SoftmaxOptions::default(),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "`grad` has shape [3, 2], expected [2, 3]");
}

#[test]
fn impossible_forced_tier_is_refused() {
    let opts = SoftmaxOptions {
        tier: Some(SoftmaxTier::Cube),
        plane_ops: None,
    };
    let (err, _) = refused(&[3, 2], &[1, 3], 1, f32_type(), opts);
    assert_eq!(
        err.to_string(),
        "tier Cube cannot run rows of length 2: the softmax dimension is not contiguous in every tensor"
    );
}

#[test]
fn strided_scheme_refuses_rows_longer_than_its_limit() {
    let n = burn_flash_kernels::softmax::STRIDED_MAX_LEN + 1;
    let opts = SoftmaxOptions {
        tier: Some(SoftmaxTier::Strided),
        plane_ops: None,
    };
    let (err, _) = refused(&[1, n], &[n, 1], 1, f32_type(), opts);
    assert_eq!(
        err.to_string(),
        format!(
            "tier Strided cannot run rows of length {n}: the strided scheme takes rows of at most \
             16384 elements; make the softmax dimension contiguous first"
        )
    );
}
