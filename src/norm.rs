//! [`layer_norm`]: layer normalisation over the last dimension in one kernel on CubeCL backends
//! ([`burn_flash_kernels::norm`]), one custom operation on `Fusion`, and Burn's own composition
//! elsewhere (NdArray, and `Autodiff`, where it is tracked).

use burn::tensor::{
    DType, Tensor, TensorPrimitive,
    backend::Backend,
    ops::{FloatTensor, ModuleOps},
};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_flash_kernels::norm::{LayerNormTensors, launch_layer_norm};
use burn_fusion::{Fusion, FusionBackend};

use crate::FlashBackend;
use crate::cube::{empty, tensor_ref};
use crate::fusion::{RowsFn, record_rows_op, uninit};

const OP: &str = "burn_flash::layer_norm";

/// `(x − mean) / √(var + ε) · γ + β` over the last dimension of `x` (`[…, d]`), `gamma` and
/// `beta` `[d]`: Burn's `LayerNorm` as one op. The mean and the biased variance are taken in
/// f32 (two passes over the row), the output is in `x`'s dtype; `gamma` and `beta` are cast to
/// it where they differ. Forward only on the fused path: under `Autodiff` this is Burn's
/// composed layer norm, whose gradients flow as usual.
///
/// # Panics
/// When `gamma` or `beta` is not `[d]`, or a tensor is on another device.
pub fn layer_norm<B: FlashBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    epsilon: f64,
) -> Tensor<B, D> {
    let width = x.dims()[D - 1];
    let device = x.device();
    let dtype = x.dtype();
    for (name, p) in [("gamma", Some(&gamma)), ("beta", beta.as_ref())] {
        if let Some(p) = p {
            if p.dims() != [width] {
                panic!(
                    "{OP}: `{name}` has shape {:?}, expected [{width}]",
                    p.dims()
                );
            }
            if p.device() != device {
                panic!("{OP}: `{name}` is on {:?}, `x` on {device:?}", p.device());
            }
        }
    }
    let param = |p: Tensor<B, 1>| match p.dtype() == dtype {
        true => p,
        false => p.cast(dtype),
    };
    Tensor::from_primitive(TensorPrimitive::Float(B::flash_layer_norm(
        x.into_primitive().tensor(),
        param(gamma).into_primitive().tensor(),
        beta.map(|b| param(b).into_primitive().tensor()),
        epsilon,
    )))
}

/// Burn's composed layer norm ([`crate::SoftmaxBackend::flash_layer_norm`]'s provided body).
pub(crate) fn composed<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    epsilon: f64,
) -> FloatTensor<B> {
    B::layer_norm(x, gamma, beta, epsilon)
}

/// The kernel on `CubeBackend` ([`crate::SoftmaxBackend::flash_layer_norm`]).
pub(crate) fn cube<R, F, I, BT>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: Option<CubeTensor<R>>,
    epsilon: f64,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let dtype = x.dtype;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        // Not a kernel dtype (f64): Burn's composition.
        return <CubeBackend<R, F, I, BT> as ModuleOps<_>>::layer_norm(x, gamma, beta, epsilon);
    }
    let out = empty(&x, x.meta.shape().clone(), dtype);
    launch_layer_norm::<R>(
        &x.client,
        LayerNormTensors {
            x: tensor_ref(&x),
            gamma: tensor_ref(&gamma),
            beta: beta.as_ref().map(tensor_ref),
            out: tensor_ref(&out),
        },
        epsilon,
        dtype.into(),
    )
    .unwrap_or_else(|err| panic!("{OP}: {err}"));
    out
}

/// The layer norm on `Fusion<B>` ([`crate::SoftmaxBackend::flash_layer_norm`]): one custom
/// operation.
pub(crate) fn fusion<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    gamma: FloatTensor<Fusion<B>>,
    beta: Option<FloatTensor<Fusion<B>>>,
    epsilon: f64,
) -> FloatTensor<Fusion<B>> {
    let out = uninit(&x, x.shape.clone(), x.dtype);
    let run: RowsFn<B> = |x, g, b, eps| B::flash_layer_norm(x, g, b, eps);
    record_rows_op::<B>(OP, (x, gamma, beta), out, epsilon, run)
}
