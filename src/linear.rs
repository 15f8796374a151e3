//! [`linear`]: `x·W + b` (burn-nn's `Linear`) with a kernel for a few rows
//! ([`burn_flash_kernels::linear`]) on CubeCL backends and `Fusion` — a decoding step's
//! projections, one row per sequence — and Burn's matmul and add for more rows and elsewhere
//! (NdArray, and `Autodiff`, where it is tracked).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive, ops::FloatTensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_flash_kernels::linear::{LinearTensors, MAX_ROWS, launch_linear_rows};
use burn_fusion::{Fusion, FusionBackend};

use crate::FlashBackend;
use crate::cube::{empty, tensor_ref};
use crate::fusion::{RowsFn, record_rows_op, uninit};

const OP: &str = "burn_flash::linear";

/// `x·weight + bias` over the last dimension of `x` (`[…, K]`), `weight` `[K, N]` (burn-nn's
/// `Linear::weight`), `bias` `[N]`; returns `[…, N]`. Up to [`MAX_ROWS`] rows (the product of
/// `x`'s leading dimensions) run one kernel that reads the weight once at the memory's rate
/// (f32 sums); more rows, and backends without the kernel, run Burn's matmul and add. `weight`
/// and `bias` are cast to `x`'s dtype where they differ. Forward only on the kernel's path:
/// under `Autodiff` this is Burn's composition, whose gradients flow as usual.
///
/// # Panics
/// When `x` has no dimension, `weight` is not `[K, N]` for `x`'s `K`, `bias` is not `[N]`, or a
/// tensor is on another device.
pub fn linear<B: FlashBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let Some(&k) = dims.last() else {
        panic!("{OP}: `x` has no dimension");
    };
    let [kw, n] = weight.dims();
    if kw != k {
        panic!(
            "{OP}: `weight` has shape {:?}, expected [{k}, N] for `x` {dims:?}",
            weight.dims()
        );
    }
    let device = x.device();
    if weight.device() != device {
        panic!(
            "{OP}: `weight` is on {:?}, `x` on {device:?}",
            weight.device()
        );
    }
    if let Some(b) = &bias {
        if b.dims() != [n] {
            panic!("{OP}: `bias` has shape {:?}, expected [{n}]", b.dims());
        }
        if b.device() != device {
            panic!("{OP}: `bias` is on {:?}, `x` on {device:?}", b.device());
        }
    }
    let dtype = x.dtype();
    let weight = if weight.dtype() == dtype {
        weight
    } else {
        weight.cast(dtype)
    };
    let bias = bias.map(|b| if b.dtype() == dtype { b } else { b.cast(dtype) });
    let rows: usize = dims[..D - 1].iter().product();
    let x2: Tensor<B, 2> = x.reshape([rows, k]);
    let out = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::flash_linear(
        x2.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
    )));
    let mut shape = dims;
    shape[D - 1] = n;
    out.reshape(shape)
}

/// Burn's `x·w + b` for `x` `[M, K]` (the default of [`crate::SoftmaxBackend::flash_linear`]).
pub(crate) fn composed<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let w = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(w));
    let out = x.matmul(w);
    let out = match bias {
        Some(b) => out + Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(b)).unsqueeze(),
        None => out,
    };
    out.into_primitive().tensor()
}

/// Whether the few-rows kernel takes `x` `[M, K]` in `dtype`.
fn takes(x_shape: &Shape, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && x_shape[0] <= MAX_ROWS
        && x_shape[0] > 0
        && x_shape[1] > 0
}

/// The kernel on `CubeBackend` ([`crate::SoftmaxBackend::flash_linear`]).
pub(crate) fn cube<R, F, I, BT>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let dtype = x.dtype;
    if !takes(x.meta.shape(), dtype) {
        return composed::<CubeBackend<R, F, I, BT>>(x, w, bias);
    }
    let [m, n] = [x.meta.shape()[0], w.meta.shape()[1]];
    let out = empty(&x, [m, n], dtype);
    launch_linear_rows::<R>(
        &x.client,
        LinearTensors {
            x: tensor_ref(&x),
            w: tensor_ref(&w),
            bias: bias.as_ref().map(tensor_ref),
            out: tensor_ref(&out),
        },
        dtype.into(),
    )
    .unwrap_or_else(|err| panic!("{OP}: {err}"));
    out
}

/// The linear on `Fusion<B>` ([`crate::SoftmaxBackend::flash_linear`]): one custom operation
/// for a few rows; Burn's ops (which Fusion may fuse) for more.
pub(crate) fn fusion<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    w: FloatTensor<Fusion<B>>,
    bias: Option<FloatTensor<Fusion<B>>>,
) -> FloatTensor<Fusion<B>> {
    if !takes(&x.shape, x.dtype) {
        return composed::<Fusion<B>>(x, w, bias);
    }
    let out = uninit(&x, Shape::new([x.shape[0], w.shape[1]]), x.dtype);
    let run: RowsFn<B> = |x, w, b, _| B::flash_linear(x, w, b);
    record_rows_op::<B>(OP, (x, w, bias), out, 0.0, run)
}
