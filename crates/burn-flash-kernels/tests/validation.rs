//! Every validation path of the host launch functions (softmax and `softmax(X)·V`) refuses bad
//! input with its message, and launches nothing. Runs on wgpu (lavapipe on CPU-only machines).

#![cfg(feature = "wgpu")]

use burn_flash_kernels::softmax::{
    SoftmaxError, SoftmaxOptions, SoftmaxPlan, SoftmaxTier, SoftmaxVariant, TensorRef,
    launch_softmax, launch_softmax_backward,
};
use burn_flash_kernels::softmax_matmul::{
    SmmPath, SoftmaxMatmulError, SoftmaxMatmulOptions, SoftmaxMatmulPlan, check_dtype,
    launch_softmax_matmul, launch_softmax_matmul_backward,
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

/// Launches a forward softmax from `input` to `output`, both of `shape` and `strides`.
fn forward(
    client: &ComputeClient<WgpuRuntime>,
    (input, output): (&cubecl::server::Handle, &cubecl::server::Handle),
    shape: &[usize],
    strides: &[usize],
    dim: usize,
    dtype: StorageType,
    options: SoftmaxOptions,
) -> Result<Option<SoftmaxPlan>, SoftmaxError> {
    let t = |h| TensorRef {
        handle: h,
        shape,
        strides,
    };
    let variant = SoftmaxVariant::Softmax;
    launch_softmax(client, t(input), t(output), dim, dtype, variant, options)
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
    let err = forward(
        &client,
        (&input, &output),
        shape,
        strides,
        dim,
        dtype,
        options,
    );
    (err.unwrap_err(), read(&client, output))
}

#[test]
fn launch_without_burn_computes_softmax() {
    let client = client();
    let values: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let (input, output) = buffers(&client, &values);
    let options = SoftmaxOptions::default();
    let plan = forward(
        &client,
        (&input, &output),
        &[4, 6],
        &[6, 1],
        1,
        f32_type(),
        options,
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
        unit_vectors: None,
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
        unit_vectors: None,
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

// -- softmax(X)·V --

/// Buffers of a `softmax(X)·V` call: `x` `[b, d1, d2]`, `v` `[vb, d2, d3]`, `out` `[b, d1, d3]`
/// (NaN), `lse` `[b, d1]` (NaN); the shapes of each can be overridden to be wrong.
struct Smm {
    client: ComputeClient<WgpuRuntime>,
    x: cubecl::server::Handle,
    v: cubecl::server::Handle,
    out: cubecl::server::Handle,
    lse: cubecl::server::Handle,
    shapes: [Vec<usize>; 4],
}

impl Smm {
    fn new(b: usize, vb: usize, d1: usize, d2: usize, d3: usize) -> Self {
        let client = client();
        let n = |s: &[usize]| s.iter().product::<usize>();
        let shapes = [
            vec![b, d1, d2],
            vec![vb, d2, d3],
            vec![b, d1, d3],
            vec![b, d1],
        ];
        let fill = |s: &[usize], v: f32| client.create_from_slice(f32::as_bytes(&vec![v; n(s)]));
        Self {
            x: fill(&shapes[0], 0.5),
            v: fill(&shapes[1], 0.25),
            out: fill(&shapes[2], f32::NAN),
            lse: fill(&shapes[3], f32::NAN),
            client,
            shapes,
        }
    }

    /// Launches the forward on `x` and `v` with each tensor's (possibly overridden) shape and
    /// contiguous strides.
    fn launch(
        &self,
        x: &cubecl::server::Handle,
        v: &cubecl::server::Handle,
        dtype: StorageType,
        options: SoftmaxMatmulOptions,
    ) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
        let strides: Vec<Vec<usize>> = self.shapes.iter().map(|s| contiguous(s)).collect();
        let t = |i: usize, h| TensorRef {
            handle: h,
            shape: &self.shapes[i],
            strides: &strides[i],
        };
        launch_softmax_matmul(
            &self.client,
            t(0, x),
            t(1, v),
            t(2, &self.out),
            t(3, &self.lse),
            dtype,
            options,
        )
    }

    /// Launches the forward on its own `x` and `v`; the error must come back and both outputs
    /// stay NaN.
    fn refused(&self, dtype: StorageType, options: SoftmaxMatmulOptions) -> SoftmaxMatmulError {
        let err = self.launch(&self.x, &self.v, dtype, options).unwrap_err();
        for h in [&self.out, &self.lse] {
            let values = read(&self.client, h.clone());
            assert!(values.iter().all(|v| v.is_nan()), "{err}: nothing launched");
        }
        err
    }
}

/// Row-major strides of `shape`.
fn contiguous(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

#[test]
fn softmax_matmul_shape_errors_name_the_argument() {
    let mut smm = Smm::new(2, 2, 5, 8, 3);
    smm.shapes[1] = vec![2, 7, 3];
    let err = smm.refused(f32_type(), Default::default());
    assert_eq!(
        err,
        SoftmaxMatmulError::ShapeMismatch {
            arg: "v",
            expected: vec![2, 8, 3],
            got: vec![2, 7, 3],
        }
    );
    assert_eq!(
        err.to_string(),
        "`v` has shape [2, 7, 3], expected [2, 8, 3]"
    );

    let mut smm = Smm::new(2, 2, 5, 8, 3);
    smm.shapes[2] = vec![2, 5, 4];
    let err = smm.refused(f32_type(), Default::default());
    assert_eq!(
        err.to_string(),
        "`out` has shape [2, 5, 4], expected [2, 5, 3]"
    );

    let mut smm = Smm::new(2, 2, 5, 8, 3);
    smm.shapes[3] = vec![2, 4];
    let err = smm.refused(f32_type(), Default::default());
    assert_eq!(err.to_string(), "`lse` has shape [2, 4], expected [2, 5]");

    let mut smm = Smm::new(2, 2, 5, 8, 3);
    smm.shapes[0] = vec![10, 8];
    let err = smm.refused(f32_type(), Default::default());
    assert_eq!(err.to_string(), "`x` has shape [10, 8], expected [0, 0, 0]");
}

#[test]
fn softmax_matmul_backward_shape_errors_name_the_argument() {
    let client = client();
    let (b, d1, d2, d3) = (2, 5, 8, 3);
    let shapes: [Vec<usize>; 7] = [
        vec![b, d1, d2],
        vec![b, d2, d3],
        vec![b, d1, d3],
        vec![b, d1],
        vec![b, d1, d3],
        vec![b, d1, d2 + 1],
        vec![b, d2, d3],
    ];
    let handles: Vec<_> = shapes
        .iter()
        .map(|s| {
            let n = s.iter().product::<usize>();
            client.create_from_slice(f32::as_bytes(&vec![f32::NAN; n]))
        })
        .collect();
    let strides: Vec<Vec<usize>> = shapes.iter().map(|s| contiguous(s)).collect();
    let t = |i: usize| TensorRef {
        handle: &handles[i],
        shape: &shapes[i],
        strides: &strides[i],
    };
    let err = launch_softmax_matmul_backward(
        &client,
        t(0),
        t(1),
        t(2),
        t(3),
        t(4),
        t(5),
        t(6),
        f32_type(),
        Default::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`dx` has shape [2, 5, 9], expected [2, 5, 8]"
    );
    let dv = read(&client, handles[6].clone());
    assert!(dv.iter().all(|v| v.is_nan()), "nothing launched");
}

#[test]
fn softmax_matmul_dtype_and_block_errors() {
    let smm = Smm::new(1, 1, 4, 8, 4);
    let int = i32::as_type_native_unchecked().storage_type();
    let err = smm.refused(int, Default::default());
    assert!(matches!(err, SoftmaxMatmulError::UnsupportedDType { .. }));
    assert!(
        err.to_string()
            .ends_with("is not supported (f32, f16 and bf16 are, where the device has them)"),
        "{err}"
    );

    let options = SoftmaxMatmulOptions {
        blocks: Some((48, 32)),
        ..Default::default()
    };
    let err = smm.refused(f32_type(), options);
    assert_eq!(
        err.to_string(),
        "block sizes (48, 32) cannot run: each block size must be one of [16, 32, 64]"
    );
}

#[test]
fn softmax_matmul_matrix_units_are_refused_where_missing() {
    let smm = Smm::new(1, 1, 4, 8, 4);
    let options = SoftmaxMatmulOptions {
        path: Some(SmmPath::MatrixUnits),
        ..Default::default()
    };
    // f32 never runs on the matrix units, on any device.
    let err = smm.refused(f32_type(), options);
    assert_eq!(
        err.to_string(),
        "path MatrixUnits is not available: f32 never runs on the matrix units (their f32 mode \
         rounds to TF32)"
    );
    // wgpu has no manual mma for f16 either.
    let f16_type = StorageType::Scalar(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F16));
    if check_dtype(&smm.client, f16_type).is_ok() {
        let err = smm.refused(f16_type, options);
        assert_eq!(
            err.to_string(),
            format!(
                "path MatrixUnits is not available: this device has no manual mma and ldmatrix \
                 for {f16_type:?}"
            )
        );
    }
}

#[test]
fn softmax_matmul_runs_more_batches_than_a_grid_axis_holds() {
    // More batches than wgpu's 65 535 cubes per axis: the flash grid folds them over y and z.
    // One score per row: out[b] = v[b] and lse[b] = x[b], every batch with its own values.
    let batch = 70_000;
    let smm = Smm::new(batch, batch, 1, 1, 1);
    let x: Vec<f32> = (0..batch).map(|b| (b % 977) as f32 * 0.01 - 3.0).collect();
    let v: Vec<f32> = (0..batch).map(|b| b as f32).collect();
    let x_h = smm.client.create_from_slice(f32::as_bytes(&x));
    let v_h = smm.client.create_from_slice(f32::as_bytes(&v));
    let plan = smm
        .launch(&x_h, &v_h, f32_type(), Default::default())
        .expect("launch");
    assert!(plan.cubes.2 <= 65_535 && plan.cubes.1 >= 2, "{plan:?}");
    let out = read(&smm.client, smm.out.clone());
    let lse = read(&smm.client, smm.lse.clone());
    for b in 0..batch {
        assert_eq!(out[b], v[b], "out[{b}]");
        assert!(
            (lse[b] - x[b]).abs() <= 1e-6,
            "lse[{b}] = {}, want {}",
            lse[b],
            x[b]
        );
    }
}

/// Shapes of one attention call: q, k, v, out, lse, and an optional mask (bias none).
struct AttnShapes {
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    out: [usize; 4],
    lse: [usize; 3],
    mask: Option<[usize; 4]>,
}

impl AttnShapes {
    /// Shapes that fit each other: batch `b`, `hq` query and `hkv` key/value heads, `seq`
    /// positions, head dims `d` (queries, keys) and `dv` (values), no mask.
    fn new(b: usize, hq: usize, hkv: usize, seq: usize, d: usize, dv: usize) -> Self {
        Self {
            q: [b, hq, seq, d],
            k: [b, hkv, seq, d],
            v: [b, hkv, seq, dv],
            out: [b, hq, seq, dv],
            lse: [b, hq, seq],
            mask: None,
        }
    }
}

/// Launches an attention forward that must be refused; returns the error and the output and
/// lse buffers afterwards (NaN-filled before: still NaN means nothing ran).
fn attention_refused(
    s: AttnShapes,
    options: burn_flash_kernels::attention::AttentionOptions,
) -> (
    burn_flash_kernels::attention::AttentionError,
    Vec<f32>,
    Vec<f32>,
) {
    use burn_flash_kernels::attention::launch_attention;
    let client = client();
    let n = |shape: &[usize]| shape.iter().product::<usize>().max(1);
    let filled = |shape: &[usize]| client.create_from_slice(f32::as_bytes(&vec![0.25; n(shape)]));
    let nan = |shape: &[usize]| client.create_from_slice(f32::as_bytes(&vec![f32::NAN; n(shape)]));
    let (q, k, v) = (filled(&s.q), filled(&s.k), filled(&s.v));
    let mask = s.mask.map(|m| filled(&m));
    let (out, lse) = (nan(&s.out), nan(&s.lse));
    let strides: Vec<Vec<usize>> = [&s.q[..], &s.k, &s.v, &s.out, &s.lse]
        .iter()
        .map(|shape| contiguous(shape))
        .collect();
    let mask_dims = s.mask.unwrap_or([0; 4]);
    let mask_strides = contiguous(&mask_dims);
    let t = |handle, shape, strides| TensorRef {
        handle,
        shape,
        strides,
    };
    let err = launch_attention(
        &client,
        t(&q, &s.q, &strides[0]),
        t(&k, &s.k, &strides[1]),
        t(&v, &s.v, &strides[2]),
        mask.as_ref().map(|h| t(h, &mask_dims, &mask_strides)),
        None,
        None,
        None,
        None,
        t(&out, &s.out, &strides[3]),
        t(&lse, &s.lse, &strides[4]),
        f32_type(),
        &options,
    )
    .unwrap_err();
    (err, read(&client, out), read(&client, lse))
}

#[test]
fn attention_launch_refuses_bad_input() {
    use burn_flash_kernels::attention::{AttentionError, AttentionKernel, AttentionOptions};
    let options = AttentionOptions {
        scale: 0.125,
        ..Default::default()
    };
    let good = || AttnShapes::new(2, 4, 2, 8, 32, 16);
    // Each case changes one thing of a good call: its shapes or its options.
    let shapes = |change: fn(&mut AttnShapes)| {
        let mut s = good();
        change(&mut s);
        (s, options)
    };
    let opts = |change: fn(&mut AttentionOptions)| {
        let mut o = options;
        change(&mut o);
        (good(), o)
    };
    let cases = [
        (
            shapes(|s| s.k = [2, 2, 8, 24]),
            "`k` has shape [2, 2, 8, 24], expected [2, 2, 8, 32]",
        ),
        (
            shapes(|s| s.v = [2, 2, 9, 16]),
            "`v` has shape [2, 2, 9, 16], expected [2, 2, 8, 16]",
        ),
        (
            shapes(|s| s.out = [2, 4, 8, 32]),
            "`out` has shape [2, 4, 8, 32], expected [2, 4, 8, 16]",
        ),
        (
            shapes(|s| s.lse = [2, 4, 7]),
            "`lse` has shape [2, 4, 7], expected [2, 4, 8]",
        ),
        (
            shapes(|s| s.mask = Some([2, 3, 8, 8])),
            "`mask` has shape [2, 3, 8, 8], expected [2 or 1, 4 or 1, 8 or 1, 8]",
        ),
        (
            shapes(|s| (s.k, s.v) = ([2, 3, 8, 32], [2, 3, 8, 16])),
            "expected a number of heads dividing Hq = 4",
        ),
        (
            (AttnShapes::new(1, 1, 1, 4, 288, 8), options),
            "head dims D = 288, Dv = 8 are not supported",
        ),
        (
            opts(|o| o.softcap = Some(0.0)),
            "softcap must be positive and finite",
        ),
        (opts(|o| o.scale = f32::NAN), "scale must be finite"),
        (
            opts(|o| o.masked_score = Some(f32::NEG_INFINITY)),
            "masked_score must be finite",
        ),
        (opts(|o| o.block_k = Some(64)), "block_k 64 on plain units"),
        (
            opts(|o| o.kernel = Some(AttentionKernel::MatrixUnits)),
            "kernel MatrixUnits is not available",
        ),
        (
            opts(|o| o.decode.keys_per_step = 5),
            "decode keys_per_step must be 4, 8 or 16, got 5",
        ),
        (
            opts(|o| o.decode.cubes_per_sm = 0),
            "decode cubes_per_sm must be 1 to 64, got 0",
        ),
        (
            opts(|o| {
                o.kernel = Some(AttentionKernel::Hopper);
                o.hopper = burn_flash_kernels::attention::HopperUse::Off;
            }),
            "the Hopper kernels are switched off (HopperUse::Off)",
        ),
    ];
    for ((shapes, opts), want) in cases {
        let (err, out, lse) = attention_refused(shapes, opts);
        let msg = err.to_string();
        assert!(
            msg.contains(want),
            "got `{msg}`, expected it to contain `{want}`"
        );
        assert!(
            out.iter().all(|x| x.is_nan()),
            "{msg}: the output was written"
        );
        assert!(lse.iter().all(|x| x.is_nan()), "{msg}: the lse was written");
        if want.contains("head dims") {
            assert!(matches!(err, AttentionError::UnsupportedHeadDim { .. }));
        }
    }
}
