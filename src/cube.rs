//! What every op's `CubeBackend` implementation shares: handing a tensor to the kernels crate
//! and allocating the tensors a launch writes.

use burn::tensor::{DType, Shape};
use burn_cubecl::{CubeRuntime, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use burn_flash_kernels::tensor::TensorRef;

/// `t`'s buffer, shape and strides, as the kernels crate's launches take a tensor.
pub(crate) fn tensor_ref<R: CubeRuntime>(t: &CubeTensor<R>) -> TensorRef<'_> {
    TensorRef {
        handle: &t.handle,
        shape: t.meta.shape(),
        strides: t.meta.strides(),
    }
}

/// An uninitialised contiguous tensor of `shape` and `dtype` on `like`'s device, for a kernel
/// to write.
pub(crate) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: impl Into<Shape>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}
