//! What every launch function takes and checks first: a tensor in device memory
//! ([`TensorRef`]) and its element type ([`check_dtype`], [`UnsupportedDType`]).

use core::fmt;

use cubecl::{prelude::*, server::Handle};

/// A tensor in device memory as the launch functions see it: a buffer, its shape and its
/// strides (in elements, any layout).
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// The buffer.
    pub handle: &'a Handle,
    /// Shape.
    pub shape: &'a [usize],
    /// Strides in elements.
    pub strides: &'a [usize],
}

/// The element type is not f32, f16 or bf16, or the device cannot run it. Each op's error has
/// an `UnsupportedDType` variant made from this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsupportedDType {
    /// The element type, as cubecl names it.
    pub dtype: String,
}

impl fmt::Display for UnsupportedDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_unsupported_dtype(f, &self.dtype)
    }
}

/// The message of [`UnsupportedDType`], and of each op's error variant made from it.
pub(crate) fn write_unsupported_dtype(f: &mut fmt::Formatter<'_>, dtype: &str) -> fmt::Result {
    write!(
        f,
        "dtype {dtype} is not supported (f32, f16 and bf16 are, where the device has them)"
    )
}

/// The message of an op's `ShapeMismatch` error: argument `arg` has shape `got`, not `expected`.
pub(crate) fn write_shape_mismatch(
    f: &mut fmt::Formatter<'_>,
    arg: &str,
    expected: &[usize],
    got: &[usize],
) -> fmt::Result {
    write!(f, "`{arg}` has shape {got:?}, expected {expected:?}")
}

impl core::error::Error for UnsupportedDType {}

/// Checks that `dtype` is a float type the kernels are written for and the device supports.
pub fn check_dtype<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
) -> Result<(), UnsupportedDType> {
    use cubecl::ir::{ElemType, FloatKind};
    let is_float = matches!(
        dtype,
        StorageType::Scalar(ElemType::Float(
            FloatKind::F32 | FloatKind::F16 | FloatKind::BF16
        ))
    );
    if !is_float || !client.properties().supports_type(dtype) {
        return Err(UnsupportedDType {
            dtype: format!("{dtype:?}"),
        });
    }
    Ok(())
}
