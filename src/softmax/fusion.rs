//! Softmax on `Fusion<B>`: an opaque custom operation that runs `B`'s kernels
//! ([`crate::fusion`]).
//!
//! Per call, the user thread only checks what can fail (`dim`, dtype; the plan only for forced
//! options) and records the operation (one for both directions).

use core::marker::PhantomData;

use burn::backend::ir::{OperationOutput, TensorId, TensorIr};
use burn::tensor::ops::FloatTensor;
use burn_flash_kernels::softmax::{SoftmaxOptions, SoftmaxVariant};
use burn_fusion::{Fusion, FusionBackend, stream::Operation};

use crate::FlashBackend;
use crate::fusion::{Handles, uninit};

/// Softmax (`inputs`: `x`) or its backward (`inputs`: `y`, `dy`), writing `out`.
#[derive(Debug)]
struct SoftmaxOp<B> {
    inputs: Vec<TensorIr>,
    out: TensorId,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for SoftmaxOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let (dim, variant, options) = (self.dim, self.variant, self.options);
        let out = match &self.inputs[..] {
            [x] => B::flash_softmax(handles.get_float_tensor::<B>(x), dim, variant, options),
            [y, dy] => {
                let y = handles.get_float_tensor::<B>(y);
                let dy = handles.get_float_tensor::<B>(dy);
                B::flash_softmax_backward(y, dy, dim, variant, options)
            }
            _ => unreachable!("softmax reads one tensor, its backward two"),
        };
        handles.register_float_tensor::<B>(&self.out, out);
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
    let op = super::check_input(variant, dim, x.shape.num_dims(), arg, x.dtype);
    if options == SoftmaxOptions::default() {
        // The heuristic's own plan always runs: only forced options can make it fail.
        return;
    }
    // The layout the op will run on: `dim` contiguous (the cube layer relays a forced row
    // scheme's input out that way).
    let dims: Vec<usize> = x.shape.iter().copied().collect();
    let strides = super::cube::dim_last_strides(&dims, dim);
    let device = x.client.device().clone();
    if let Some(planner) = B::flash_planner(&device)
        && let Err(err) = planner.softmax(&dims, &strides, dim, x.dtype, backward, options)
    {
        panic!("burn_flash::{op}: {err}");
    }
}

/// Records the op `name` on `inputs` (`x`, or `y` and `dy`); its output has the first
/// input's shape and dtype.
fn record<B: FusionBackend + FlashBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> FloatTensor<Fusion<B>> {
    let out = uninit(&inputs[0], inputs[0].shape.clone(), inputs[0].dtype);
    let op = |inputs, outputs: Vec<TensorId>| SoftmaxOp::<B> {
        inputs,
        out: outputs[0],
        dim,
        variant,
        options,
        _backend: PhantomData,
    };
    crate::fusion::record(name, inputs, vec![out], op).output()
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> FloatTensor<Fusion<B>> {
    validate::<B>(&x, dim, variant, options, "tensor", false);
    record::<B>("burn_flash::softmax", vec![x], dim, variant, options)
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
    let name = "burn_flash::softmax_backward";
    record::<B>(name, vec![y, dy], dim, variant, options)
}
