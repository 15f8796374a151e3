//! Softmax, log-softmax and quiet softmax as fused Burn operations.
//!
//! Semantics are those of `burn::tensor::activation` with one documented difference: a row
//! whose elements are all −inf (a fully masked row) gives zeros from [`softmax`] and
//! [`quiet_softmax`] and −inf from [`log_softmax`], never NaN. A row containing NaN gives NaN.

pub(crate) mod autodiff;
pub(crate) mod backend;
pub(crate) mod cube;
pub(crate) mod fusion;
pub mod reference;

use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_flash_kernels::softmax::{RowLimits, SoftmaxError, SoftmaxPlan};
pub use burn_flash_kernels::softmax::{SoftmaxOptions, SoftmaxTier, SoftmaxVariant};

use crate::FlashBackend;

/// Panics with Burn's message style when `dim` is not a dimension of a rank-`rank` tensor.
pub(crate) fn check_dim(op: &str, dim: usize, rank: usize) {
    if dim >= rank {
        panic!("burn_flash::{op}: `dim` is {dim}, out of range for a tensor of rank {rank}");
    }
}

/// Panics with Burn's message style unless `dim` is a dimension of a rank-`rank` tensor and
/// `dtype` one the kernels run (`arg` names the tensor); returns the op's name.
pub(crate) fn check_input(
    variant: SoftmaxVariant,
    dim: usize,
    rank: usize,
    arg: &str,
    dtype: burn::tensor::DType,
) -> &'static str {
    let op = variant_name(variant);
    check_dim(op, dim, rank);
    cube::check_dtype(op, arg, dtype);
    op
}

/// Fused softmax along `dim`: `y = e^x / Σ e^x`. Drop-in for
/// `burn::tensor::activation::softmax`.
///
/// # Panics
/// If `dim >= D`, or (CubeCL backends) if the tensor's dtype is not f32, f16 or bf16 or the
/// device does not support it.
pub fn softmax<const D: usize, B: FlashBackend>(tensor: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    with_defaults(tensor, dim, SoftmaxVariant::Softmax)
}

/// Fused log-softmax along `dim`: `y = x − ln Σ e^x`. Drop-in for
/// `burn::tensor::activation::log_softmax`.
///
/// # Panics
/// As [`softmax`].
pub fn log_softmax<const D: usize, B: FlashBackend>(
    tensor: Tensor<B, D>,
    dim: usize,
) -> Tensor<B, D> {
    with_defaults(tensor, dim, SoftmaxVariant::LogSoftmax)
}

/// Fused quiet softmax along `dim`: `y = e^x / (1 + Σ e^x)`. Drop-in for
/// `burn::tensor::activation::quiet_softmax`.
///
/// # Panics
/// As [`softmax`].
pub fn quiet_softmax<const D: usize, B: FlashBackend>(
    tensor: Tensor<B, D>,
    dim: usize,
) -> Tensor<B, D> {
    with_defaults(tensor, dim, SoftmaxVariant::QuietSoftmax)
}

/// Any member of the softmax family with explicit launch options (forcing a row scheme or
/// plane operations; the defaults are what [`softmax`] uses).
///
/// # Panics
/// As [`softmax`], and if a forced scheme cannot run this shape.
pub fn softmax_with<const D: usize, B: FlashBackend>(
    tensor: Tensor<B, D>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> Tensor<B, D> {
    check_dim(variant_name(variant), dim, D);
    let y = B::flash_softmax(tensor.into_primitive().tensor(), dim, variant, options);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// The launch the fused softmax (or its `backward`) would make on `device` along `dim` of
/// tensors of `shape` and `strides` (`None`: the backend runs the composed fallback, e.g.
/// NdArray; under `Autodiff<B>`, `B`'s plan).
pub fn softmax_plan<B: FlashBackend>(
    device: &B::Device,
    shape: &[usize],
    strides: &[usize],
    dim: usize,
    dtype: DType,
    backward: bool,
    options: SoftmaxOptions,
) -> Option<Result<SoftmaxPlan, SoftmaxError>> {
    B::flash_planner(device).map(|p| p.softmax(shape, strides, dim, dtype, backward, options))
}

/// The longest rows each register tier of the fused softmax takes on `device` (`None`: the
/// backend has no fused kernels).
pub fn softmax_row_limits<B: FlashBackend>(
    device: &B::Device,
    dtype: DType,
    options: SoftmaxOptions,
) -> Option<Result<RowLimits, SoftmaxError>> {
    B::flash_planner(device).map(|p| p.softmax_row_limits(dtype, options))
}

/// [`softmax_with`] with the default options.
fn with_defaults<const D: usize, B: FlashBackend>(
    tensor: Tensor<B, D>,
    dim: usize,
    variant: SoftmaxVariant,
) -> Tensor<B, D> {
    softmax_with(tensor, dim, variant, SoftmaxOptions::default())
}

pub(crate) fn variant_name(variant: SoftmaxVariant) -> &'static str {
    match variant {
        SoftmaxVariant::Softmax => "softmax",
        SoftmaxVariant::LogSoftmax => "log_softmax",
        SoftmaxVariant::QuietSoftmax => "quiet_softmax",
    }
}
