//! `softmax(X)·V` without materialising the softmax: [`softmax_matmul`].
//!
//! The fused op keeps, per row of `X`, a running maximum, a running sum and an f32 output
//! accumulator, and walks the softmax dimension in blocks, so memory is inputs + output + one
//! f32 per row (the log-sum-exp saved for the backward). The backward recomputes the softmax
//! block by block from that log-sum-exp.

pub(crate) mod autodiff;
pub(crate) mod backend;
pub(crate) mod cube;
pub(crate) mod fusion;
pub mod reference;

use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};

pub use burn_flash_kernels::softmax_matmul::{
    BLOCK_SIZES, SmmDims, SmmForwardKernel, SmmPath, SoftmaxMatmulError, SoftmaxMatmulOptions,
    SoftmaxMatmulPlan,
};

use crate::{FlashBackend, SoftmaxMatmulBackend};

/// `softmax(x, D − 1)·v` in one fused op: `x` is `[..batch, d1, d2]`, `v` is `[..batch, d2, d3]`
/// (the same leading dims) or `[d2, d3]` (one `v` shared by every batch), the result
/// `[..batch, d1, d3]`.
///
/// Forward and backward run fused kernels on CubeCL backends (CUDA, wgpu) and never create the
/// `d1 × d2` softmax matrix; other backends get the composed `softmax(x).matmul(v)`. A row of
/// `x` that is entirely −inf gives a row of zeros (not NaN).
///
/// # Panics
/// Before any launch, with a message naming the argument: ranks (`x` at least 2-D, `v` of
/// `x`'s rank or 2-D), mismatched `d2` or batch dims, different dtypes or devices, a dtype
/// other than f32/f16/bf16.
///
/// ```no_run
/// use burn::backend::Wgpu;
/// use burn::tensor::{Distribution, Tensor};
///
/// let device = Default::default();
/// let x = Tensor::<Wgpu, 4>::random([2, 8, 128, 512], Distribution::Default, &device);
/// let v = Tensor::<Wgpu, 4>::random([2, 8, 512, 64], Distribution::Default, &device);
/// let out = burn_flash::softmax_matmul(x, v); // [2, 8, 128, 64]
/// ```
pub fn softmax_matmul<B: SoftmaxMatmulBackend, const D: usize, const DV: usize>(
    x: Tensor<B, D>,
    v: Tensor<B, DV>,
) -> Tensor<B, D> {
    softmax_matmul_with(x, v, SoftmaxMatmulOptions::default())
}

/// [`softmax_matmul`] with the heuristic's choices overridden (block sizes, path). A
/// forced choice the device or shape cannot run panics with the reason before any launch.
pub fn softmax_matmul_with<B: SoftmaxMatmulBackend, const D: usize, const DV: usize>(
    x: Tensor<B, D>,
    v: Tensor<B, DV>,
    options: SoftmaxMatmulOptions,
) -> Tensor<B, D> {
    let (x3, v3, out_shape) = as_rank3(x, v);
    if x3.dims()[2] == 0 {
        // No columns: every row is empty, hence zeros. Nothing to launch (CUDA refuses the
        // empty buffers as kernel arguments).
        return Tensor::<B, D>::zeros(out_shape, &x3.device()).cast(x3.dtype());
    }
    let (out, _lse) = B::flash_softmax_matmul(
        x3.into_primitive().tensor(),
        v3.into_primitive().tensor(),
        crate::plan_defaults::softmax_matmul_options(options),
    );
    Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out)).reshape(out_shape)
}

/// The plan the fused forward would run for contiguous `x` of shape `[..batch, d1, d2]` and `v`
/// with `d3` columns on `device`: the kernel ([`SmmForwardKernel`]), its tiles and grid
/// (`None`: the backend uses the composed fallback).
pub fn softmax_matmul_plan<B: FlashBackend>(
    device: &B::Device,
    dims: SmmDims,
    dtype: DType,
    options: SoftmaxMatmulOptions,
) -> Option<Result<SoftmaxMatmulPlan, SoftmaxMatmulError>> {
    let options = crate::plan_defaults::softmax_matmul_options(options);
    B::flash_planner(device).map(|p| p.softmax_matmul(dims, dtype, options))
}

/// Checks the arguments and flattens them to `[batch, d1, d2]` and `[1 or batch, d2, d3]`;
/// returns the output's shape.
fn as_rank3<B: SoftmaxMatmulBackend, const D: usize, const DV: usize>(
    x: Tensor<B, D>,
    v: Tensor<B, DV>,
) -> (Tensor<B, 3>, Tensor<B, 3>, Shape) {
    const OP: &str = "burn_flash::softmax_matmul";
    if D < 2 {
        panic!("{OP}: `x` must have at least 2 dims ([..batch, d1, d2]), it has {D}");
    }
    if DV != D && DV != 2 {
        panic!("{OP}: `v` must have the rank of `x` ({D}) or rank 2 (shared), it has {DV}");
    }
    let xs = x.shape();
    let vs = v.shape();
    let (d1, d2) = (xs[D - 2], xs[D - 1]);
    let (vd2, d3) = (vs[DV - 2], vs[DV - 1]);
    if vd2 != d2 {
        panic!(
            "{OP}: `v` has {vd2} rows but `x` has {d2} columns (x {:?}, v {:?})",
            xs.as_slice(),
            vs.as_slice()
        );
    }
    let lead = &xs[..D - 2];
    let v_lead = &vs[..DV - 2];
    let batch: usize = lead.iter().product();
    let v_batch = if DV == 2 || v_lead.iter().all(|&d| d == 1) {
        1
    } else if v_lead == lead {
        batch
    } else {
        panic!(
            "{OP}: `v`'s batch dims {v_lead:?} differ from `x`'s {lead:?} (use equal dims, all \
             ones, or a 2-D `v`)"
        );
    };
    check_dtypes(x.dtype(), v.dtype());
    if x.device() != v.device() {
        panic!("{OP}: `x` is on {:?}, `v` on {:?}", x.device(), v.device());
    }
    let mut out_shape: Vec<usize> = lead.to_vec();
    out_shape.extend([d1, d3]);
    (
        x.reshape([batch, d1, d2]),
        v.reshape([v_batch, d2, d3]),
        Shape::from(out_shape),
    )
}

/// Panics unless `x` has a dtype the kernels run and `v` has the same.
pub(crate) fn check_dtypes(x: DType, v: DType) {
    crate::softmax::cube::check_dtype("softmax_matmul", "x", x);
    if v != x {
        panic!("burn_flash::softmax_matmul: `v` has dtype {v:?}, `x` has {x:?}");
    }
}

/// Panics with the op's name unless `v` is `[1 or batch, d2, d3]` for `x` of `[batch, d1, d2]`
/// (the contract of the backend methods).
pub(crate) fn dims_of(x: &[usize], v: &[usize]) -> SmmDims {
    let ok = x.len() == 3 && v.len() == 3 && (v[0] == x[0] || v[0] == 1) && v[1] == x[2];
    if !ok {
        panic!(
            "burn_flash::softmax_matmul: `x` {x:?} and `v` {v:?} are not [b, d1, d2], [b or 1, d2, d3]"
        );
    }
    SmmDims {
        batch: x[0],
        d1: x[1],
        d2: x[2],
        d3: v[2],
    }
}
