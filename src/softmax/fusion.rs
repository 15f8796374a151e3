//! Softmax on `Fusion<B>`: an opaque custom operation that runs `B`'s kernels
//! ([`crate::fusion`]).
//!
//! Per call, the user thread only checks what can fail (`dim`, dtype; the plan only for forced
//! options) and records the operation; the operation struct keeps the tensors' IR it needs, not
//! a second copy of the whole `CustomOpIr`.

use core::marker::PhantomData;

use burn::backend::ir::{HandleContainer, OperationOutput, TensorId, TensorIr};
use burn::tensor::ops::FloatTensor;
use burn_flash_kernels::softmax::{SoftmaxOptions, SoftmaxVariant};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime,
    stream::{Operation, OperationStreams},
};

use crate::FlashBackend;
use crate::fusion::{custom_op, register};

#[derive(Debug)]
struct SoftmaxOp<B> {
    x: TensorIr,
    y: TensorId,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for SoftmaxOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let x = handles.get_float_tensor::<B>(&self.x);
        let out = B::flash_softmax(x, self.dim, self.variant, self.options);
        handles.register_float_tensor::<B>(&self.y, out);
    }
}

#[derive(Debug)]
struct SoftmaxBackwardOp<B> {
    y: TensorIr,
    dy: TensorIr,
    dx: TensorId,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for SoftmaxBackwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let y = handles.get_float_tensor::<B>(&self.y);
        let dy = handles.get_float_tensor::<B>(&self.dy);
        let out = B::flash_softmax_backward(y, dy, self.dim, self.variant, self.options);
        handles.register_float_tensor::<B>(&self.dx, out);
    }
}

/// Fusion runs the op later, on its own thread, where a panic would only surface at the next
/// sync: check everything the shape tells now (dim, dtype, a forced scheme's feasibility).
fn validate<B: FusionBackend + FlashBackend>(
    x: &FloatTensor<Fusion<B>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
    arg: &str,
    backward: bool,
) {
    let op = super::variant_name(variant);
    super::check_dim(op, dim, x.shape.num_dims());
    super::cube::check_dtype(op, arg, x.dtype);
    if options == SoftmaxOptions::default() {
        // The heuristic's own plan always runs: only forced options can make it fail.
        return;
    }
    // The layout the op will run on: `dim` contiguous (the cube layer relays a forced row
    // scheme's input out that way).
    let dims: Vec<usize> = x.shape.iter().copied().collect();
    let strides = super::cube::dim_last_strides(&dims, dim);
    let device = x.client.device().clone();
    if let Some(Err(err)) =
        B::flash_softmax_plan(&device, &dims, &strides, dim, x.dtype, backward, options)
    {
        panic!("burn_flash::{op}: {err}");
    }
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> FloatTensor<Fusion<B>> {
    validate::<B>(&x, dim, variant, options, "tensor", false);
    let client = x.client.clone();
    let streams = OperationStreams::with_inputs([&x]);
    let out = TensorIr::uninit(client.create_empty_handle(), x.shape.clone(), x.dtype);
    let x = x.into_ir();
    let op = SoftmaxOp::<B> {
        x: x.clone(),
        y: out.id,
        dim,
        variant,
        options,
        _backend: PhantomData,
    };
    let desc = custom_op("burn_flash::softmax", vec![x], vec![out]);
    register(&client, streams, desc, op).output()
}

pub(crate) fn backward<B: FusionBackend + FlashBackend>(
    y: FloatTensor<Fusion<B>>,
    dy: FloatTensor<Fusion<B>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> FloatTensor<Fusion<B>> {
    validate::<B>(&y, dim, variant, options, "output", true);
    if dy.shape != y.shape {
        panic!(
            "burn_flash::{} backward: `grad` has shape {:?}, the output has {:?}",
            super::variant_name(variant),
            dy.shape,
            y.shape
        );
    }
    let client = y.client.clone();
    let streams = OperationStreams::with_inputs([&y, &dy]);
    let out = TensorIr::uninit(client.create_empty_handle(), y.shape.clone(), y.dtype);
    let (y, dy) = (y.into_ir(), dy.into_ir());
    let op = SoftmaxBackwardOp::<B> {
        y: y.clone(),
        dy: dy.clone(),
        dx: out.id,
        dim,
        variant,
        options,
        _backend: PhantomData,
    };
    let desc = custom_op("burn_flash::softmax_backward", vec![y, dy], vec![out]);
    register(&client, streams, desc, op).output()
}
