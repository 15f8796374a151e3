//! `softmax(X)·V` on `Fusion<B>`: an opaque custom operation (two outputs forward, two
//! gradients backward) that runs `B`'s kernels ([`crate::fusion`]).

use core::marker::PhantomData;

use burn::backend::ir::{OperationOutput, TensorId, TensorIr};
use burn::tensor::ops::FloatTensor;
use burn_flash_kernels::softmax_matmul::SoftmaxMatmulOptions;
use burn_fusion::{Fusion, FusionBackend, stream::Operation};

use super::dims_of;
use crate::FlashBackend;
use crate::fusion::{Handles, out_and_lse, uninit};

/// `softmax(X)·V` (`inputs`: `x`, `v`; `outputs`: `out`, `lse`) or its backward (`inputs`:
/// `x`, `v`, `out`, `lse`, `d_out`; `outputs`: `dx`, `dv`).
#[derive(Debug)]
struct SoftmaxMatmulOp<B> {
    inputs: Vec<TensorIr>,
    outputs: Vec<TensorId>,
    /// The forward's (the backward's too).
    options: SoftmaxMatmulOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for SoftmaxMatmulOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut read = |t| handles.get_float_tensor::<B>(t);
        let (a, b) = match &self.inputs[..] {
            [x, v] => B::flash_softmax_matmul(read(x), read(v), self.options),
            [x, v, out, lse, d_out] => {
                let (x, v, out, lse, d_out) = (read(x), read(v), read(out), read(lse), read(d_out));
                B::flash_softmax_matmul_backward(x, v, out, lse, d_out, self.options)
            }
            _ => unreachable!("softmax_matmul reads two tensors, its backward five"),
        };
        handles.register_float_tensor::<B>(&self.outputs[0], a);
        handles.register_float_tensor::<B>(&self.outputs[1], b);
    }
}

/// Records the op `name` on `inputs`, writing `outputs`.
fn record<B: FusionBackend + FlashBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: [TensorIr; 2],
    options: SoftmaxMatmulOptions,
) -> [FloatTensor<Fusion<B>>; 2] {
    let op = |inputs, outputs| SoftmaxMatmulOp::<B> {
        inputs,
        outputs,
        options,
        _backend: PhantomData,
    };
    crate::fusion::record(name, inputs, outputs.into(), op).outputs()
}

/// Fusion runs the op later, on its own thread, where a panic would only surface at the next
/// sync: check dtypes and the plan now. The default plan can fail too (a dtype the device
/// lacks, more cubes than it launches), and planning is cheap next to the op's other host work
/// (RESULTS.md §10), so it stays here.
fn validate<B: FusionBackend + FlashBackend>(
    x: &FloatTensor<Fusion<B>>,
    v: &FloatTensor<Fusion<B>>,
    options: SoftmaxMatmulOptions,
) {
    super::check_dtypes(x.dtype, v.dtype);
    let dims = dims_of(&x.shape, &v.shape);
    let device = x.client.device().clone();
    if let Some(planner) = B::flash_planner(&device)
        && let Err(err) = planner.softmax_matmul(dims, x.dtype, options)
    {
        panic!("burn_flash::softmax_matmul: {err}");
    }
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    v: FloatTensor<Fusion<B>>,
    options: SoftmaxMatmulOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    validate::<B>(&x, &v, options);
    let dims = dims_of(&x.shape, &v.shape);
    let outputs = out_and_lse(&x, &[dims.batch, dims.d1], dims.d3);
    let name = "burn_flash::softmax_matmul";
    let [out, lse] = record::<B>(name, vec![x, v], outputs, options);
    (out, lse)
}

pub(crate) fn backward<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    v: FloatTensor<Fusion<B>>,
    out: FloatTensor<Fusion<B>>,
    lse: FloatTensor<Fusion<B>>,
    d_out: FloatTensor<Fusion<B>>,
    options: SoftmaxMatmulOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    validate::<B>(&x, &v, options);
    if d_out.dtype != x.dtype || d_out.shape != out.shape {
        panic!(
            "burn_flash::softmax_matmul backward: `grad` is {:?} {:?}, the output {:?} {:?}",
            d_out.dtype, d_out.shape, out.dtype, out.shape
        );
    }
    let dx = uninit(&x, x.shape.clone(), x.dtype);
    let dv = uninit(&v, v.shape.clone(), v.dtype);
    let inputs = vec![x, v, out, lse, d_out];
    let name = "burn_flash::softmax_matmul_backward";
    let [dx, dv] = record::<B>(name, inputs, [dx, dv], options);
    (dx, dv)
}
